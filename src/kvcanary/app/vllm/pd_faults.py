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
  of each value flipped: a transport that corrupts data).

The step metadata (`ReqMeta.slot_mapping`, built by the scheduler from the request's blocks) is
left as the scheduler made it: these are bugs of the worker-side copy, so the canary, which reads
the intended slots from that metadata, must find the damage in the bytes. Every injected fault
logs one journal line, `kvcanary-pd-fault: load=<i> fault=<name> slots=<n>`, for 1:1 correlation
with the canary's landing lines.
"""

from __future__ import annotations

import logging
from typing import Any

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

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Land every loading request under its scheduled fault, then restore the metadata."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, ExampleConnectorMetadata)
        if getattr(forward_context, "attn_metadata", None) is None:
            super().start_load_kv(forward_context, **kwargs)
            return
        intended = [r.slot_mapping for r in meta.requests]
        corrupt: list[torch.Tensor] = []
        for req in meta.requests:
            if req.is_store or len(req.slot_mapping) == 0:
                continue
            fault = self.schedule[self.loads % len(self.schedule)]
            logger.warning("kvcanary-pd-fault: load=%d fault=%s slots=%d", self.loads, fault,
                           len(req.slot_mapping))  # fmt: skip
            self.loads += 1
            req.slot_mapping = faulty_slot_mapping(req.slot_mapping, fault, self._block_size)
            if fault == "corrupt_bytes":
                corrupt.append(intended[meta.requests.index(req)][: self._block_size])
        try:
            super().start_load_kv(forward_context, **kwargs)
        finally:
            for req, slots in zip(meta.requests, intended, strict=True):
                req.slot_mapping = slots
        for slots in corrupt:
            blocks = torch.unique(slots // self._block_size)
            for layer in forward_context.no_compile_layers.values():
                cache = getattr(layer, "kv_cache", None)
                if isinstance(cache, torch.Tensor) and cache.dim() >= 2:
                    cache[blocks] = -cache[blocks]
