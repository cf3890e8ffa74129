"""The canary's records ride vLLM's ExampleConnector (shared-storage prefill -> decode, SPEC §14.4).

When `KVCanaryConnector` runs in a `MultiConnector` after vLLM's `ExampleConnector` (the plugin's
shortcut beside a user's ExampleConnector puts it there; the order matters: MultiConnector calls
the children's worker hooks in config order), two engines that share the connector's storage
folder carry the canary's records with the KV:

* **export** (every engine that stores; the prefill engine in a PD pair): after TAIL of the
  step ExampleConnector saved a request in, the HEAD and TAIL records of the saved slots, in
  position order, and one transfer checksum per saved block go to
  `<request folder>/kvcanary.sidecar` (written to a temporary name, then renamed, so a reader
  never sees half a file). The sidecar is the transfer's last entry: it is written only when
  every layer's file is there, so a save that stopped part-way lands without one;
* **land** (the engine that loads; the decode engine): in `start_load_kv`, after ExampleConnector
  has injected the KV and before HEAD reads it, the sidecar's records are imported at the
  landing slots (its positions 0..n-1, whatever slots the decode engine gave them) and verified:
  chain, position, token (the request's prompt tokens) and the real-KV fingerprint of the bytes
  that landed; then every landed block's transfer checksum (all layers, every byte;
  `transfer_checksum`) against the sender's.

A missing, truncated or foreign sidecar imports nothing: the landing slots keep their old
records, which the verify then reports (SPEC §14.4 "a transfer that lands KV without its
records"). The request folder is found the way ExampleConnector finds it, from the sibling's
own step metadata (`ReqMeta.token_ids`, `slot_mapping`, `is_store`), so the canary never
re-derives ExampleConnector's hashing or block alignment. vLLM is imported only inside functions.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import torch

from kvcanary.adapters.vllm.transfer_checksum import block_checksums, pack_sidecar, unpack_sidecar
from kvcanary.contract import CanaryContractError, SidecarRecords

if TYPE_CHECKING:
    from kvcanary.adapters.vllm.worker import CanaryWorker

__all__ = ["SIDECAR_FILE", "ExampleSidecars", "find_example_sibling"]

logger = logging.getLogger("kvcanary")

#: the sidecar's name inside ExampleConnector's request folder (beside `<layer>.safetensors`)
SIDECAR_FILE = "kvcanary.sidecar"


def find_example_sibling() -> Any | None:
    """The `ExampleConnector` that runs beside the canary in this worker's `MultiConnector`, or
    None (no MultiConnector, or no ExampleConnector in it)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
    from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    if not has_kv_transfer_group():
        return None
    group = get_kv_transfer_group()
    if not isinstance(group, MultiConnector):
        return None
    return next((c for c in group.sub_connectors if isinstance(c, ExampleConnector)), None)


