"""Install the canary over a vLLM V1 model runner's KV cache (CPU backend, layer 0)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from kvcanary.adapters.vllm.state import STATE
from kvcanary.adapters.vllm.walker import BlockPoolWalker
from kvcanary.contract import BufferGroupSpec, GroupKind, RealKvSource

if TYPE_CHECKING:
    from kvcanary.canary import Canary, CanaryConfig

__all__ = ["ADAPTER_ENV", "config_from_env", "install_on_runner", "maybe_attach_walker"]

logger = logging.getLogger("kvcanary")

#: Environment variables the adapter reads itself (not passed to CanaryConfig's reader).
ADAPTER_ENV = ("KVCANARY_MODE", "KVCANARY_REAL_DATA", "KVCANARY_SWEEP_INTERVAL")
#: Bytes of each token's V row per head that `partial` folds (SPEC §3.3 leaves the width to the
#: engine; 16 bytes are the first four fp32 elements).
PARTIAL_READ_BYTES = 16


def config_from_env(environ: Mapping[str, str]) -> CanaryConfig:
    """`KVCANARY_MODE` (none/log/raise), `KVCANARY_REAL_DATA` (default partial),
    `KVCANARY_SWEEP_INTERVAL` (default 0) plus the standard `KVCANARY_*` knobs (SPEC §12)."""
    from kvcanary.canary import CanaryConfig

    rest = {k: v for k, v in environ.items() if k not in ADAPTER_ENV}
    sweep = environ.get("KVCANARY_SWEEP_INTERVAL", "0")
    try:
        interval = int(sweep)
    except ValueError:
        raise ValueError(
            f"kv-canary: KVCANARY_SWEEP_INTERVAL must be an integer, got {sweep!r}"
        ) from None
    return CanaryConfig.from_args_and_env(
        kv_canary=environ.get("KVCANARY_MODE", "none"),
        kv_canary_real_data=environ.get("KVCANARY_REAL_DATA", "partial"),
        kv_canary_sweep_interval=interval,
        environ=rest,
    )


def v_sources(kv: torch.Tensor, read_mode: str) -> tuple[RealKvSource, ...]:
    """Layer-0 real-KV sources for the CPU backend's cache `[num_blocks, H, B, 2 * D]`.

    The CPU backend views it as `[num_blocks, H, 2 * B, D]` and splits dim 2: rows `[0, B)` of a
    head hold K, rows `[B, 2B)` hold V. V is token-major (token t of the block at row `B + t`),
    but K is stored transposed, `[D, B]` (element `(d, t)` at `d * B + t`), so a token's K bytes
    are not contiguous and cannot be a `RealKvSource` tile. The adapter therefore fingerprints V:
    one source per KV head (at most 4), each a `[num_blocks, B * D]` view of that head's V rows.
    """
    if read_mode == "none":
        return ()
    n, h, b, two_d = kv.shape
    as4 = kv.view(n, h, 2 * b, two_d // 2)
    d_bytes = (two_d // 2) * kv.element_size()
    read = PARTIAL_READ_BYTES if read_mode == "partial" else d_bytes
    out = []
    for head in range(min(h, 4)):
        part = as4[:, head, b : 2 * b, :].flatten(1)
        if part.data_ptr() != as4[:, head, b].data_ptr():
            raise RuntimeError("kv-canary: vLLM KV source is not a view of the cache")
        out.append(
            RealKvSource(tensor=part, page_size=b, num_bytes_per_token=d_bytes, read_bytes=read)
        )
    return tuple(out)


def install_on_runner(runner: Any, environ: Mapping[str, str]) -> Canary | None:
    """A canary over `runner.kv_caches[0]` (one FULL group of `num_blocks * block_size` slots),
    or None (mode none, or a layout the adapter does not support, with a warning)."""
    from kvcanary.canary import CanaryLaunchCapacities, install

    config = config_from_env(environ)
    if not config.enabled:
        return None
    if getattr(runner, "speculative_config", None) is not None:
        logger.warning("kv-canary: vLLM adapter does not support speculative decoding; disabled")
        return None
    groups = runner.kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        logger.warning("kv-canary: vLLM adapter supports one KV cache group, got %d", len(groups))
        return None
    kv = runner.kv_caches[0]
    if kv.dim() != 4 or kv.device.type != "cpu":
        logger.warning("kv-canary: unsupported KV layout %s on %s", tuple(kv.shape), kv.device)
        return None
    block_size = int(runner.input_batch.block_table[0].block_size)
    if kv.shape[2] != block_size:
        logger.warning("kv-canary: KV block dim %d != block size %d", kv.shape[2], block_size)
        return None
    num_slots = int(kv.shape[0]) * block_size
    mode = config.real_data.value
    sources = v_sources(kv, mode)
    # K-half endpoints fingerprint V bytes too (K is not tile-addressable on this backend)
    group = BufferGroupSpec(
        kind=GroupKind.FULL, num_slots=num_slots, k_sources=sources, v_sources=sources
    )
    sched = runner.vllm_config.scheduler_config
    caps = CanaryLaunchCapacities.from_args(
        req_to_token_pool_size=int(sched.max_num_seqs) + 1,
        max_seq_len_per_req=int(runner.max_model_len),
        pool_slot_count=num_slots,
        cuda_graph_max_bs=None,
        speculative_num_draft_tokens=None,
        max_prefill_tokens=int(sched.max_num_batched_tokens),
        chunked_prefill_size=None,
    )
    canary = install(config, [group], caps, perturb=STATE.hooks)
    if canary is None:
        return None
    canary.mark_init_finished()  # only execute_model forwards reach the canary
    logger.info(
        "kv-canary: installed on vLLM (mode=%s real_data=%s slots=%d block_size=%d "
        "kv_shape=%s dtype=%s)",
        config.mode.value, mode, num_slots, block_size, tuple(kv.shape), kv.dtype,
    )  # fmt: skip
    return canary


def maybe_attach_walker(runner: Any, canary: Canary) -> None:
    """Attach a `BlockPoolWalker` over the scheduler's pool once it exists in this process."""
    if canary.walker is not None or canary.config.sweep_interval <= 0:
        return
    num_blocks = runner.kv_cache_config.num_blocks
    for ref in reversed(STATE.pools):
        pool = ref()
        if pool is not None and pool.num_gpu_blocks == num_blocks:
            canary.attach_prefix_cache(walker=BlockPoolWalker(pool, STATE.ledger))
            logger.info("kv-canary: prefix-cache walker attached (%d blocks)", num_blocks)
            return
    if not STATE.walker_warned:
        STATE.walker_warned = True
        logger.warning(
            "kv-canary: no scheduler BlockPool with %d blocks in this process (pools: %s); "
            "sweeps stay off",
            num_blocks,
            [getattr(r(), "num_gpu_blocks", None) for r in STATE.pools],
        )
