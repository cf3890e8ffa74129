"""Real-KV sources packed for the fold kernels (SPEC §2.4, §4 "Fold")."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from kvcanary.canary.config import RealDataMode
from kvcanary.contract.groups import MAX_SOURCES_PER_HALF, RealKvSource

__all__ = ["FoldSources", "source_words"]

_PARTIAL_BYTES = 16
_DUMMY_WORDS = np.zeros((1, 2), dtype=np.uint64)


def source_words(source: RealKvSource) -> npt.NDArray[np.uint64]:
    """A live `[rows, row_bytes // 8]` u64 view of the source's bytes (shares memory)."""
    t = source.tensor
    if t.device.type != "cpu":
        raise ValueError(f"kv-canary: RealKvSource.tensor must be on the CPU, got {t.device}")
    flat = t.view(t.shape[0], -1) if t.dim() > 2 else t
    as_bytes = flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat
    base = as_bytes.numpy()
    # Viewing the last (contiguous) axis as u64 keeps the tensor's row stride.
    return base[:, : (source.row_bytes // 8) * 8].view(np.uint64)


@dataclass(frozen=True, slots=True)
class FoldSources:
    """Up to four sources in hash order, as kernel arguments.

    `params[i] = (page_size, words_per_token, words_read, page_shift, uniform)`; unused entries
    point at a dummy array. `uniform` is 1 in every row when all sources share one power-of-two
    page size and read 16 bytes (PARTIAL over the heads of one layer, the common case; words per
    token may differ, as between a mirrored K and a token-major V on CPU): the kernels then fold
    every source from one row and in-page index. `words_read` is 2 (16 bytes) under PARTIAL and
    `read_bytes // 8` under ALL; `page_shift` is log2(page_size) for a power of two (the kernels
    then shift instead of dividing), else -1.
    """

    words: tuple[npt.NDArray[np.uint64], ...]
    params: npt.NDArray[np.int64]
    count: int

    @classmethod
    def empty(cls) -> FoldSources:
        """No sources: the fold is 0."""
        return cls.build((), RealDataMode.NONE)

    @classmethod
    def build(cls, sources: Sequence[RealKvSource], mode: RealDataMode) -> FoldSources:
        """Pack `sources` for `mode`; NONE builds none."""
        if len(sources) > MAX_SOURCES_PER_HALF:
            raise ValueError(
                "kv-canary: at most 4 RealKvSource entries supported per buffer half, "
                f"got {len(sources)}"
            )
        used = () if mode is RealDataMode.NONE else tuple(sources)
        params = np.zeros((MAX_SOURCES_PER_HALF, 5), dtype=np.int64)
        words: list[npt.NDArray[np.uint64]] = []
        for i, src in enumerate(used):
            read = _PARTIAL_BYTES if mode is RealDataMode.PARTIAL else src.read_bytes
            page = src.page_size
            shift = page.bit_length() - 1 if page & (page - 1) == 0 else -1
            params[i] = (page, src.num_bytes_per_token // 8, read // 8, shift, 0)
            words.append(source_words(src))
        used_rows = params[: len(used)]
        if (
            len(used)
            and (used_rows[:, [0, 2, 3]] == used_rows[0, [0, 2, 3]]).all()
            and (used_rows[0, 2] == _PARTIAL_BYTES // 8 and used_rows[0, 3] >= 0)
        ):
            params[:, 4] = 1
        padded = words + [_DUMMY_WORDS] * (MAX_SOURCES_PER_HALF - len(words))
        return cls(words=tuple(padded), params=params, count=len(used))

    def tile_words(self, index: int, slot: int) -> npt.NDArray[np.uint64]:
        """The hashed words of `slot`'s tile in source `index` (for the reference kernels)."""
        page_size, per_token, read = (int(x) for x in self.params[index, :3])
        col = (slot % page_size) * per_token
        return self.words[index][slot // page_size, col : col + read]
