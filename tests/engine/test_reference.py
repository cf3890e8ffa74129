"""The paged path (pool + req_to_token + runner) equals the no-cache reference token for token."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
import torch

from kvcanary.engine.config import EngineConfig
from kvcanary.engine.engine import Engine
from kvcanary.engine.kv_pool import KvPool
from kvcanary.engine.model import ModelConfig, TinyLlama
from kvcanary.engine.paged_attention import PagedKv
from kvcanary.engine.plan import ForwardKind, SamplingSpec, ScheduledChunk, StepPlan
from kvcanary.engine.reference import greedy_reference, reference_logits
from kvcanary.engine.req_to_token import TorchReqToTokenTable
from kvcanary.engine.runner import ModelRunner

CONFIG = ModelConfig(
    vocab_size=128, hidden=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, seed=3
)
PROMPT_A = [7, 1, 99, 42, 5, 5, 63, 120, 8, 31, 77]
PROMPT_B = [12, 4, 4, 90, 33, 2, 101]
MAX_NEW = 8


@dataclass
class Req:
    """A request driven by hand: prefill in the given chunk sizes, then decode."""

    row: int
    prompt: list[int]
    chunk_sizes: list[int]
    spec: SamplingSpec = field(default_factory=SamplingSpec)
    shared: list[int] = field(default_factory=list)  # slots of a cached prefix to reuse
    computed: int = 0
    outputs: list[int] = field(default_factory=list)

    @property
    def seq(self) -> list[int]:
        return self.prompt + self.outputs


def make_runner(model: TinyLlama, num_slots: int = 96) -> tuple[ModelRunner, TorchReqToTokenTable]:
    cfg = model.config
    pool = KvPool(
        num_slots=num_slots,
        num_layers=cfg.num_layers,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        dtype=cfg.torch_dtype,
    )
    table = TorchReqToTokenTable(max_rows=4, max_context_len=32)
    return ModelRunner(model, pool, table), table


def generate(
    runner: ModelRunner,
    table: TorchReqToTokenTable,
    reqs: Sequence[Req],
    max_new: int,
    free: list[int],
) -> None:
    """Batch all requests every step; new slots are popped from `free`."""
    for r in reqs:
        if r.shared:
            table.write(r.row, 0, r.shared)
            r.computed = len(r.shared)
    while True:
        active = [r for r in reqs if len(r.outputs) < max_new]
        if not active:
            return
        chunks = []
        for r in active:
            prefilling = r.computed < len(r.prompt)
            n = min(r.chunk_sizes.pop(0), len(r.prompt) - r.computed) if prefilling else 1
            slots = [free.pop() for _ in range(n)]
            table.write(r.row, r.computed, slots)
            finishes = r.computed + n >= len(r.prompt)
            chunks.append(
                ScheduledChunk(
                    request_id=f"req-{r.row}",
                    row=r.row,
                    prefix_len=r.computed,
                    input_ids=tuple(r.seq[r.computed : r.computed + n]),
                    out_slots=tuple(slots),
                    num_samples=1 if finishes else 0,
                    sampling=r.spec,
                    prompt_len=len(r.prompt),
                    truth_tokens=tuple(r.seq),
                )
            )
            r.computed += n
        kind = (
            ForwardKind.DECODE if all(len(c.input_ids) == 1 for c in chunks) else ForwardKind.EXTEND
        )
        out = runner.run(StepPlan(kind=kind, chunks=tuple(chunks)))
        for r, chunk_out in zip(active, out.chunks, strict=True):
            r.outputs.extend(chunk_out.sampled)


def shuffled_slots(seed: int, num_slots: int = 96) -> list[int]:
    """Every usable slot (slot 0 is reserved) in a seeded random order."""
    free = list(range(1, num_slots))
    random.Random(seed).shuffle(free)
    return free


@pytest.fixture(scope="module")
def model() -> TinyLlama:
    return TinyLlama(CONFIG)


@pytest.fixture(scope="module")
def expected(model: TinyLlama) -> dict[str, list[int]]:
    return {
        "a": greedy_reference(model, PROMPT_A, MAX_NEW),
        "b": greedy_reference(model, PROMPT_B, MAX_NEW),
    }


@pytest.mark.parametrize(
    ("chunks_a", "chunks_b"),
    [
        ([11], [7]),
        ([1] * 11, [7]),
        ([3, 5, 3], [2, 2, 3]),
        ([10, 1], [1, 6]),
    ],
)
def test_chunked_paged_generation_equals_reference(
    model: TinyLlama, expected: dict[str, list[int]], chunks_a: list[int], chunks_b: list[int]
) -> None:
    runner, table = make_runner(model)
    a, b = (
        Req(row=1, prompt=PROMPT_A, chunk_sizes=chunks_a),
        Req(row=3, prompt=PROMPT_B, chunk_sizes=chunks_b),
    )
    generate(runner, table, [a, b], MAX_NEW, shuffled_slots(len(chunks_a)))
    assert a.outputs == expected["a"]
    assert b.outputs == expected["b"]


def test_shared_prefix_slots_equal_reference(
    model: TinyLlama, expected: dict[str, list[int]]
) -> None:
    """B reuses A's cached slots for a common prefix (as a radix hit would) and still matches."""
    runner, table = make_runner(model)
    a = Req(row=1, prompt=PROMPT_A, chunk_sizes=[11])
    free = shuffled_slots(5)
    generate(runner, table, [a], 1, free)
    prompt_c = [*PROMPT_A[:6], 3, 3, 9]
    c = Req(row=2, prompt=prompt_c, chunk_sizes=[2, 1], shared=table.read(1, 6))
    generate(runner, table, [c], MAX_NEW, free)
    assert a.outputs == expected["a"][:1]
    assert c.outputs == greedy_reference(model, prompt_c, MAX_NEW)


