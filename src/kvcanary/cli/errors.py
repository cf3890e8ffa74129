"""Exit codes and one-line bad-input errors shared by every `kvcanary` command.

The rule (BRIEF, SPEC §12): bad input gets exactly one line naming the knob as the user wrote it
(the flag, or the `KVCANARY_*` variable), the bad value and the fix; the command exits 2 without
a traceback, before any long work and before it creates any file. The checks here raise
`BadInput`; `kvcanary.cli.main` prints its line. `cli/vllm.py` and future commands reuse them.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import typer

__all__ = [
    "EXIT_BAD_INPUT",
    "EXIT_CLEAN",
    "EXIT_CODES_HELP",
    "EXIT_INTERNAL",
    "EXIT_SIGINT",
    "EXIT_SIGTERM",
    "EXIT_STOPPED",
    "EXIT_VIOLATIONS",
    "BadInput",
    "ClickException",
    "check_distinct_paths",
    "check_int",
    "check_output_path",
    "explain",
    "typed_flag",
]

EXIT_CLEAN, EXIT_VIOLATIONS, EXIT_BAD_INPUT, EXIT_STOPPED, EXIT_INTERNAL = 0, 1, 2, 3, 4
EXIT_SIGINT, EXIT_SIGTERM = 130, 143

EXIT_CODES_HELP = (
    "Exit status: 0 clean; 1 violations found (or a self-test case failed); 2 bad input (one "
    "line on stderr, nothing run); 3 stopped by raise mode; 4 internal error (a bug: please "
    "report the traceback); 130 interrupted (Ctrl-C), 143 terminated (SIGTERM), both after a "
    "partial summary."
)


#: click's exception base (typer vendors click from 0.29 on; older versions use click itself)
ClickException: type[Exception] = next(
    c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException"
)


class BadInput(ClickException):  # type: ignore[misc, valid-type]
    """A bad flag, variable, path or port: `line` is the single line the user sees.

    A click exception with exit code 2, so even `app()` called directly (standalone Typer) exits
    2 with the message; `kvcanary.cli.main` prints it as one plain line.
    """

    exit_code = 2

    def __init__(self, line: str) -> None:
        super().__init__(" ".join(line.split()))
        self.line = " ".join(line.split())  # one line, whatever the message held


def check_int(flag: str, value: int, low: int, high: int, fix: str = "") -> int:
    """`value` within [low, high], else BadInput naming `flag`, the value and the fix."""
    if low <= value <= high:
        return value
    fix = fix or f"pass {flag} {low if value < low else high}"
    raise BadInput(f"{flag} must be between {low} and {high}, got {value}; {fix}")


def check_output_path(flag: str, path: Path | None) -> Path | None:
    """An output file `path` can be created or overwritten, checked without creating it."""
    if path is None:
        return None
    if str(path) == "":
        raise BadInput(f"{flag} got an empty path; pass a file name, e.g. {flag} out.json")
    if path.is_dir():
        raise BadInput(f"{flag} {path} is a directory; pass a file path inside it")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise BadInput(f"{flag} {path}: folder {parent} does not exist; create it or pick "
                       "another path")  # fmt: skip
    try:  # probe for real (root passes os.access everywhere): a temporary file, removed
        if path.exists():
            with path.open("a"):
                pass
        else:
            with tempfile.NamedTemporaryFile(dir=parent, prefix=".kvcanary-probe-"):
                pass
    except OSError as exc:
        raise BadInput(f"{flag} {path} is not writable ({exc.strerror or exc}); pick another "
                       "path or fix its permissions") from None  # fmt: skip
    return path


def check_distinct_paths(paths: Mapping[str, Path | None]) -> None:
    """No two output flags name the same file (the second would overwrite the first)."""
    seen: dict[Path, str] = {}
    for flag, path in paths.items():
        if path is None:
            continue
        key = Path(os.path.abspath(path))
        if key in seen:
            raise BadInput(f"{seen[key]} and {flag} both write {path}; give each its own file")
        seen[key] = flag


def typed_flag(argv: Sequence[str], names: Sequence[str]) -> str:
    """Which of an option's spellings the user typed (the first one when none or several)."""
    for token in argv:
        name = token.split("=", 1)[0]
        if name in names:
            return name
    return names[0]


# A library message (SPEC §6/§12 compat, "kv-canary: ...") made CLI-grade: its field names
# replaced by the command's flags and, when it carries none, a fix appended.
_FIXES: tuple[tuple[str, str], ...] = (
    (r"(KVCANARY_\w+) must be a boolean", r"set \1=1 or \1=0"),
    (r"(KVCANARY_\w+) must be an integer", r"set \1 to a whole number, or unset it"),
    (r"(KVCANARY_\w+) must be non-negative", r"set \1 to 0 or more"),
    (r"(KVCANARY_\w+) must be a probability", r"set \1 to a number between 0 and 1"),
    (r"ring_capacity must be positive", "set KVCANARY_RING_CAPACITY to 1 or more"),
    (r"TARGET_GROUP must be explicitly set", "export KVCANARY_PERTURB_TARGET_GROUP=full"),
    (r"TARGET_GROUP must be one of", "export KVCANARY_PERTURB_TARGET_GROUP=full"),
    (r"real-KV perturb modes require", "add --kv-canary-real-data partial"),
    (r"requires KVCANARY_ENABLE_WRITE_INPUT_ASSERT=1", "export KVCANARY_ENABLE_WRITE_INPUT_ASSERT=1"),
    (r"sweep_interval=\d+ requires", "add --kv-canary log, or --kv-canary-sweep-interval 0"),
    (r"must be one of ([\w/]+), got", r"pass one of \1"),
    (r"(\S+) must be non-negative", r"pass \1 0 or more"),
    (r"(\S+) must be positive", r"pass \1 1 or more"),
)  # fmt: skip


def explain(message: str, flags: Mapping[str, str]) -> str:
    """`message` with field names replaced by `flags` (field -> flag) and a fix appended."""
    line = " ".join(message.split())
    for field in sorted(flags, key=len, reverse=True):
        line = re.sub(rf"(?<![\w-]){re.escape(field)}(?![\w-])", flags[field], line)
    if ";" in line:
        return line
    for pattern, fix in _FIXES:
        match = re.search(pattern, line)
        if match:
            return f"{line}; {match.expand(fix)}"
    return f"{line}; see kvcanary -h"
