"""Where numba keeps the compiled fast kernels: the user's cache folder, never the package.

`configure()` runs once, from `kernels/__init__.py`, before any kernel module is decorated (numba
fixes a function's cache location when `@njit(cache=True)` runs). The folder is
`$XDG_CACHE_HOME/kvcanary/numba/<version>-<digest>` (`~/.cache` without XDG_CACHE_HOME), where
`<digest>` hashes the kernel sources: numba checks only a function's own file, so an edit of a
shared intrinsic would otherwise load stale machine code; with the digest any edit starts a new
folder. Two virtual environments on one checkout share the folder, and the installed package stays
clean. A user's own `NUMBA_CACHE_DIR` (or `numba.config.CACHE_DIR`) always wins.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path

import numba.core.config

__all__ = ["COLD_START_SECONDS", "cache_dir", "configure", "default_cache_dir", "is_cold"]

#: a cold `kvcanary run` compiles for about this long on this project's 2-core machine
COLD_START_SECONDS = 40

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
