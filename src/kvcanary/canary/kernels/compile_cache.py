"""Where numba keeps the compiled fast kernels: the user's cache folder, never the package.

`configure()` runs once, from `kernels/__init__.py`, before any kernel module is decorated (numba
fixes a function's cache location when `@njit(cache=True)` runs). The folder is
`$XDG_CACHE_HOME/kvcanary/numba/<version>-<digest>` (`~/.cache` without XDG_CACHE_HOME), where
`<digest>` hashes the kernel sources: numba checks only a function's own file, so an edit of a
shared intrinsic would otherwise load stale machine code; with the digest any edit starts a new
folder. Two virtual environments on one checkout share the folder, and the installed package stays
clean. A user's own `NUMBA_CACHE_DIR` (or `numba.config.CACHE_DIR`) always wins.

Compile cost (a cold run compiles `build_plan`, `write` and `verify` once each, one signature
apiece: the runtime passes one dtype and layout per argument). Most of it was numba's own passes
over IR bloated by `inline="always"`: that inlines a callee's numba IR at every call site, which
is then type-inferred and run through the parallel passes again (mix3 and its three splitmix64
calls were re-typed at each of a dozen sites). No kernel helper is IR-inlined any more: each is a
plain `@njit` function, compiled once, and LLVM inlines it into its callers when it optimises the
linked module (same loops, same vectorisation: bench/kernels.py and the byte-equality tests).
That took a cold compile from ~23 to ~15 CPU seconds. Then three things numba does per function:
each parallel loop (`prange`) costs ~2 s whatever its body (numba builds, types and compiles a
gufunc for it), so `verify` and `write` each have one, whose body branches to serial helpers; a
helper called with the loop index is typed twice (int64, then uint64 in the gufunc) unless the
index is cast to one type first; and a helper only kernels call needs no Python- or C-callable
wrapper (`_intrinsics.internal`). With those, a fresh process compiles all three kernels in ~13
CPU seconds, and `precompile` runs the independent kernels' compiles in parallel processes.
bench/cold_start.py prints cold and warm runs side by side.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Mapping
from pathlib import Path

import numba.core.config

__all__ = [
    "COLD_START_SECONDS",
    "cache_dir",
    "configure",
    "default_cache_dir",
    "estimate_seconds",
    "is_cold",
    "record_seconds",
]

#: what a cold `kvcanary run` spends compiling on an idle 2-core machine (`precompile` on both
#: cores, bench/cold_start.py); `estimate_seconds` prefers what the last cold run here measured
COLD_START_SECONDS = 9
_LAST = "last-compile-seconds"  # beside the per-digest folders, so it outlives kernel edits

_KERNELS = Path(__file__).resolve().parent


def _sources_digest() -> str:
    digest = hashlib.sha256()
    for path in sorted(_KERNELS.glob("*.py")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def default_cache_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """The kvcanary folder under the user's cache home, keyed by version and kernel sources."""
    from kvcanary import __version__

    home = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(home) / "kvcanary" / "numba" / f"{__version__}-{_sources_digest()}"


def configure(environ: Mapping[str, str] = os.environ) -> Path | None:
    """Point numba's cache at `default_cache_dir()` unless the user chose one; the folder used
    (None: numba's own default, beside the sources, when the cache home is not writable)."""
    if environ.get("NUMBA_CACHE_DIR"):
        return Path(environ["NUMBA_CACHE_DIR"])
    if numba.core.config.CACHE_DIR:  # set in numba's config file or by the embedding program
        return Path(numba.core.config.CACHE_DIR)
    folder = default_cache_dir(environ)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    # Set in numba's config module, not os.environ: nothing else in the process changes
    # (numba re-reads the environment only when a NUMBA_* variable changes).
    numba.core.config.CACHE_DIR = str(folder)
    return folder


def cache_dir() -> Path | None:
    """The folder numba caches into now (None: its default, beside the sources)."""
    value = numba.core.config.CACHE_DIR
    return Path(value) if value else None


def is_cold() -> bool:
    """True when no kernel has been compiled into the current cache yet (the first run)."""
    folder = cache_dir()
    if folder is None:
        return not any((_KERNELS / "__pycache__").glob("*.nbi"))
    return not any(folder.rglob("*.nbi"))


def _last_file(environ: Mapping[str, str] = os.environ) -> Path:
    return default_cache_dir(environ).parent / _LAST


def estimate_seconds(environ: Mapping[str, str] = os.environ) -> int:
    """How long a cold compile will take here: the last one this machine measured (loaded or
    not), else `COLD_START_SECONDS`."""
    try:
        return max(1, round(float(_last_file(environ).read_text())))
    except (OSError, ValueError):
        return COLD_START_SECONDS


def record_seconds(seconds: float, environ: Mapping[str, str] = os.environ) -> None:
    """Remember how long this cold compile took, for the next `estimate_seconds` (best effort)."""
    with contextlib.suppress(OSError):
        _last_file(environ).write_text(f"{seconds:.1f}\n")
