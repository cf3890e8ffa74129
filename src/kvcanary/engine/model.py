"""A tiny Llama-style transformer with seeded random weights.

RMSNorm, rotary position embeddings, grouped-query attention and a SwiGLU MLP: the shapes and
data flow of a real decoder, small enough for CPU tests. The block math exists once, in
`TinyLlama.forward`; *where K/V come from* is a parameter (`KvAccess`): the paged engine stores
them into the pool and gathers them back through `req_to_token` (`paged_attention.PagedKv`), and
the no-cache reference attends over the whole sequence it was given (`reference.DenseKv`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final, Protocol, final

import torch
import torch.nn.functional as F

__all__ = [
    "DTYPES",
    "KvAccess",
    "LayerWeights",
    "ModelConfig",
    "ModelWeights",
    "TinyLlama",
    "apply_rope",
    "causal_attention",
    "init_weights",
    "rms_norm",
]

#: Model dtype names and their torch types.
DTYPES: Final = {"float32": torch.float32, "bfloat16": torch.bfloat16}

_RMS_EPS: Final = 1e-6


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelConfig:
    """Shape, precision and weight seed of the tiny transformer."""

    vocab_size: int = 128
    hidden: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate: int = 128
    rope_theta: float = 10000.0
    dtype: str = "float32"
    seed: int = 0

    def __post_init__(self) -> None:
        sizes = {
            "vocab_size": self.vocab_size,
            "hidden": self.hidden,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate": self.intermediate,
        }
        for name, value in sizes.items():
            if value < 1:
                raise ValueError(f"ModelConfig.{name} must be positive, got {value}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if not self.rope_theta > 0:
            raise ValueError(f"ModelConfig.rope_theta must be positive, got {self.rope_theta}")
        if self.dtype not in DTYPES:
            raise ValueError(
                f"ModelConfig.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype of weights, activations and KV."""
        return DTYPES[self.dtype]


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerWeights:
    """One decoder layer; projections are `[out_features, in_features]`."""

    attn_norm: torch.Tensor
    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    mlp_norm: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelWeights:
    """All weights: token embedding, layers, final norm and LM head."""

    embed: torch.Tensor
    layers: tuple[LayerWeights, ...]
    final_norm: torch.Tensor
    lm_head: torch.Tensor


def init_weights(config: ModelConfig) -> ModelWeights:
    """Random weights drawn from a `torch.Generator` seeded with `config.seed`.

    Projections are scaled by `1/sqrt(fan_in)` so activations and logits stay O(1); norms get
    gains near 1. Drawn in float32, then cast, so both dtypes share the same underlying draw.
    """
    gen = torch.Generator().manual_seed(config.seed)
    dtype = config.torch_dtype

    def dense(out_features: int, in_features: int) -> torch.Tensor:
        scale = 1.0 / math.sqrt(in_features)
        return (torch.randn(out_features, in_features, generator=gen) * scale).to(dtype)

    def gain(size: int) -> torch.Tensor:
        return (1.0 + 0.1 * torch.randn(size, generator=gen)).to(dtype)

    h, q_dim = config.hidden, config.num_heads * config.head_dim
    kv_dim = config.num_kv_heads * config.head_dim
    layers = tuple(
        LayerWeights(
            attn_norm=gain(h),
            wq=dense(q_dim, h),
            wk=dense(kv_dim, h),
            wv=dense(kv_dim, h),
            wo=dense(h, q_dim),
            mlp_norm=gain(h),
            w_gate=dense(config.intermediate, h),
            w_up=dense(config.intermediate, h),
            w_down=dense(h, config.intermediate),
        )
        for _ in range(config.num_layers)
    )
    return ModelWeights(
        embed=torch.randn(config.vocab_size, h, generator=gen).to(dtype),
        layers=layers,
        final_norm=gain(h),
        lm_head=dense(config.vocab_size, h),
    )


class KvAccess(Protocol):
    """Where attention gets its keys and values from."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention output `[T, heads, dim]` for this forward's queries `q` `[T, heads, dim]`,
        given this forward's new keys and values `k`, `v` `[T, kv_heads, dim]`."""
        ...


def rms_norm(x: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
    """RMSNorm over the last dimension, computed in float32."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + _RMS_EPS)
    return (normed * gain.float()).to(x.dtype)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate `x` `[T, heads, dim]` by its token's position (rotate-half convention)."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-torch.arange(half, dtype=torch.float32) / half)
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotated.to(x.dtype)


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offset: int
) -> torch.Tensor:
    """Grouped-query causal attention of `n` queries over `L` keys.

    `q` is `[n, heads, dim]`, `k` and `v` `[L, kv_heads, dim]`; query `j` sits at sequence index
    `q_offset + j` and sees keys `[0, q_offset + j]`. Returns `[n, heads, dim]`.
    """
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    query_index = torch.arange(q.shape[0]) + q_offset
    mask = torch.arange(k.shape[0])[None, :] <= query_index[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask
    )
    return out.transpose(0, 1)


@final
class TinyLlama:
    """The transformer: `forward` maps flat tokens to logits, reading K/V through a `KvAccess`."""

    __slots__ = ("config", "weights")

    def __init__(self, config: ModelConfig) -> None:
        """Build the model with weights from `init_weights(config)`."""
        self.config = config
        self.weights = init_weights(config)

    @property
    def vocab_size(self) -> int:
        """Number of logits per token."""
        return self.config.vocab_size

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv: KvAccess,
        logit_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits `[len(logit_index), vocab]` (all `T` tokens when `logit_index` is None) for
        flat `input_ids` `[T]` at `positions` `[T]`."""
        cfg, w = self.config, self.weights
        h = w.embed[input_ids.to(torch.int64)]
        for layer, lw in enumerate(w.layers):
            x = rms_norm(h, lw.attn_norm)
            q = apply_rope(
                (x @ lw.wq.T).view(-1, cfg.num_heads, cfg.head_dim), positions, cfg.rope_theta
            )
            k = apply_rope(
                (x @ lw.wk.T).view(-1, cfg.num_kv_heads, cfg.head_dim), positions, cfg.rope_theta
            )
            v = (x @ lw.wv.T).view(-1, cfg.num_kv_heads, cfg.head_dim)
            h = h + kv.attend(layer, q, k, v).reshape(h.shape[0], -1) @ lw.wo.T
            x = rms_norm(h, lw.mlp_norm)
            h = h + (F.silu(x @ lw.w_gate.T) * (x @ lw.w_up.T)) @ lw.w_down.T
        if logit_index is not None:
            h = h[logit_index]
        return rms_norm(h, w.final_norm) @ w.lm_head.T
