"""Transfer faults for a real vLLM PD pair: `PDFaultConnector`, vLLM's ExampleConnector with a
broken landing, loaded on the decode engine through `kv_connector_module_path`.

    {"kv_connector": "PDFaultConnector", "kv_connector_module_path": "kvcanary.app.vllm.pd_faults",
     "kv_role": "kv_both", "kv_connector_extra_config": {
         "shared_storage_path": DIR, "fault_schedule": ["none", "wrong_slots", ...]}}

Load i (in the order this worker lands requests) gets `fault_schedule[i % len]`:

* `none`: a clean landing;
* `wrong_slots`: the KV of the request's first two blocks lands swapped (pages in the wrong
  slots; a one-block landing gets the two halves of its block swapped);
* `dropped_block`: the last block's KV is never written (it goes to vLLM's null block 0) while
  the landing is reported complete;
* `corrupt_bytes`: every landed byte of the first block is changed after the landing (the sign
  of each value flipped: a transport that corrupts data);
* `bit_flip`: one bit in transit: a seeded bit of one landed block of one layer (any layer,
  any byte: most lie outside the bytes the canary's fingerprint reads);
* `late_duplicate`: the previous landing arrives again, late, after its slots were freed and
  given to this request: its first block's KV (every layer) overwrites this landing's first block;
* `partial_layers`: the landing stops after layer 0 and is reported complete: every later
  layer keeps the bytes its blocks held before.

The step metadata (`ReqMeta.slot_mapping`, built by the scheduler from the request's blocks) is
left as the scheduler made it: these are bugs of the worker-side copy, so the canary, which reads
the intended slots from that metadata, must find the damage in the bytes. Every injected fault
logs one journal line, `kvcanary-pd-fault: load=<i> fault=<name> slots=<n>`, for 1:1 correlation
with the canary's landing lines.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import safetensors.torch
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
    ExampleConnector,
    ExampleConnectorMetadata,
)

from kvcanary.app.vllm.pd_campaign import FAULTS

__all__ = ["PDFaultConnector", "faulty_slot_mapping"]

logger = logging.getLogger("kvcanary")


def faulty_slot_mapping(slots: torch.Tensor, fault: str, block_size: int) -> torch.Tensor:
    """Where the worker's copy actually writes each position's KV under `fault`."""
    out = slots.clone()
    nblocks = len(slots) // block_size
    if fault == "wrong_slots" and len(slots) >= 2:
        # the first two blocks swapped; a one-block landing swaps the halves of its block
        half = block_size if nblocks >= 2 else len(slots) // 2
        a, b = slice(0, half), slice(half, 2 * half)
        out[a], out[b] = slots[b], slots[a]
    elif fault == "dropped_block" and nblocks >= 1:
        out[-block_size:] = torch.arange(block_size)  # the null block: never read
    return out


class PDFaultConnector(ExampleConnector):
    """ExampleConnector whose landings follow `fault_schedule` (see the module docstring)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        schedule = tuple(extra.get("fault_schedule") or ("none",))
        unknown = [f for f in schedule if f not in FAULTS]
        if unknown:
            raise ValueError(
                f"kv-canary: fault_schedule entries must be among {FAULTS}, got {unknown[0]!r}"
            )
        self.schedule = schedule
        self.loads = 0
        self._previous: Any = None  # the last request this worker landed (late_duplicate)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Land every loading request under its scheduled fault, then restore the metadata."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, ExampleConnectorMetadata)
        if getattr(forward_context, "attn_metadata", None) is None:
            super().start_load_kv(forward_context, **kwargs)
            return
        caches = [c for c in (getattr(layer, "kv_cache", None)
                              for layer in forward_context.no_compile_layers.values())
                  if isinstance(c, torch.Tensor) and c.dim() == 4]  # fmt: skip
        intended = [r.slot_mapping for r in meta.requests]
        after: list[tuple[str, Any, torch.Tensor]] = []  # (fault, request, intended slots)
        kept: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # partial_layers
        for req, slots in zip(meta.requests, intended, strict=True):
            if req.is_store or len(slots) == 0:
                continue
            fault = self.schedule[self.loads % len(self.schedule)]
            logger.warning("kvcanary-pd-fault: load=%d fault=%s slots=%d", self.loads, fault,
                           len(slots))  # fmt: skip
            self.loads += 1
            req.slot_mapping = faulty_slot_mapping(slots, fault, self._block_size)
            blocks = torch.unique(slots // self._block_size)
            if fault == "partial_layers":
                kept.extend((cache, blocks, cache[blocks].clone()) for cache in caches[1:])
            elif fault in ("corrupt_bytes", "bit_flip", "late_duplicate"):
                after.append((fault, req, slots))
        try:
            super().start_load_kv(forward_context, **kwargs)
        finally:
            for req, slots in zip(meta.requests, intended, strict=True):
                req.slot_mapping = slots
        for cache, blocks, old in kept:  # the layers the stopped transfer never reached
            cache[blocks] = old
        for fault, req, slots in after:
            self._damage(fault, req, slots, caches, forward_context)
        for req in meta.requests:
            if not req.is_store and len(req.slot_mapping):
                self._previous = req

    def _damage(self, fault: str, req: Any, slots: torch.Tensor, caches: list[torch.Tensor],
                forward_context: Any) -> None:  # fmt: skip
        bs = self._block_size
        first = slots[:bs] // bs
        if fault == "corrupt_bytes":
            for cache in caches:
                cache[first] = -cache[first]
        elif fault == "bit_flip":
            rng = random.Random(self.loads)
            cache = caches[rng.randrange(len(caches))].view(torch.uint8)
            block = int(slots[rng.randrange(len(slots) // bs) * bs]) // bs
            index = (block, *(rng.randrange(n) for n in cache.shape[1:]))
            cache[index] ^= 1 << rng.randrange(8)
        elif fault == "late_duplicate":
            prev = self._previous
            if prev is None:
                logger.warning("kvcanary-pd-fault: no earlier landing to duplicate")
                return
            layers = forward_context.no_compile_layers
            for name, layer in layers.items():
                cache = getattr(layer, "kv_cache", None)
                if not isinstance(cache, torch.Tensor) or cache.dim() != 4:
                    continue
                path = self._generate_filename_debug(name, prev.token_ids, prev.mm_hashes)
                old = safetensors.torch.load_file(path)["kv_cache"][:bs]
                cache[slots[:bs] // bs, :, slots[:bs] % bs] = old.to(cache.dtype)
