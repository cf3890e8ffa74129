"""Suite-wide setup: a SIGTERM (a CI time limit, `timeout`, a cancelled job) stops the run the way
Ctrl-C does, so fixture teardowns still run. The vLLM servers that integration tests start run in
their own session (out of reach of signals sent to the runner's process group); without this, a
terminated run left them serving, and loading the machine, until someone killed them by hand."""

from __future__ import annotations

import signal
from types import FrameType


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_configure() -> None:
    """Take SIGTERM as an interrupt for the whole session."""
    signal.signal(signal.SIGTERM, _interrupt)
