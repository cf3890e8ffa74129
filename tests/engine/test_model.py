"""TinyLlama and OracleModel: config validation, seeded weights, and attention that really reads
K/V from the pool through `req_to_token`."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvcanary.engine.kv_pool import KvPool
from kvcanary.engine.model import ModelConfig, TinyLlama, apply_rope, init_weights
from kvcanary.engine.oracle_model import OracleModel, synthetic_kv
from kvcanary.engine.paged_attention import PagedKv
from kvcanary.engine.req_to_token import TorchReqToTokenTable

CONFIG = ModelConfig(
    vocab_size=128, hidden=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, seed=7
)
PROMPT = [3, 17, 42, 99, 5, 64, 23, 11]
SLOTS = [9, 4, 30, 12, 7, 21, 2, 15]  # deliberately scattered


def make_pool(config: ModelConfig = CONFIG) -> KvPool:
    return KvPool(
        num_slots=32,
        num_layers=config.num_layers,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        dtype=config.torch_dtype,
    )


def paged_kv(pool: KvPool, table: TorchReqToTokenTable, prefix: int, slots: list[int]) -> PagedKv:
    return PagedKv(
        pool=pool,
        req_to_token=table.tensor,
        out_slots=torch.tensor(slots),
        rows=[1],
        prefix_lens=[prefix],
        extend_lens=[len(slots)],
    )


def run_chunk(
    model: TinyLlama, pool: KvPool, table: TorchReqToTokenTable, prefix: int, n: int
) -> torch.Tensor:
    """Forward PROMPT[prefix:prefix+n] of row 1 (its table entries are already written)."""
    ids = torch.tensor(PROMPT[prefix : prefix + n])
    positions = torch.arange(prefix, prefix + n)
    return model.forward(ids, positions, paged_kv(pool, table, prefix, SLOTS[prefix : prefix + n]))


@pytest.fixture
def prefilled() -> tuple[TinyLlama, KvPool, TorchReqToTokenTable]:
    """PROMPT[:-1] prefilled into row 1; the last prompt token is left for the test to run."""
    model, pool = TinyLlama(CONFIG), make_pool()
    table = TorchReqToTokenTable(max_rows=2, max_context_len=16)
    table.write(1, 0, SLOTS)
    run_chunk(model, pool, table, 0, len(PROMPT) - 1)
    return model, pool, table


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("vocab_size", 0, "vocab_size"),
        ("num_kv_heads", 3, "multiple"),
        ("head_dim", 15, "even"),
        ("dtype", "float16", "dtype"),
        ("rope_theta", 0.0, "rope_theta"),
        ("intermediate", -1, "intermediate"),
    ],
)
def test_config_validation(field: str, value: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(CONFIG, **{field: value})


def test_weights_are_seeded() -> None:
    a, b = init_weights(CONFIG), init_weights(CONFIG)
    other = init_weights(dataclasses.replace(CONFIG, seed=8))
    assert torch.equal(a.layers[1].wk, b.layers[1].wk) and torch.equal(a.lm_head, b.lm_head)
    assert not torch.equal(a.layers[1].wk, other.layers[1].wk)
    bf16 = init_weights(dataclasses.replace(CONFIG, dtype="bfloat16"))
    assert bf16.embed.dtype == torch.bfloat16
    assert torch.equal(bf16.embed, a.embed.to(torch.bfloat16))


def test_rope_preserves_norm_and_depends_on_position() -> None:
    x = torch.randn(3, 2, 16, generator=torch.Generator().manual_seed(0))
    rotated = apply_rope(x, torch.tensor([0, 1, 2]), 10000.0)
    assert torch.equal(rotated[0], x[0])
    assert torch.allclose(rotated.norm(dim=-1), x.norm(dim=-1), atol=1e-5)
    assert not torch.allclose(rotated[1], x[1])


def test_forward_writes_kv_at_out_slots_only(
    prefilled: tuple[TinyLlama, KvPool, TorchReqToTokenTable],
) -> None:
    _, pool, _ = prefilled
    written = set(SLOTS[:-1])
    for layer in range(CONFIG.num_layers):
        for slot in range(pool.num_slots):
            assert bool(pool.k(layer)[slot].any()) == (slot in written)
            assert bool(pool.v(layer)[slot].any()) == (slot in written)


def test_swapping_two_req_to_token_entries_changes_logits(
    prefilled: tuple[TinyLlama, KvPool, TorchReqToTokenTable],
) -> None:
    model, pool, table = prefilled
    last = len(PROMPT) - 1
    clean = run_chunk(model, pool, table, last, 1)
    assert torch.equal(run_chunk(model, pool, table, last, 1), clean)  # deterministic
    live = table.tensor
    live[1, 1], live[1, 4] = live[1, 4].clone(), live[1, 1].clone()
    swapped = run_chunk(model, pool, table, last, 1)
    assert not torch.allclose(swapped, clean)


def test_one_flipped_kv_byte_changes_logits(
    prefilled: tuple[TinyLlama, KvPool, TorchReqToTokenTable],
) -> None:
    model, pool, table = prefilled
    last = len(PROMPT) - 1
    clean = run_chunk(model, pool, table, last, 1)
    k_src, _ = pool.real_kv_sources(read_bytes=16)
    k_src.tensor[SLOTS[2], 3] ^= 0x40  # a high byte of the first float32: a visible change
    assert not torch.allclose(run_chunk(model, pool, table, last, 1), clean)


def test_new_tokens_are_read_back_through_req_to_token(
    prefilled: tuple[TinyLlama, KvPool, TorchReqToTokenTable],
) -> None:
    """The token being computed writes slot S but the table says T: attention reads T."""
    model, pool, table = prefilled
    last = len(PROMPT) - 1
    clean = run_chunk(model, pool, table, last, 1)
    table.write(1, last, [SLOTS[0]])  # mapping disagrees with out_slots
    assert not torch.allclose(run_chunk(model, pool, table, last, 1), clean)


def test_logit_index_selects_rows() -> None:
    model, pool = TinyLlama(CONFIG), make_pool()
    table = TorchReqToTokenTable(max_rows=1, max_context_len=16)
    table.write(1, 0, SLOTS[:4])
    kv = paged_kv(pool, table, 0, SLOTS[:4])
    ids, positions = torch.tensor(PROMPT[:4]), torch.arange(4)
    full = model.forward(ids, positions, kv)
    picked = model.forward(ids, positions, kv, logit_index=torch.tensor([3, 1]))
    assert full.shape == (4, 128) and picked.shape == (2, 128)
    assert torch.allclose(picked, full[[3, 1]], atol=1e-6)


def test_paged_kv_rejects_short_out_slots() -> None:
    table = TorchReqToTokenTable(max_rows=1, max_context_len=4)
    with pytest.raises(ValueError, match="out_slots"):
        PagedKv(
            pool=make_pool(),
            req_to_token=table.tensor,
            out_slots=torch.tensor([1]),
            rows=[1],
            prefix_lens=[0],
            extend_lens=[2],
        )


def test_oracle_model_writes_deterministic_kv_and_no_logits() -> None:
    model, pool = OracleModel(CONFIG), make_pool()
    table = TorchReqToTokenTable(max_rows=1, max_context_len=16)
    ids, positions = torch.tensor([5, 5, 6]), torch.tensor([0, 1, 2])
    kv = paged_kv(pool, table, 0, [3, 4, 5])
    assert model.forward(ids, positions, kv) is None
    assert model.vocab_size == 128
    k, v = synthetic_kv(ids, positions, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    for layer in range(CONFIG.num_layers):
        assert torch.equal(pool.k(layer)[[3, 4, 5]], k)
        assert torch.equal(pool.v(layer)[[3, 4, 5]], v)
    assert not pool.k(0)[[0, 1, 2, 6]].any()
    k_src, _ = pool.real_kv_sources(read_bytes=16)
    tiles = {bytes(k_src.tensor[s, :16].tolist()) for s in (3, 4, 5)}
    assert len(tiles) == 3  # same token at another position, or another token: other bytes
    assert not torch.equal(k, v)
    again, _ = synthetic_kv(ids, positions, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    assert torch.equal(again, k)


def test_synthetic_kv_tiles_are_distinct_in_bfloat16() -> None:
    ids = torch.arange(64).repeat(8)
    positions = torch.arange(8).repeat_interleave(64)
    k, _ = synthetic_kv(ids, positions, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16)
    first16 = k.reshape(len(ids), -1)[:, :8].view(torch.int16)
    assert len({tuple(row) for row in first16.tolist()}) == len(ids)
