"""The canary's configuration inside vLLM: plugin defaults, `KVCANARY_*` environment, and the
connector's `kv_connector_extra_config`, merged once at the edge into a frozen `CanaryConfig`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvcanary.canary import CanaryConfig

__all__ = ["ADAPTER_DEFAULTS", "EXTRA_KEYS", "config_from"]

#: What the plugin turns on unless told otherwise: log mode, the first 16 bytes of each token's
#: K and V (layer 0, first heads) folded, a sweep of vLLM's prefix cache every 4 steps, and the
#: token check against vLLM's own token ids (it catches self-consistent donor chains).
ADAPTER_DEFAULTS = {
    "KVCANARY_MODE": "log",
    "KVCANARY_REAL_DATA": "partial",
    "KVCANARY_SWEEP_INTERVAL": "4",
    "KVCANARY_ENABLE_VERIFY_TOKEN_ASSERT": "1",
}
#: `kv_connector_extra_config` keys and the environment variable each one sets
EXTRA_KEYS = {
    "mode": "KVCANARY_MODE",
    "real_data": "KVCANARY_REAL_DATA",
    "sweep_interval": "KVCANARY_SWEEP_INTERVAL",
    "verify_tokens": "KVCANARY_ENABLE_VERIFY_TOKEN_ASSERT",
    "enable_v": "KVCANARY_ENABLE_V",
    "ring_capacity": "KVCANARY_RING_CAPACITY",
    "verify_stride": "KVCANARY_VERIFY_STRIDE",
}
_ADAPTER_ENV = ("KVCANARY_MODE", "KVCANARY_REAL_DATA", "KVCANARY_SWEEP_INTERVAL",
                "KVCANARY_VLLM_STOP_NOTE")  # fmt: skip


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def config_from(environ: Mapping[str, str], extra: Mapping[str, Any] | None = None) -> CanaryConfig:
    """Defaults < `KVCANARY_*` in `environ` < `extra` (the connector's extra config). Raises
    ValueError with one line naming the knob for a bad value."""
    from kvcanary.canary import CanaryConfig

    merged = dict(ADAPTER_DEFAULTS)
    merged.update({k: v for k, v in environ.items() if k.startswith("KVCANARY_")})
    for key, value in (extra or {}).items():
        env = EXTRA_KEYS.get(key)
        if env is None:
            raise ValueError(
                f"kv-canary: unknown kv_connector_extra_config key {key!r}; use one of "
                + ", ".join(EXTRA_KEYS)
            )
        merged[env] = _text(value)
    sweep = merged["KVCANARY_SWEEP_INTERVAL"]
    try:
        interval = int(sweep)
    except ValueError:
        raise ValueError(
            f"kv-canary: KVCANARY_SWEEP_INTERVAL (sweep_interval) must be an integer, got {sweep!r}"
        ) from None
    rest = {k: v for k, v in merged.items() if k not in _ADAPTER_ENV}
    return CanaryConfig.from_args_and_env(
        kv_canary=merged["KVCANARY_MODE"],
        kv_canary_real_data=merged["KVCANARY_REAL_DATA"],
        kv_canary_sweep_interval=interval,
        environ=rest,
    )
