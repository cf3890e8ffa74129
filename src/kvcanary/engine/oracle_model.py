"""The weightless `oracle` model: no transformer math, only deterministic K/V writes.

With `--model oracle` the sampler takes every token from the token oracle (SPEC §10), so logits
are never needed. The pool still receives K/V for every written slot, derived from the token and
its position by an integer hash, so real-KV fingerprints are meaningful: two slots holding
different (token, position) pairs almost surely hold different bytes, and a stray write or a
flipped byte changes them.
"""

from __future__ import annotations

from typing import Final, final

import torch

from kvcanary.engine.model import ModelConfig
from kvcanary.engine.paged_attention import PagedKv

__all__ = ["OracleModel", "synthetic_kv"]

_MASK32: Final = 0xFFFFFFFF
_HASH_MUL: Final = 0x45D9F3B
_GOLDEN: Final = 0x9E3779B9
_V_SALT: Final = 0x5BD1E995


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer on int64 tensors (products stay below 2**59, so no overflow)."""
    x = x & _MASK32
    x = (((x >> 16) ^ x) * _HASH_MUL) & _MASK32
    x = (((x >> 16) ^ x) * _HASH_MUL) & _MASK32
    return (x >> 16) ^ x


def synthetic_kv(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    *,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic K and V `[T, num_kv_heads, head_dim]` in [-0.5, 0.5) for each token."""
    base = _hash32(_hash32(input_ids.to(torch.int64)) ^ positions.to(torch.int64))
    element = torch.arange(num_kv_heads * head_dim, dtype=torch.int64) * _GOLDEN
    mixed = base[:, None] + element[None, :]

    def to_values(bits: torch.Tensor) -> torch.Tensor:
        values = (bits & 0xFFFF).to(torch.float32) / 65536.0 - 0.5
        return values.view(-1, num_kv_heads, head_dim).to(dtype)

    return to_values(_hash32(mixed)), to_values(_hash32(mixed ^ _V_SALT))


@final
class OracleModel:
    """Same calling convention as `TinyLlama`, but returns no logits: it only stores K/V."""

    __slots__ = ("config",)

    def __init__(self, config: ModelConfig) -> None:
        """The oracle model for pools and vocabularies shaped by `config` (weights unused)."""
        self.config = config

    @property
    def vocab_size(self) -> int:
        """Vocabulary size of the oracle sampler."""
        return self.config.vocab_size

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv: PagedKv,
        logit_index: torch.Tensor | None = None,
    ) -> None:
        """Store synthetic K/V for every layer at `kv.out_slots`; no logits."""
        cfg = self.config
        k, v = synthetic_kv(
            input_ids,
            positions,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            dtype=cfg.torch_dtype,
        )
        for layer in range(cfg.num_layers):
            kv.store(layer, k, v)
