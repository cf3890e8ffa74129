"""The `kvcanary` entry point: runs a command and turns every outcome into one exit status.

Typer runs in non-standalone mode so that nothing prints a Rich error box: a parse error becomes
one line echoing the value the user typed, `BadInput` its own line, a signal the 130/143 status,
and an unexpected exception (a bug) exit 4 with its traceback, never 1 ("violations found").
"""

from __future__ import annotations

import re
import signal
import sys
import traceback
from collections.abc import Sequence
from types import FrameType

import typer
import typer.main

from kvcanary.cli.errors import (
    EXIT_BAD_INPUT,
    EXIT_INTERNAL,
    EXIT_SIGINT,
    EXIT_SIGTERM,
    BadInput,
    ClickException,
    typed_flag,
)

__all__ = ["main", "usage_line"]


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    from kvcanary.app.session import Terminated

    raise Terminated


def _raw_value(argv: Sequence[str], opts: Sequence[str]) -> str | None:
    """The text the user gave an option (`--x V` or `--x=V`), for echoing it back."""
    for i, token in enumerate(argv):
        name, eq, value = token.partition("=")
        if name in opts:
            if eq:
                return value
            return argv[i + 1] if i + 1 < len(argv) else None
    return None


def usage_line(exc: Exception, argv: Sequence[str]) -> str:
    """A Typer/click parse error as one line: the option, the value typed, the fix."""
    param = getattr(exc, "param", None)
    message = " ".join(exc.format_message().split()).rstrip(".")  # type: ignore[attr-defined]
    opts = [o for o in getattr(param, "opts", []) or [] if o.startswith("-")]
    if opts:
        flag = typed_flag(argv, sorted(opts, key=len, reverse=True))
        raw = _raw_value(argv, opts)
        reason = message.split(": ", 1)[-1] if message.startswith("Invalid value") else message
        reason = reason.split(",")[0].replace("Input should be", "must be")
        default = getattr(param, "default", None)
        example = f"e.g. {flag} {default}" if default not in (None, False, True) else "see -h"
        if raw is not None:
            return f"{flag} got {raw!r}: {reason}; pass a valid value, {example}"
    missing = re.match(r"Option '(-[\w-]+)' requires an argument", message)
    if missing:
        return f"{missing.group(1)} needs a value; pass one, e.g. {missing.group(1)} VALUE (see -h)"
    return f"{message}; see -h for the flags"


def _prefix(argv: Sequence[str]) -> str:
    """`kvcanary run: ` for a line about `kvcanary run ...`."""
    from kvcanary.cli.commands import app

    names = {c.name or c.callback.__name__.replace("_", "-") for c in app.registered_commands
             if c.callback is not None}  # fmt: skip
    sub = next((a for a in argv if not a.startswith("-")), None)
    return f"kvcanary {sub}: " if sub in names else "kvcanary: "


def _line(text: str, argv: Sequence[str]) -> str:
    text = " ".join(text.split())
    text = text.removeprefix("kv-canary: ")
    return _prefix(argv) + text


def main(argv: Sequence[str] | None = None) -> int:
    """Run `kvcanary ARGV` and return its exit status (the console script exits with it)."""
    from kvcanary.app.session import Terminated, interrupt_behind
    from kvcanary.cli.commands import app

    args = list(sys.argv[1:] if argv is None else argv)
    command = typer.main.get_command(app)
    previous = signal.getsignal(signal.SIGTERM)
    in_main_thread = _install_sigterm()
    try:
        result = command.main(args=args, prog_name="kvcanary", standalone_mode=False,
                              obj={"argv": args})  # fmt: skip
        return result if isinstance(result, int) else 0
    except BadInput as exc:
        typer.echo(_line(exc.line, args), err=True)
        return EXIT_BAD_INPUT
    except ClickException as exc:  # click's UsageError family: parse errors
        if type(exc).__name__ == "NoArgsIsHelpError" and getattr(exc, "ctx", None) is not None:
            typer.echo(exc.ctx.get_help())  # type: ignore[attr-defined]
            return EXIT_BAD_INPUT
        typer.echo(_line(usage_line(exc, args), args), err=True)
        return EXIT_BAD_INPUT
    except Terminated:  # before KeyboardInterrupt, its base
        typer.echo("kvcanary: terminated", err=True)
        return EXIT_SIGTERM
    except (KeyboardInterrupt, typer.Abort):
        typer.echo("kvcanary: interrupted", err=True)
        return EXIT_SIGINT
    except Exception as exc:
        signal_exc = interrupt_behind(exc)  # a signal that landed inside compiled code
        if isinstance(signal_exc, Terminated):
            typer.echo("kvcanary: terminated", err=True)
            return EXIT_SIGTERM
        if signal_exc is not None:
            typer.echo("kvcanary: interrupted", err=True)
            return EXIT_SIGINT
        traceback.print_exc()
        typer.echo("kvcanary: internal error (a bug, not your input); please report the "
                   "traceback above", err=True)  # fmt: skip
        return EXIT_INTERNAL
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous)


def _install_sigterm() -> bool:
    try:
        signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:  # not the main thread (an embedding test runner): leave it alone
        return False
    return True
