"""One vLLM `LLM` with the canary attached as its KV connector (`KVCanaryConnector`).

The engine core runs where vLLM's `VLLM_ENABLE_V1_MULTIPROCESSING` says (vLLM's default: a child
process). Figures come from vLLM's own Prometheus counters, the canary's `kvcanary_*` included;
the violations themselves (slots, reasons, for 1:1 fault correlation) and fault arming reach the
canary through `collective_rpc` (`kvcanary.app.vllm.rpc`), so every process layout (in-process,
multiprocess, one worker per tensor-parallel rank) behaves the same.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcanary.app.selftest.correlate import Fault
from kvcanary.app.vllm.rpc import RPC_EXTENSION, fault_from_wire, violation_from_wire
from kvcanary.app.vllm.workload import VllmRequest
from kvcanary.canary import CanaryConfig
from kvcanary.contract import Violation, fail_reason_labels

__all__ = ["VllmEngine", "VllmRun", "VllmSettings", "canary_env"]


@dataclass(frozen=True)
class VllmSettings:
    """Engine sizes: a small KV budget (`kv_blocks` blocks of `block_size` tokens) and a token
    budget below the longest prompts force preemption and chunked prefill."""

    model: Path
    block_size: int = 32
    kv_blocks: int = 40
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 128
    max_model_len: int = 512
    dtype: str = "auto"
    seed: int = 0
    tensor_parallel_size: int = 1


def canary_env(config: CanaryConfig) -> dict[str, str]:
    """The adapter's environment for `config` (mode, real data, sweep cadence, token check,
    verify stride)."""
    return {
        "KVCANARY_MODE": config.mode.value,
        "KVCANARY_REAL_DATA": config.real_data.value,
        "KVCANARY_SWEEP_INTERVAL": str(config.sweep_interval),
        "KVCANARY_ENABLE_VERIFY_TOKEN_ASSERT": "1" if config.enable_verify_token_assert else "0",
        "KVCANARY_VERIFY_STRIDE": str(config.verify_stride),
    }


def in_process() -> bool:
    """True when vLLM will run the engine core in this process (`VLLM_ENABLE_V1_MULTIPROCESSING`
    is 0; vLLM's default is 1)."""
    return os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1").strip() in ("0", "false", "False")


@dataclass(frozen=True)
class VllmRun:
    """What one workload run did: the summary figures (the `kvcanary run` schema plus vLLM's
    own counters) and the violations it reported."""

    figures: dict[str, Any]
    violations: tuple[Violation, ...] = field(repr=False)
    outputs: tuple[tuple[int, ...], ...] = field(repr=False)
    finish_reasons: tuple[str | None, ...] = field(default=(), repr=False)
    #: per request, how often mode `recover` recomputed it (`kvcanary_recomputes` of its
    #: `kv_transfer_params`; 0 in other modes)
    recomputes: tuple[int, ...] = field(default=(), repr=False)


#: running per-rank counters `drain` sums (`recorded`: every violation, dropped details included)
_RANK_COUNTERS = ("canary_seconds", "split_forwards", "chunked_prefill_rows", "recorded")


def _metric_totals(llm: Any) -> Counter[str]:
    """vLLM's Prometheus counters summed over labels; `kvcanary_violations` also per
    `reason` (as `kvcanary_violations:<reason>`)."""
    from prometheus_client import REGISTRY

    totals: Counter[str] = Counter()
    for m in llm.get_metrics():  # vLLM's own (`vllm:*`; it lists the connector's too)
        value = getattr(m, "value", None)
        if isinstance(value, int | float) and not m.name.startswith("kvcanary_"):
            totals[m.name] += value
    for family in REGISTRY.collect():  # the connector's, registered by vLLM's stat logger
        if not family.name.startswith("kvcanary_"):
            continue
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue
            totals[family.name] += sample.value
            if family.name == "kvcanary_violations":
                totals[f"kvcanary_violations:{sample.labels.get('reason', '?')}"] += sample.value
    return totals


class VllmEngine:
    """A vLLM `LLM` on CPU with `KVCanaryConnector` as its KV connector."""

    def __init__(self, settings: VllmSettings, env: Mapping[str, str],
                 faults: bool = False) -> None:  # fmt: skip
        """Build the engine with the canary's `env`; `faults`: give the canary (in whatever
        process vLLM runs it) a `VllmFaultInjector`, armed through `arm` / `disarm`."""
        os.environ.update(env)
        from vllm import LLM

        from kvcanary.adapters.vllm.plugin import CONNECTOR_CONFIG

        self.settings = settings
        self.in_process = in_process()
        self.canary_on = env.get("KVCANARY_MODE", "none") != "none"
        transfer = dict(CONNECTOR_CONFIG) if self.canary_on else None
        if transfer is not None and env.get("KVCANARY_MODE", "").strip().lower() == "recover":
            transfer["kv_load_failure_policy"] = "recompute"  # recover: vLLM recomputes
        self.llm = LLM(
            model=str(settings.model), skip_tokenizer_init=True, dtype=settings.dtype,
            block_size=settings.block_size, enable_prefix_caching=True,
            enable_chunked_prefill=True, max_model_len=settings.max_model_len,
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            num_gpu_blocks_override=settings.kv_blocks, enforce_eager=True,
            gpu_memory_utilization=0.3, seed=settings.seed, disable_log_stats=False,
            kv_transfer_config=transfer, worker_extension_cls=RPC_EXTENSION,
            tensor_parallel_size=settings.tensor_parallel_size,
        )  # fmt: skip
        #: the dtype vLLM chose (`auto` resolved)
        self.dtype = str(self.llm.llm_engine.vllm_config.model_config.dtype).removeprefix("torch.")
        self.ranks = 0
        if self.canary_on:
            self.ranks = len(self._rpc("kvcanary_drain"))  # raises when a rank has no canary
        if faults:
            self._rpc("kvcanary_attach_injector")

    def _rpc(self, method: str, *args: Any) -> list[Any]:
        """`method` of `kvcanary.app.vllm.rpc.CanaryRpc` on every rank (one result per rank)."""
        return list(self.llm.collective_rpc(method, args=args))

    def arm(self, mode: str, *, seed: int, steps_ahead: int) -> None:
        """Arm fault `mode` on every rank, to fire `steps_ahead` canary steps from now."""
        self._rpc("kvcanary_arm", mode, seed, steps_ahead)

    def disarm(self, *, sweep_interval: int) -> list[Fault]:
        """Stop injecting; the faults every rank injected in the run."""
        return [fault_from_wire(d) for rank in self._rpc("kvcanary_disarm", sweep_interval)
                for d in rank]  # fmt: skip

    def drain(self) -> tuple[list[Violation], Counter[str], list[int]]:
        """The union of every rank's violations since the previous drain, the ranks' summed
        running counters (`canary_seconds`, `split_forwards`, `chunked_prefill_rows`,
        `recorded`) and each rank's own running `recorded` count."""
        found: list[Violation] = []
        totals: Counter[str] = Counter()
        per_rank: list[int] = []
        if not self.canary_on:
            return found, totals, per_rank
        for rank in self._rpc("kvcanary_drain"):
            found.extend(violation_from_wire(d) for d in rank["violations"])
            for key in _RANK_COUNTERS:
                totals[key] += rank[key]
            per_rank.append(int(rank["recorded"]))
        return found, totals, per_rank

    def reset_prefix_cache(self) -> None:
        """Drop vLLM's prefix cache (between independent runs on one engine) and the connector's
        scheduler-side state (a planted fault)."""
        if not self.llm.reset_prefix_cache(reset_connector=True):
            raise RuntimeError("vLLM refused to reset its prefix cache (requests still running)")

    def run(self, requests: Sequence[VllmRequest], *, seed: int, progress: bool = False) -> VllmRun:
        """Generate every request greedily and report the figures of this run alone
        (`progress`: vLLM's own progress bar on stderr)."""
        from vllm import SamplingParams

        _, counters0, ranks0 = self.drain()
        before = _metric_totals(self.llm)
        prompts = [{"prompt_token_ids": list(r.prompt)} for r in requests]
        params = [
            SamplingParams(
                max_tokens=r.max_tokens, temperature=0.0, detokenize=False, ignore_eos=True
            )
            for r in requests
        ]
        start = time.perf_counter()
        outs = self.llm.generate(prompts, params, use_tqdm=progress)
        wall = time.perf_counter() - start
        after = _metric_totals(self.llm)
        d = {k: after[k] - before[k] for k in after}
        found, counters, ranks = self.drain()
        violations = tuple(found)
        by_reason: Counter[str] = Counter(
            lab for v in violations for lab in fail_reason_labels(v.fail_reason_bits)
        )
        figures: dict[str, Any] = {
            "engine": "vllm",
            "requests_finished": sum(o.finished for o in outs),
            "requests_aborted": 0,
            "tokens_generated": sum(len(o.outputs[0].token_ids) for o in outs),
            "forward_steps": int(d.get("kvcanary_forwards", 0)),
            "protected_slot_checks": int(d.get("kvcanary_checks", 0)),
            "sweep_passes": int(d.get("kvcanary_sweeps", 0)),
            # every violation the canaries recorded (the details only what their rings kept)
            "violations": int(counters["recorded"] - counters0["recorded"]),
            "violations_by_reason": dict(sorted(by_reason.items())),
            "retractions": int(d.get("vllm:num_preemptions", 0)),
            "radix_hit_tokens": int(d.get("vllm:prefix_cache_hits", 0)),
            "prefix_cache_queries": int(d.get("vllm:prefix_cache_queries", 0)),
            "spec_accepted_tokens": 0,
            "wall_seconds": round(wall, 3),
            "canary_mode": self.mode,
            "engine_core": self.engine_core,
            "dtype": self.dtype,
            "tensor_parallel_size": self.settings.tensor_parallel_size,
            "seed": seed,
        }
        if self.mode.strip().lower() == "recover":  # the scheduler half's counters (/metrics)
            for key in ("incidents", "recoveries", "recompute_tokens"):
                figures[key] = int(d.get(f"kvcanary_{key}", 0))
            figures["requests_failed"] = sum(o.outputs[0].finish_reason == "error" for o in outs)
            figures["requests_finished"] -= figures["requests_failed"]
        if self.canary_on:
            # the knob as the canary read it (the adapter's config comes from this environment)
            figures["verify_stride"] = int(os.environ.get("KVCANARY_VERIFY_STRIDE", "1"))
            figures["chunked_prefill_rows"] = int(
                counters["chunked_prefill_rows"] - counters0["chunked_prefill_rows"]
            )
            figures["split_forwards"] = int(
                counters["split_forwards"] - counters0["split_forwards"]
            )
            figures["canary_seconds"] = round(counters["canary_seconds"]
                                              - counters0["canary_seconds"], 6)  # fmt: skip
            # each tensor-parallel rank checks its own KV shard; "violations" is their union
            figures["violations_per_rank"] = [b - a for a, b in zip(ranks0, ranks, strict=True)]
        outputs = tuple(tuple(o.outputs[0].token_ids) for o in outs)
        reasons = tuple(o.outputs[0].finish_reason for o in outs)
        recomputes = tuple(int((o.kv_transfer_params or {}).get("kvcanary_recomputes", 0))
                           for o in outs)  # fmt: skip
        return VllmRun(figures, violations, outputs, finish_reasons=reasons,
                       recomputes=recomputes)  # fmt: skip

    @property
    def engine_core(self) -> str:
        """Where vLLM runs its engine core: `in-process` or `multiprocess` (its default)."""
        return "in-process" if self.in_process else "multiprocess"

    @property
    def mode(self) -> str:
        """The canary mode the engine was built with."""
        return os.environ.get("KVCANARY_MODE", "none")
