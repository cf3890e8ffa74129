"""`kvcanary` command line: the only place that parses flags and reads the environment.

`commands` holds the commands on the built-in engine, `vllm` the `kvcanary vllm` command (it
imports vLLM only when run).
"""

from kvcanary.cli import vllm as _vllm  # noqa: F401  (registers `kvcanary vllm`)
from kvcanary.cli.commands import app
from kvcanary.cli.entry import main

__all__ = ["app", "main"]
