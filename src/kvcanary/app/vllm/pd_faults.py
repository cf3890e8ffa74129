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
  layer keeps the bytes its blocks held before;
* `partial_save`: a fault of the *storing* engine's connector (its `save_fault_schedule`, store
  i = the i-th request it saves): the save stops after layer 0, and the loading engine's
  connector lands the layers it finds and reports the landing complete (vLLM's own
  ExampleConnector would stop with FileNotFoundError instead).

The step metadata (`ReqMeta.slot_mapping`, built by the scheduler from the request's blocks) is
left as the scheduler made it: these are bugs of the worker-side copy, so the canary, which reads
the intended slots from that metadata, must find the damage in the bytes. Every injected fault
logs one journal line, `kvcanary-pd-fault: load=<i> fault=<name> slots=<n>`, for 1:1 correlation
with the canary's landing lines (a faulty store also logs `kvcanary-pd-fault: store=<i> ...`).
"""

from __future__ import annotations

import logging
import os
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
        self.save_schedule = tuple(extra.get("save_fault_schedule") or ("none",))
        unknown = [f for f in self.save_schedule if f not in FAULTS]
        if unknown:
            raise ValueError(f"kv-canary: save_fault_schedule entries must be among {FAULTS}, "
                             f"got {unknown[0]!r}")  # fmt: skip
        self.loads = self.stores = 0
        self._store_faults: dict[str, str] = {}  # request folder -> its store's fault
        self._first_layer: str | None = None
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
        requests = list(meta.requests)
        intended = [r.slot_mapping for r in requests]
        after: list[tuple[str, Any, torch.Tensor]] = []  # (fault, request, intended slots)
        kept: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # partial_layers
        tolerant: list[Any] = []  # partial_save: landed from the layer files that exist
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
            elif fault == "partial_save":
                tolerant.append(req)
        meta.requests = [r for r in requests if all(r is not t for t in tolerant)]
        try:
            super().start_load_kv(forward_context, **kwargs)
        finally:
            meta.requests = requests
            for req, slots in zip(requests, intended, strict=True):
                req.slot_mapping = slots
        for req in tolerant:
            self._land_layers_found(req, forward_context)
        for cache, blocks, old in kept:  # the layers the stopped transfer never reached
            cache[blocks] = old
        for fault, req, slots in after:
            self._damage(fault, req, slots, caches, forward_context)
        for req in meta.requests:
            if not req.is_store and len(req.slot_mapping):
                self._previous = req

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:  # fmt: skip
        """Save this layer of every storing request, except the requests whose store's fault
        (`save_fault_schedule`) is `partial_save`: theirs stops after the first layer."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, ExampleConnectorMetadata)
        self._first_layer = self._first_layer or layer_name
        stopped = []
        for req in meta.requests:
            if not req.is_store:
                continue
            key = self._generate_foldername_debug(req.token_ids, req.mm_hashes)
            if key not in self._store_faults:
                fault = self.save_schedule[self.stores % len(self.save_schedule)]
                self._store_faults[key] = fault
                if fault != "none":
                    logger.warning("kvcanary-pd-fault: store=%d fault=%s slots=%d", self.stores,
                                   fault, len(req.slot_mapping))  # fmt: skip
                self.stores += 1
            if self._store_faults[key] == "partial_save" and layer_name != self._first_layer:
                stopped.append(req)
        requests = list(meta.requests)
        meta.requests = [r for r in requests if all(r is not s for s in stopped)]
        try:
            super().save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)
        finally:
            meta.requests = requests

    def _land_layers_found(self, req: Any, forward_context: Any) -> None:
        """A loader that lands the layer files it finds and reports the landing complete."""
        for name, layer in forward_context.no_compile_layers.items():
            cache = getattr(layer, "kv_cache", None)
            path = self._generate_filename_debug(name, req.token_ids, req.mm_hashes)
            if not isinstance(cache, torch.Tensor) or cache.dim() != 4 or not os.path.exists(path):
                continue
            kv = safetensors.torch.load_file(path)["kv_cache"]
            slots = req.slot_mapping
            cache[slots // self._block_size, :, slots % self._block_size] = kv.to(cache.dtype)

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
                if not os.path.exists(path):  # the previous store stopped part-way
                    continue
                old = safetensors.torch.load_file(path)["kv_cache"][:bs]
                cache[slots[:bs] // bs, :, slots[:bs] % bs] = old.to(cache.dtype)