class ExampleSidecars:
    """Export and landing of sidecars beside one ExampleConnector (see the module docstring)."""

    def __init__(self, sibling: Any, caches: Mapping[str, torch.Tensor]) -> None:
        """`sibling`: the ExampleConnector whose step metadata names the saved / loaded KV;
        `caches`: every layer's KV cache, as vLLM registered them (the transfer checksums)."""
        self.sibling = sibling
        self.caches = dict(caches)
        self.exported = 0  # requests whose sidecar this worker wrote
        self.landed = 0  # requests whose landed KV this worker verified
        self.missing = 0  # of those, landed without a readable sidecar

    def _requests(self) -> list[Any]:
        meta = getattr(self.sibling, "_connector_metadata", None)
        return list(getattr(meta, "requests", None) or [])

    def _folder(self, req: Any) -> str:
        return str(self.sibling._generate_foldername_debug(
            req.token_ids, req.mm_hashes, create_folder=False))  # fmt: skip

    def export(self, worker: CanaryWorker) -> None:
        """Write the records of every request ExampleConnector saved this step (after TAIL)."""
        from kvcanary.canary import CanarySidecars

        canary = worker.canary
        if canary is None:
            return
        for req in self._requests():
            slots = _slots(req)
            if not req.is_store or len(slots) == 0:
                continue
            folder = self._folder(req)
            saved = [os.path.join(folder, f"{name}.safetensors") for name in self.caches]
            if not all(os.path.exists(f) for f in saved):
                # the sidecar is the transfer's last entry: a save that stopped part-way (or
                # never ran) gets none, and its landing is reported
                continue
            records = CanarySidecars(canary).export_sidecars(group="full", slots=slots.tolist())
            sums = block_checksums(list(self.caches.values()), _blocks(slots, worker.block_size))
            _write_atomically(os.path.join(folder, SIDECAR_FILE), pack_sidecar(records, sums))
            self.exported += 1

    def land(self, worker: CanaryWorker) -> set[int]:
        """Import and verify the records of every request ExampleConnector loaded this step
        (before HEAD); returns the landed blocks of every request whose landing failed (mode
        `recover` hands them to vLLM as load errors: the request recomputes, or fails)."""
        from kvcanary.canary import CanarySidecars

        canary = worker.canary
        if canary is None:
            return set()
        failed: set[int] = set()
        for req in self._requests():
            slots = _slots(req)
            if req.is_store or len(slots) == 0:
                continue
            sidecars = CanarySidecars(canary)
            blocks = _blocks(slots, worker.block_size)
            sidecar = self._read(os.path.join(self._folder(req), SIDECAR_FILE), len(slots),
                                 len(blocks))  # fmt: skip
            if sidecar is not None:
                sidecars.import_sidecars(records=sidecar[0], slots=slots.tolist())
            else:
                self.missing += 1
            mirror = worker.sources.mirror if worker.sources is not None else None
            if mirror is not None:  # the fingerprint must read the bytes that just landed
                mirror.refresh(np.unique(blocks))
            tokens = req.token_ids.numpy().astype(np.int64)
            positions = np.arange(len(slots), dtype=np.int64)
            prev = np.concatenate([[-1], slots[:-1]]).astype(np.int64)
            bad = sidecars.verify_landed(
                group="full", slots=slots.tolist(), positions=positions.tolist(),
                prev_slots=prev.tolist(), tokens=tokens.tolist(),
            )  # fmt: skip
            bad_blocks = 0
            if sidecar is not None:  # every byte of every layer, against the sender's sums
                per_block = worker.block_size
                landed = block_checksums(list(self.caches.values()), blocks)
                bad_blocks = int((landed != sidecar[1]).sum())
                bad += sidecars.report_landed_bytes(
                    group="full", slots=slots.tolist(), positions=positions.tolist(),
                    landed=np.repeat(landed, per_block).tolist(),
                    expected=np.repeat(sidecar[1], per_block).tolist(), tokens=tokens.tolist(),
                )  # fmt: skip
            self.landed += 1
            if bad:
                failed.update(int(b) for b in blocks)
            logger.info("kv-canary: landed KV of %d slots verified (sidecar %s): %d violations "
                        "(%d of %d blocks failed their transfer checksum)", len(slots),
                        "imported" if sidecar is not None else "missing", bad, bad_blocks,
                        len(blocks))  # fmt: skip
        return failed

    @staticmethod
    def _read(path: str, num_slots: int, num_blocks: int
              ) -> tuple[SidecarRecords, npt.NDArray[np.int64]] | None:  # fmt: skip
        """The sidecar at `path` (records, block checksums) when it is well-formed and holds
        `num_slots` full-group records and `num_blocks` checksums; None (logged) otherwise: it
        comes from another process or a stale folder."""
        try:
            with open(path, "rb") as fh:
                records, sums = unpack_sidecar(fh.read())
        except FileNotFoundError:
            logger.warning("kv-canary: KV landed without a sidecar (%s); its records are not "
                           "imported and the verify reports them", path)  # fmt: skip
            return None
        except (OSError, CanaryContractError) as exc:
            logger.warning("kv-canary: unreadable sidecar %s: %s", path, exc)
            return None
        if records.group != "full" or records.num_slots != num_slots or len(sums) != num_blocks:
            logger.warning("kv-canary: sidecar %s holds %d %s records and %d block checksums "
                           "for %d landed slots", path, records.num_slots, records.group,
                           len(sums), num_slots)  # fmt: skip
            return None
        return records, sums


def _slots(req: Any) -> npt.NDArray[np.int64]:
    return np.asarray(req.slot_mapping.numpy(), dtype=np.int64)


def _blocks(slots: npt.NDArray[np.int64], block_size: int) -> npt.NDArray[np.int64]:
    """The blocks of a whole-block transfer, in position order."""
    return np.asarray(slots[::block_size] // block_size, dtype=np.int64)


def _write_atomically(path: str, data: bytes) -> None:
    folder = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(prefix=".kvcanary-", dir=folder)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
