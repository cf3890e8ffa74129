"""One vLLM `LLM` with the canary attached as its KV connector (`KVCanaryConnector`).

The engine core runs where vLLM's `VLLM_ENABLE_V1_MULTIPROCESSING` says (vLLM's default: a child
process). Figures come from vLLM's own Prometheus counters, the canary's `kvcanary_*` included,
so they are the same in both layouts; with the in-process engine core (`=0`) the run also returns
the violations themselves (slots, reasons) for 1:1 fault correlation.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcanary.adapters.vllm.state import STATE
from kvcanary.app.vllm.workload import VllmRequest
from kvcanary.canary import Canary, CanaryConfig
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


def canary_env(config: CanaryConfig) -> dict[str, str]:
    """The adapter's environment for `config` (mode, real data, sweep cadence, token check)."""
    return {
        "KVCANARY_MODE": config.mode.value,
        "KVCANARY_REAL_DATA": config.real_data.value,
        "KVCANARY_SWEEP_INTERVAL": str(config.sweep_interval),
        "KVCANARY_ENABLE_VERIFY_TOKEN_ASSERT": "1" if config.enable_verify_token_assert else "0",
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
    start_step: int = 0
    finish_reasons: tuple[str | None, ...] = field(default=(), repr=False)


def _metric_totals(llm: Any) -> Counter[str]:
    """vLLM's Prometheus counters summed over labels; `kvcanary_violations` also per
    `reason` (as `kvcanary_violations:<reason>`)."""
    from prometheus_client import REGISTRY

    totals: Counter[str] = Counter()
    for m in llm.get_metrics():  # vLLM's own (`vllm:*`)
        value = getattr(m, "value", None)
        if isinstance(value, int | float):
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

    def __init__(self, settings: VllmSettings, env: Mapping[str, str], hooks: Any = None,
                 failure_policy: str = "recompute") -> None:  # fmt: skip
        os.environ.update(env)
        STATE.hooks = hooks
        from vllm import LLM

        from kvcanary.adapters.vllm.plugin import CONNECTOR_CONFIG

        self.settings = settings
        self.in_process = in_process()
        mode = env.get("KVCANARY_MODE", "none")
        transfer = dict(CONNECTOR_CONFIG) if mode != "none" else None
        if transfer is not None and mode == "recover":
            transfer["kv_load_failure_policy"] = failure_policy
        self.llm = LLM(
            model=str(settings.model), skip_tokenizer_init=True, dtype=settings.dtype,
            block_size=settings.block_size, enable_prefix_caching=True,
            enable_chunked_prefill=True, max_model_len=settings.max_model_len,
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            num_gpu_blocks_override=settings.kv_blocks, enforce_eager=True,
            gpu_memory_utilization=0.3, seed=settings.seed, disable_log_stats=False,
            kv_transfer_config=transfer,
        )  # fmt: skip
        self.worker = None
        if self.in_process and mode != "none":
            workers = [c.worker for c in STATE.live_connectors() if c.worker is not None]
            if not workers:
                raise RuntimeError("kv-canary: the vLLM connector did not install a canary "
                                   "(see the log)")  # fmt: skip
            self.worker = workers[-1]

    @property
    def canary(self) -> Canary | None:
        """The canary (in-process engine core only)."""
        return self.worker.canary if self.worker is not None else None

    def reset_prefix_cache(self) -> None:
        """Drop vLLM's prefix cache (between independent runs on one engine)."""
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache (requests still running)")

    def run(self, requests: Sequence[VllmRequest], *, seed: int, progress: bool = False) -> VllmRun:
        """Generate every request greedily and report the figures of this run alone
        (`progress`: vLLM's own progress bar on stderr)."""
        from vllm import SamplingParams

        w = self.worker
        c = self.canary
        step0 = c.step if c is not None else 0
        before = _metric_totals(self.llm)
        if w is not None:
            w.drain_violations()
            seconds0, split0, chunk0 = w.canary_seconds, w.split_forwards, w.chunked_prefill_rows
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
        violations = tuple(w.drain_violations()) if w is not None else ()
        if w is not None:
            by_reason: Counter[str] = Counter(
                lab for v in violations for lab in fail_reason_labels(v.fail_reason_bits)
            )
        else:
            by_reason = Counter({k.split(":", 1)[1]: int(v) for k, v in d.items()
                                 if k.startswith("kvcanary_violations:") and v})  # fmt: skip
        figures: dict[str, Any] = {
            "engine": "vllm",
            "requests_finished": sum(o.finished for o in outs),
            "requests_aborted": 0,
            "tokens_generated": sum(len(o.outputs[0].token_ids) for o in outs),
            "forward_steps": int(d.get("kvcanary_forwards", 0)),
            "protected_slot_checks": int(d.get("kvcanary_checks", 0)),
            "sweep_passes": int(d.get("kvcanary_sweeps", 0)),
            "violations": len(violations) if w is not None else int(
                d.get("kvcanary_violations", 0)),
            "violations_by_reason": dict(sorted(by_reason.items())),
            "retractions": int(d.get("vllm:num_preemptions", 0)),
            "radix_hit_tokens": int(d.get("vllm:prefix_cache_hits", 0)),
            "prefix_cache_queries": int(d.get("vllm:prefix_cache_queries", 0)),
            "spec_accepted_tokens": 0,
            "wall_seconds": round(wall, 3),
            "canary_mode": self.mode,
            "engine_core": "in-process" if self.in_process else "multiprocess",
            "dtype": self.settings.dtype,
            "seed": seed,
        }
        if w is not None:
            figures["chunked_prefill_rows"] = w.chunked_prefill_rows - chunk0
            figures["split_forwards"] = w.split_forwards - split0
            figures["canary_seconds"] = round(w.canary_seconds - seconds0, 3)
        outputs = tuple(tuple(o.outputs[0].token_ids) for o in outs)
        reasons = tuple(o.outputs[0].finish_reason for o in outs)
        return VllmRun(figures, violations, outputs, start_step=step0, finish_reasons=reasons)

    @property
    def mode(self) -> str:
        """The canary mode the engine was built with."""
        return os.environ.get("KVCANARY_MODE", "none")
