"""Host-tier faults for vLLM's offload path: `OffloadFaultSpec`, the canary's CPU offloading spec
with broken loads, loaded through `spec_name` + `spec_module_path`.

    {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": {
        "spec_name": "OffloadFaultSpec", "spec_module_path": "kvcanary.app.vllm.offload_faults",
        "cpu_bytes_to_use": N, "fault_schedule": ["none", "wrong_page", ...]}}

Load job i (in the order this worker loads) gets `fault_schedule[i % len]`, applied to the
first block of the load:

* `none`: a clean restore;
* `wrong_page`: the host tier restores the bytes of another stored page (a restore that reads
  the wrong host row: another request's KV; the stamps stay those of the page asked for);
* `bit_flip`: one seeded bit of the page flips in the host tier before it lands;
* `lost_store`: the page's store failed but the tier still answers for it: what lands is the
  row's earlier content (zeros: never written), with the stamps the store mirrored.

Every load logs `kvcanary-offload-fault: load=<i> fault=<name> blocks=<n>`.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import torch

from kvcanary.adapters.vllm.offload import CanaryCPUOffloadingSpec, CanaryOffloadingWorker
from kvcanary.app.vllm.offload_campaign import OFFLOAD_FAULTS

__all__ = ["OFFLOAD_FAULTS", "OffloadFaultSpec", "OffloadFaultWorker"]

logger = logging.getLogger("kvcanary")


class OffloadFaultWorker(CanaryOffloadingWorker):
    """`CanaryOffloadingWorker` whose loads follow `schedule` (see the module docstring)."""

    schedule: tuple[str, ...] = ("none",)

    def land(self, group: int, blocks: Any, rows: Any, first: int) -> None:
        """Land one run under the next scheduled fault."""
        fault = self.schedule[self.loads % len(self.schedule)]
        logger.warning("kvcanary-offload-fault: load=%d fault=%s blocks=%d", self.loads, fault,
                       len(blocks))  # fmt: skip
        row = int(rows[0])
        tensors = self._tensors(group)
        saved = [self.host[t][row].clone() for t in tensors]
        if fault == "wrong_page":
            others = [r for r in self.pages if r not in set(rows.tolist())]
            if others:
                other = random.Random(self.loads).choice(sorted(others))
                for t in tensors:
                    self.host[t][row] = self.host[t][other]
        elif fault == "bit_flip":
            rng = random.Random(self.loads)
            t = tensors[rng.randrange(len(tensors))]
            flat = self.host[t][row].view(torch.uint8)
            flat[rng.randrange(flat.numel())] ^= 1 << rng.randrange(8)
        elif fault == "lost_store":
            for t in tensors:
                self.host[t][row] = 0
        try:
            super().land(group, blocks, rows, first)
        finally:  # the tier itself is left as it was: only this restore went wrong
            for t, old in zip(tensors, saved, strict=True):
                self.host[t][row] = old


class OffloadFaultSpec(CanaryCPUOffloadingSpec):
    """`CanaryCPUOffloadingSpec` with `fault_schedule` from its extra config."""

    def make_worker(self, kv_caches: Any) -> CanaryOffloadingWorker:
        """A fault worker; an unknown schedule entry is refused with one line."""
        schedule = tuple(self.extra_config.get("fault_schedule") or ("none",))
        unknown = [f for f in schedule if f not in OFFLOAD_FAULTS]
        if unknown:
            raise ValueError(f"kv-canary: fault_schedule entries must be among "
                             f"{OFFLOAD_FAULTS}, got {unknown[0]!r}")  # fmt: skip
        worker = OffloadFaultWorker(kv_caches, self.blocks_per_chunk, self.num_chunks)
        worker.schedule = schedule
        return worker
