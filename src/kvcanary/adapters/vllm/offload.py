"""vLLM's host offload tier on the CPU platform, with the canary's stamps riding it (SPEC §14.4).

vLLM's `OffloadingConnector` keeps prefix-cached blocks in a host tier and loads them back on a
later hit, but its shipped `CPUOffloadingSpec` refuses to build a worker unless the platform is
CUDA-alike or XPU. `CanaryCPUOffloadingSpec` keeps that spec's scheduler half (the LRU manager,
`cpu_bytes_to_use`, every config key) and gives it `CanaryOffloadingWorker`, which copies pages
with torch (on vLLM's CPU platform the device cache is host memory too) and mirrors the canary:

* **store** (device -> host): with each block's bytes go the HEAD and TAIL records of its slots
  and a transfer checksum over every byte of the block in every layer (`transfer_checksum`);
* **load** (host -> device): the records are installed at the landing slots and the checksum
  of the bytes that actually landed is compared with the stored one (a mismatch is a violation
  at each slot of the block). The records themselves are then verified by HEAD and TAIL of the
  first forward that reads the blocks, like every cached position (chain into the request's
  own prefix, position, token, layer-0 fingerprint). In mode `recover` a block whose checksum
  differs goes to vLLM as a load error (`get_block_ids_with_load_errors` of the canary's
  connector): the request, still waiting for its KV, recomputes from that block.

Configuration (the user's own connector; the plugin's `KVCANARY_MODE` shortcut adds the canary):

    {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
     "kv_connector_extra_config": {"spec_name": "CanaryCPUOffloadingSpec",
                                   "spec_module_path": "kvcanary.adapters.vllm.offload",
                                   "cpu_bytes_to_use": 67108864}}

Without a canary in the process the spec is a plain CPU offload tier. vLLM is imported here, so
this module is loaded by vLLM's `spec_module_path` only.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from kvcanary.adapters.vllm.state import STATE
from kvcanary.adapters.vllm.transfer_checksum import block_checksums
from kvcanary.contract import SidecarRecords

__all__ = ["CanaryCPUOffloadingSpec", "CanaryOffloadingWorker", "HostPage"]

logger = logging.getLogger("kvcanary")
I64 = npt.NDArray[np.int64]


def _canary_connector() -> Any | None:
    """The canary connector of this process whose canary is installed (None: no canary here)."""
    for connector in STATE.live_connectors():
        worker = getattr(connector, "worker", None)
        if worker is not None and worker.canary is not None:
            return connector
    return None


def _canary_worker() -> Any | None:
    """The canary worker of this process (None: no canary installed here)."""
    connector = _canary_connector()
    return connector.worker if connector is not None else None


class HostPage:
    """What the host tier holds beside one block's bytes: its records and its checksum."""

    __slots__ = ("checksum", "records")

    def __init__(self, records: SidecarRecords | None, checksum: int) -> None:
        self.records, self.checksum = records, checksum