def test_paged_logits_match_reference_logits(model: TinyLlama) -> None:
    pool = KvPool(num_slots=32, num_layers=2, num_kv_heads=2, head_dim=16)
    table = TorchReqToTokenTable(max_rows=1, max_context_len=16)
    slots = list(range(31, 31 - len(PROMPT_A), -1))
    table.write(1, 0, slots)
    pieces = []
    for start, end in ((0, 4), (4, 5), (5, 11)):
        kv = PagedKv(
            pool=pool,
            req_to_token=table.tensor,
            out_slots=torch.tensor(slots[start:end]),
            rows=[1],
            prefix_lens=[start],
            extend_lens=[end - start],
        )
        ids, positions = torch.tensor(PROMPT_A[start:end]), torch.arange(start, end)
        pieces.append(model.forward(ids, positions, kv))
    assert torch.allclose(torch.cat(pieces), reference_logits(model, PROMPT_A), atol=1e-4)


def test_bfloat16_unchunked_prefill_matches_reference_first_token() -> None:
    bf16 = TinyLlama(dataclasses.replace(CONFIG, dtype="bfloat16"))
    runner, table = make_runner(bf16)
    a = Req(row=1, prompt=PROMPT_A, chunk_sizes=[11])
    generate(runner, table, [a], 4, shuffled_slots(0))
    assert a.outputs[0] == greedy_reference(bf16, PROMPT_A, 1)[0]
    assert all(0 <= t < CONFIG.vocab_size for t in a.outputs)


def test_temperature_tokens_are_stable_across_re_prefill(model: TinyLlama) -> None:
    """A preempted request, re-prefilled in other chunks and slots, samples the same tokens."""
    spec = SamplingSpec(greedy=False, temperature=1.0, seed=99)
    runner, table = make_runner(model)
    first = Req(row=1, prompt=PROMPT_B, chunk_sizes=[7], spec=spec)
    generate(runner, table, [first], MAX_NEW, shuffled_slots(1))
    # Re-prefill: the prompt plus the first half of the outputs, in other chunks and slots.
    half = MAX_NEW // 2
    runner2, table2 = make_runner(model)
    again = Req(row=2, prompt=PROMPT_B + first.outputs[:half], chunk_sizes=[3, 3, 5], spec=spec)
    generate(runner2, table2, [again], MAX_NEW - half, shuffled_slots(2))
    assert again.outputs == first.outputs[half:]


@pytest.mark.parametrize("drafts", [0, 2])
def test_engine_end_to_end_equals_reference(model: TinyLlama, drafts: int) -> None:
    """The full engine (scheduler, radix sharing, chunked prefill, speculation) on this runner."""
    config = EngineConfig(
        num_slots=96,
        max_context_len=32,  # as make_runner's table
        vocab_size=CONFIG.vocab_size,
        max_running_requests=4,
        max_batch_size=4,
        chunked_prefill_size=5,
        max_prefill_tokens=12,
        speculative_num_draft_tokens=drafts,
    )
    runner, table = make_runner(model)
    engine = Engine(config, runner, table=table)
    rng = random.Random(drafts)
    shared = [rng.randrange(128) for _ in range(9)]
    prompts = {
        f"r{i}": shared[: rng.randrange(3, 9)]
        + [rng.randrange(128) for _ in range(rng.randrange(1, 6))]
        for i in range(6)
    }
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, MAX_NEW)
    finished = engine.run_until_idle(max_steps=500)
    assert sorted(f.request_id for f in finished) == sorted(prompts)
    assert engine.stats().radix_hit_tokens > 0
    for f in finished:
        assert list(f.output) == greedy_reference(model, prompts[f.request_id], MAX_NEW)
