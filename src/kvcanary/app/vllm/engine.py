"""One in-process vLLM engine with the kvcanary adapter attached through its entry point.

`VLLM_ENABLE_V1_MULTIPROCESSING=0` keeps the engine core (scheduler, block pool, worker) in this
process, so the adapter's sweep walker sees vLLM's prefix cache and tests can read the canary.
The adapter reads its knobs from the environment (it is a vLLM plugin); this module writes them
from an already validated `CanaryConfig` before the engine is built.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcanary.adapters.vllm.plugin import canaries
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
    dtype: str = "float32"
    seed: int = 0


def canary_env(config: CanaryConfig) -> dict[str, str]:
    """The adapter's environment for `config` (mode, real data, sweep cadence)."""
    return {
        "KVCANARY_MODE": config.mode.value,
        "KVCANARY_REAL_DATA": config.real_data.value,
        "KVCANARY_SWEEP_INTERVAL": str(config.sweep_interval),
    }


@dataclass(frozen=True)
class VllmRun:
    """What one workload run did: the summary figures (the `kvcanary run` schema plus vLLM's
    own counters) and the violations it reported."""

    figures: dict[str, Any]
    violations: tuple[Violation, ...] = field(repr=False)
    outputs: tuple[tuple[int, ...], ...] = field(repr=False)
    start_step: int = 0


def _metric_totals(llm: Any) -> Counter[str]:
    totals: Counter[str] = Counter()
    for m in llm.get_metrics():
        value = getattr(m, "value", None)
        if isinstance(value, int | float):
            totals[m.name] += value
    return totals


class VllmEngine:
    """A vLLM `LLM` on CPU with the canary adapter patched in (through vLLM's plugin loader)."""

    def __init__(self, settings: VllmSettings, env: Mapping[str, str], hooks: Any = None) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.update(env)
        STATE.hooks = hooks
        from vllm import LLM

        self.settings = settings
        self.llm = LLM(
            model=str(settings.model), skip_tokenizer_init=True, dtype=settings.dtype,
            block_size=settings.block_size, enable_prefix_caching=True,
            enable_chunked_prefill=True, max_model_len=settings.max_model_len,
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            num_gpu_blocks_override=settings.kv_blocks, enforce_eager=True,
            gpu_memory_utilization=0.3, seed=settings.seed, disable_log_stats=False,
        )  # fmt: skip
        mode = env.get("KVCANARY_MODE", "none")
        if mode != "none" and not STATE.patched:
            raise RuntimeError(
                "kv-canary: vLLM did not load the kvcanary plugin (entry point "
                "vllm.general_plugins:kvcanary); reinstall kvcanary with pip install -e '.[vllm]'"
            )
        found = canaries()
        self.canary: Canary | None = found[-1] if found else None
        if mode != "none" and self.canary is None:
            raise RuntimeError("kv-canary: the vLLM adapter did not install a canary (see log)")

    def reset_prefix_cache(self) -> None:
        """Drop vLLM's prefix cache (between independent runs on one engine)."""
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache (requests still running)")

    def run(self, requests: Sequence[VllmRequest], *, seed: int, progress: bool = False) -> VllmRun:
        """Generate every request greedily and report the figures of this run alone
        (`progress`: vLLM's own progress bar on stderr)."""
        from vllm import SamplingParams

        c = self.canary
        before = _metric_totals(self.llm)
        checks0 = sum(c.slot_run_counter.values()) if c else 0
        sweeps0, total0, step0 = (c.sweep_passes, c.total_violations, c.step) if c else (0, 0, 0)
        STATE.reset_counters()
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
        violations = tuple(c.drain_violations()) if c else ()
        by_reason: Counter[str] = Counter(
            lab for v in violations for lab in fail_reason_labels(v.fail_reason_bits)
        )
        n = STATE.counters
        figures: dict[str, Any] = {
            "engine": "vllm",
            "requests_finished": sum(o.finished for o in outs),
            "requests_aborted": 0,
            "tokens_generated": sum(len(o.outputs[0].token_ids) for o in outs),
            "forward_steps": n.forwards,
            "engine_steps": n.steps,
            "protected_slot_checks": (sum(c.slot_run_counter.values()) - checks0) if c else 0,
            "sweep_passes": (c.sweep_passes - sweeps0) if c else 0,
            "violations": (c.total_violations - total0) if c else 0,
            "violations_by_reason": dict(sorted(by_reason.items())),
            "retractions": int(after["vllm:num_preemptions"] - before["vllm:num_preemptions"]),
            "evictions": n.evicted_blocks,
            "radix_hit_tokens": int(
                after["vllm:prefix_cache_hits"] - before["vllm:prefix_cache_hits"]
            ),
            "prefix_cache_queries": int(
                after["vllm:prefix_cache_queries"] - before["vllm:prefix_cache_queries"]
            ),
            "chunked_prefill_rows": n.chunked_prefill_rows,
            "split_forwards": n.split_forwards,
            "spec_accepted_tokens": 0,
            "wall_seconds": round(wall, 3),
            "canary_seconds": round(n.canary_seconds, 3),
            "canary_mode": c.config.mode.value if c else "none",
            "seed": seed,
        }
        outputs = tuple(tuple(o.outputs[0].token_ids) for o in outs)
        return VllmRun(figures, violations, outputs, start_step=step0)
