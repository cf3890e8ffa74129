"""A hand-driven, oracle-sampled engine for fault-injection tests (SPEC §11).

Paged K bytes (page size 2) for a FULL pool and, optionally, a SWA sub-pool with its own K bytes
and a non-identity full->SWA table. Requests prefill their prompt, then decode the oracle's
tokens (after `maybe_swap_next_tokens`). Finished requests are either freed (LIFO free lists, so
slots are reused) or kept as unlocked prefix-cache nodes the walker reports.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvcanary.canary import (
    Canary,
    CanaryConfig,
    CanaryLaunchCapacities,
    CanaryMode,
    PerturbConfig,
    RealDataMode,
    install,
)
from kvcanary.canary.perturb import Perturber
from kvcanary.contract import (
    BufferGroupSpec,
    ExpectedInputs,
    ForwardView,
    GroupKind,
    RealKvSource,
    TokenOracle,
    Violation,
    request_key,
    walk_node_slots,
)

PAGE, BPT, VOCAB = 2, 32, 1000


@dataclass
class Req:
    """One request: its req_to_token row, oracle key, prompt and tokens so far."""

    row: int
    key: int
    prompt: list[int]
    tokens: list[int]
    computed: int = 0


class CacheWalker:
    """Unlocked cache nodes, one per cached finished request (depth 0)."""

    def __init__(self) -> None:
        self.nodes: list[list[int]] = []

    def walk(
        self, *, unlocked_only: bool = False, swa_resident_only: bool = False
    ) -> Iterable[tuple[int, int, int]]:
        for slots in self.nodes:
            yield from walk_node_slots(slots, 0, -1)


class Spy:
    """Wraps a Perturber and records every array element each hook changed."""

    def __init__(self, inner: Perturber, engine: SimEngine) -> None:
        self.inner, self.engine = inner, engine
        self.diffs: list[tuple[str, int, str, tuple[int, ...], int, int]] = []

    def bind(self, canary: Any) -> None:
        self.inner.bind(canary)

    def _around(self, hook: str, step: int, view: ForwardView | None, call: Any) -> Any:
        before = self.engine.state(view)
        out = call()
        after = self.engine.state(view)
        for name, arr in before.items():
            for idx in np.argwhere(arr != after[name]):
                key = tuple(int(x) for x in idx)
                self.diffs.append((hook, step, name, key, int(arr[key]), int(after[name][key])))
        return out

    def before_plan(self, *, view: ForwardView, step: int) -> None:
        self._around(
            "before_plan", step, view, lambda: self.inner.before_plan(view=view, step=step)
        )

    def after_tail(self, *, view: ForwardView, step: int) -> None:
        self._around("after_tail", step, view, lambda: self.inner.after_tail(view=view, step=step))

    def at_end_step(self, *, step: int, sweep_due: bool) -> None:
        self._around("at_end_step", step, None,
                     lambda: self.inner.at_end_step(step=step, sweep_due=sweep_due))  # fmt: skip

    def maybe_swap_next_tokens(self, *, tokens: list[int], step: int) -> list[int]:
        out: list[int] = self.inner.maybe_swap_next_tokens(tokens=tokens, step=step)
        return out

    def injections(self) -> Any:
        return self.inner.injections()


@dataclass
class SimEngine:
    """The engine. `probs` maps perturb modes to p; `max_fires` caps each mode (None = no cap)."""

    probs: dict[str, float] = field(default_factory=dict)
    swa_window: int | None = None
    real_data: RealDataMode = RealDataMode.PARTIAL
    target_group: str | None = "full"
    warmup: int = 2
    seed: int = 0
    max_fires: int | None = 1
    sweep_interval: int = 0
    write_assert: bool = False
    mutable: bool = True
    kernels: str = "reference"
    num_slots: int = 64
    num_rows: int = 8
    max_len: int = 32

    def __post_init__(self) -> None:
        self.oracle = TokenOracle(VOCAB)
        self.r2t = torch.zeros(self.num_rows, self.max_len, dtype=torch.int32)
        self.k = torch.zeros(self.num_slots // PAGE, PAGE * BPT, dtype=torch.uint8)
        self.free = list(range(self.num_slots - 1, 0, -1))  # pop() hands out 1, 2, 3, ...
        self.reqs: dict[str, Req] = {}
        self.walker = CacheWalker()
        read = 16 if self.real_data is RealDataMode.PARTIAL else BPT
        groups = [self._group(GroupKind.FULL, self.k, read)]
        if self.swa_window is not None:
            self.swa_k = torch.zeros(self.num_slots // PAGE, PAGE * BPT, dtype=torch.uint8)
            self.lut = torch.zeros(self.num_slots, dtype=torch.int64)
            self.swa_free = list(range(1, self.num_slots))  # pop() hands out 63, 62, ...
            groups.append(self._group(GroupKind.SWA, self.swa_k, read))
        cfg = CanaryConfig(
            mode=CanaryMode.LOG, real_data=self.real_data, sweep_interval=self.sweep_interval,
            stats_print_every_n_steps=0, enable_write_input_assert=self.write_assert,
            perturb=PerturbConfig(probabilities=self.probs, seed=self.seed,
                                  warmup_steps=self.warmup, target_group=self.target_group),
        )  # fmt: skip
        self.spy = Spy(Perturber(cfg.perturb, max_fires_per_mode=self.max_fires), self)
        caps = CanaryLaunchCapacities.from_args(
            req_to_token_pool_size=self.num_rows, max_seq_len_per_req=self.max_len,
            pool_slot_count=self.num_slots, cuda_graph_max_bs=None,
            speculative_num_draft_tokens=None, max_prefill_tokens=64, chunked_prefill_size=None,
        )  # fmt: skip
        canary = install(cfg, groups, caps, self.oracle, kernels=self.kernels, perturb=self.spy)
        assert canary is not None
        self.canary: Canary = canary
        if self.sweep_interval:
            canary.attach_prefix_cache(walker=self.walker)
        self.rows: list[Violation] = []
        self.written: dict[int, list[int]] = {}  # step -> out_slots as the engine allocated them
        self.prefix: dict[int, dict[int, int]] = {}  # step -> {req_row: prefix_len}

    def _group(self, kind: GroupKind, k: torch.Tensor, read: int | None) -> BufferGroupSpec:
        src = (RealKvSource(k, PAGE, BPT, read),) if self.real_data is not RealDataMode.NONE else ()
        if kind is GroupKind.FULL:
            return BufferGroupSpec(kind=kind, num_slots=self.num_slots, has_v=False, k_sources=src)
        return BufferGroupSpec(kind=kind, num_slots=self.num_slots, has_v=False, k_sources=src,
                               full_to_swa=self.lut, window=self.swa_window)  # fmt: skip

    # ----------------------------------------------------------------- requests
    def add(self, rid: str, prompt: list[int]) -> None:
        used = {r.row for r in self.reqs.values()}
        row = min(set(range(1, self.num_rows)) - used)
        self.reqs[rid] = Req(row, request_key(rid), list(prompt), list(prompt))

    def finish(self, rid: str, *, cache: bool) -> None:
        """Cache the request's slots (an unlocked node) or free them for reuse."""
        req = self.reqs.pop(rid)
        slots = [int(s) for s in self.r2t[req.row, : req.computed]]
        if cache:
            self.walker.nodes.append(slots)
        else:
            for s in reversed(slots):
                self.free.append(s)
                if self.swa_window is not None and int(self.lut[s]):
                    self.swa_free.append(int(self.lut[s]))
                    self.lut[s] = 0
        self.r2t[req.row] = 0

    def slot_at(self, req_row: int, position: int, group: str = "full") -> int:
        """The slot at `position` of `req_row`, group-local for `swa`."""
        full = int(self.r2t[req_row, position])
        return int(self.lut[full]) if group == "swa" else full

    # ----------------------------------------------------------------- one engine iteration
    def step(self, rids: list[str]) -> None:
        """One forward over `rids` (prefill what is missing, else decode), sample, end step."""
        rows, prefix, extend, ids, pos, out, exp_tok = [], [], [], [], [], [], []
        for rid in rids:
            req = self.reqs[rid]
            new = req.tokens[req.computed :]
            slots = [self.free.pop() for _ in new]
            for j, s in enumerate(slots):
                self.r2t[req.row, req.computed + j] = s
                if self.swa_window is not None:
                    self.lut[s] = self.swa_free.pop()
            rows.append(req.row), prefix.append(req.computed), extend.append(len(new))
            ids += new
            pos += list(range(req.computed, req.computed + len(new)))
            out += slots
            exp_tok += [self.oracle.expected_token(req.key, req.prompt, p)
                        for p in range(req.computed, req.computed + len(new))]  # fmt: skip

        def t(x: list[int]) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.int64)

        expected = (
            ExpectedInputs(tokens=t(exp_tok), positions=t(pos)) if self.write_assert else None
        )
        view = ForwardView(
            rows=t(rows), prefix_lens=t(prefix), extend_lens=t(extend), input_ids=t(ids),
            positions=t(pos), out_slots=t(out), req_to_token=self.r2t, expected_inputs=expected,
            mutable=self.mutable,
        )  # fmt: skip
        self.written[self.canary.step] = list(out)
        self.prefix[self.canary.step] = dict(zip(rows, prefix, strict=True))
        self.canary.pre_forward(view=view)
        self.write_kv(view)
        self.canary.post_forward(view=view)
        sampled, start = [], 0
        for rid, n in zip(rids, extend, strict=True):
            req = self.reqs[rid]
            req.computed += n
            start += n
            sampled.append(self.oracle.next_token(req.key, int(view.positions[start - 1])))
        sampled = self.canary.maybe_swap_next_tokens(tokens=sampled)
        for rid, tok in zip(rids, sampled, strict=True):
            self.reqs[rid].tokens.append(tok)
        self.canary.end_step()
        self.rows += self.canary.drain_violations()

    def write_kv(self, view: ForwardView) -> None:
        """The model: K bytes from (token, position) at each written slot (reads the live view)."""
        n = int(view.extend_lens.clamp(min=0).sum())
        for slot, tok, p in zip(view.out_slots[:n].tolist(), view.input_ids[:n].tolist(),
                                view.positions[:n].tolist(), strict=True):  # fmt: skip
            if slot <= 0:
                continue
            tile = ((torch.arange(BPT) * 7 + tok * 13 + p * 5) % 251).to(torch.uint8)
            self.k[slot // PAGE, (slot % PAGE) * BPT : (slot % PAGE + 1) * BPT] = tile
            if self.swa_window is not None and (s := int(self.lut[slot])) > 0:
                self.swa_k[s // PAGE, (s % PAGE) * BPT : (s % PAGE + 1) * BPT] = tile ^ 0x5A

    def state(self, view: ForwardView | None) -> dict[str, np.ndarray]:
        """Copies of everything an injection may touch."""
        out = {"req_to_token": self.r2t.numpy().copy(), "k_full": self.k.numpy().copy()}
        if view is not None:
            out["out_slots"] = view.out_slots.numpy().copy()
            out["positions"] = view.positions.numpy().copy()
        if self.swa_window is not None:
            out["k_swa"] = self.swa_k.numpy().copy()
            out["lut"] = self.lut.numpy().copy()
        for g in self.canary.groups:
            for stage in ("head", "tail"):
                out[f"{stage}_{g.name}"] = g.buffer(stage, "k").copy()
        return out


# --------------------------------------------------------------------- scenarios (warm-up 2)
def two_decoders(e: SimEngine, steps: int = 5) -> SimEngine:
    """Requests a and b prefill 4 tokens at step 0, then decode together."""
    e.add("a", [1, 2, 3, 4])
    e.add("b", [5, 6, 7, 8])
    for _ in range(steps):
        e.step(["a", "b"])
    return e


def cached_then_decode(e: SimEngine, steps: int = 5) -> SimEngine:
    """a and b run two steps; a finishes into the prefix cache (unlocked); b keeps decoding."""
    e.add("a", [1, 2, 3, 4])
    e.add("b", [5, 6, 7, 8])
    e.step(["a", "b"])
    e.step(["a", "b"])
    e.finish("a", cache=True)
    for _ in range(steps - 2):
        e.step(["b"])
    return e


def freed_then_reused(e: SimEngine, steps: int = 5) -> SimEngine:
    """a and b run two steps; a is freed; c's prefill at step 2 reuses a's slots."""
    e.add("a", [1, 2, 3, 4])
    e.add("b", [5, 6, 7, 8])
    e.step(["a", "b"])
    e.step(["a", "b"])
    e.finish("a", cache=False)
    e.add("c", [9, 10, 11])
    for _ in range(steps - 2):
        e.step(["b", "c"])
    return e