class CanaryOffloadingWorker(OffloadingWorker):
    """Synchronous torch-copy offload worker that mirrors the canary (see the module docstring);
    each job is reported finished by the next `get_finished`."""

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, num_chunks: int):
        self.blocks_per_chunk = blocks_per_chunk
        self.refs = kv_caches.group_data_refs
        self.device = [t.tensor for t in kv_caches.tensors]  # int8 [num_blocks, page bytes]
        self.host = [torch.zeros((num_chunks * blocks_per_chunk, t.page_size_bytes),
                                 dtype=torch.int8) for t in kv_caches.tensors]  # fmt: skip
        self.pages: dict[int, HostPage] = {}  # host row -> its stamps
        self.stores = self.loads = 0
        self._finished: list[TransferResult] = []
        logger.info("kv-canary: CPU offload tier of %d chunks x %d blocks (%d tensors)",
                    num_chunks, blocks_per_chunk, len(self.device))  # fmt: skip

    # ------------------------------------------------------------------ OffloadingWorker
    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec,
                     dst_spec: LoadStoreSpec) -> bool:  # fmt: skip
        """Copy device blocks to host rows with their records and checksums."""
        for group, blocks, rows, _ in self._runs(src_spec, dst_spec):
            self._copy_out(group, blocks, rows)
            self._stamp_out(blocks, rows)
        self.stores += 1
        self._finished.append(TransferResult(job_id, True, 0, 0.0))
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec,
                    dst_spec: GPULoadStoreSpec) -> bool:  # fmt: skip
        """Copy host rows to device blocks, install their records, compare checksums."""
        for group, blocks, rows, first in self._runs(dst_spec, src_spec):
            self.land(group, blocks, rows, first)
        self.loads += 1
        self._finished.append(TransferResult(job_id, True, 0, 0.0))
        return True

    def get_finished(self) -> list[TransferResult]:
        """The jobs done since the previous call (all of them: copies are synchronous)."""
        done, self._finished = self._finished, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        """Nothing to wait for: copies are synchronous."""

    # ------------------------------------------------------------------ the copies
    def land(self, group: int, blocks: I64, rows: I64, first: int) -> None:
        """One load run: bytes, then stamps (a fault subclass overrides the bytes part)."""
        self._copy_in(group, blocks, rows)
        self._stamp_in(blocks, rows, first)

    def _runs(self, gpu: GPULoadStoreSpec,
              host: LoadStoreSpec) -> list[tuple[int, I64, I64, int]]:  # fmt: skip
        """(group, device blocks, host rows, first block's index in its request) per group."""
        assert isinstance(host, BlockIDsLoadStoreSpec)
        sizes = gpu.group_sizes if gpu.group_sizes is not None else [len(gpu.block_ids)]
        firsts = gpu.block_indices if gpu.block_indices is not None else [0] * len(sizes)
        out, dev_at, host_at, bpc = [], 0, 0, self.blocks_per_chunk
        for group, (n, first) in enumerate(zip(sizes, firsts, strict=True)):
            if n == 0:
                continue
            skip = int(first) % bpc  # a first device block inside a larger host chunk
            chunks = -(-(n + skip) // bpc)
            ids = host.block_ids[host_at : host_at + chunks].astype(np.int64)
            rows = (ids[:, None] * bpc + np.arange(bpc)).ravel()[skip : skip + n]
            out.append((group, gpu.block_ids[dev_at : dev_at + n].astype(np.int64), rows,
                        int(first)))  # fmt: skip
            dev_at, host_at = dev_at + n, host_at + chunks
        return out

    def _tensors(self, group: int) -> list[int]:
        return sorted({ref.tensor_idx for ref in self.refs[group]})

    def _copy_out(self, group: int, blocks: I64, rows: I64) -> None:
        for t in self._tensors(group):
            self.host[t][torch.from_numpy(rows)] = self.device[t][torch.from_numpy(blocks)]

    def _copy_in(self, group: int, blocks: I64, rows: I64) -> None:
        for t in self._tensors(group):
            self.device[t][torch.from_numpy(blocks)] = self.host[t][torch.from_numpy(rows)]

    def _stamp_out(self, blocks: I64, rows: I64) -> None:
        from kvcanary.canary import CanarySidecars

        worker = _canary_worker()
        sums = block_checksums(self.device, blocks)
        records, bs = None, 0
        if worker is not None:
            bs = worker.block_size
            slots = (blocks[:, None] * bs + np.arange(bs)).ravel()
            records = CanarySidecars(worker.canary).export_sidecars(
                group="full", slots=slots.tolist()
            )
        for j, row in enumerate(rows.tolist()):
            page = records.slice(j * bs, (j + 1) * bs) if records is not None else None
            self.pages[row] = HostPage(page, int(sums[j]))

    def _stamp_in(self, blocks: I64, rows: I64, first: int) -> None:
        from kvcanary.canary import CanarySidecars

        connector = _canary_connector()
        if connector is None:
            return
        worker = connector.worker
        sidecars, bs = CanarySidecars(worker.canary), worker.block_size
        pages = [self.pages.get(row) for row in rows.tolist()]
        landed = block_checksums(self.device, blocks)
        bad = 0
        for j, (block, page) in enumerate(zip(blocks.tolist(), pages, strict=True)):
            slots = list(range(block * bs, (block + 1) * bs))
            if page is None or page.records is None:
                continue  # stored before the canary ran: HEAD reports the old records
            sidecars.import_sidecars(records=page.records, slots=slots)
            positions = list(range((first + j) * bs, (first + j + 1) * bs))
            found = sidecars.report_landed_bytes(group="full", slots=slots, positions=positions,
                                                 landed=[int(landed[j])] * bs,
                                                 expected=[page.checksum] * bs)  # fmt: skip
            bad += found
            if found and worker.config.recover:
                # vLLM's load-error path: the waiting request recomputes from this block
                # (kv_load_failure_policy=recompute) instead of reading what landed
                connector.invalid_block_ids.add(int(block))
        mirror = worker.sources.mirror if worker.sources is not None else None
        if mirror is not None:  # TAIL's fingerprint must read the bytes that just landed
            mirror.refresh(np.unique(blocks))
        logger.info("kv-canary: offload load of %d blocks (stamps %d): %d violations",
                    len(blocks), sum(p is not None and p.records is not None for p in pages),
                    bad)  # fmt: skip


class CanaryCPUOffloadingSpec(CPUOffloadingSpec):
    """vLLM's `CPUOffloadingSpec` (same manager, sizing and keys) whose worker runs on the CPU
    platform and carries the canary's stamps (see the module docstring)."""

    worker_class: type[CanaryOffloadingWorker] = CanaryOffloadingWorker

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        """One torch-copy worker per process (the parent class refuses the CPU platform)."""
        if self._worker is None:
            self._worker = self.make_worker(kv_caches)
        return self._worker

    def make_worker(self, kv_caches: CanonicalKVCaches) -> CanaryOffloadingWorker:
        """The worker over `kv_caches` (a fault spec passes its own arguments)."""
        return self.worker_class(kv_caches, self.blocks_per_chunk, self.num_chunks)
