"""`kvcanary vllm --disaggregate`: a real vLLM prefill -> decode pair over ExampleConnector's shared
storage, the canary in both (the plugin's `KVCANARY_MODE` shortcut beside the user-level
connector), clean requests first, then each transfer fault of `pd_faults` on every seed.

Two OpenAI servers on 127.0.0.1 (vLLM's defaults: multiprocess executor, dtype as given). For each
request the prefill engine gets the prompt with `max_tokens=1` (ExampleConnector saves its KV, the
canary its sidecar); the decode engine then gets the same prompt and lands that KV. Clean
requests: the decode engine's greedy tokens must equal the prefill engine's own for the prompt
(one engine, no transfer) and every landing verify must be clean. Fault cases: the decode
engine's connector is `PDFaultConnector` with a schedule that is `none` for the clean requests,
then the faults in order for each seed; landings run one at a time, so landing i is request i,
and each landing line of the canary is correlated with the fault journal line of the same load.
In mode `recover` (vLLM's `kv_load_failure_policy=recompute` set in the user's config, as a user
would) a fault case must also end with the prefill engine's own greedy tokens: the bad landing is
handed to vLLM as a load error and recomputed, only for that request.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcanary.app.vllm.engine import VllmSettings
from kvcanary.app.vllm.server import VllmServer, drive, kvcanary_series, scrape, start_all
from kvcanary.app.vllm.workload import VllmRequest

__all__ = ["FAULTS", "LANDED", "PD_FAULTS", "PDSpec", "pd_prompts", "run_pd_campaign"]

#: the canary's line per verified landing (adapters/vllm/pd_sidecar.py)
LANDED = re.compile(r"kv-canary: landed KV of (\d+) slots verified \(sidecar (\w+)\): (\d+) viol")
_JOURNAL = re.compile(r"kvcanary-pd-fault: load=(\d+) fault=(\w+) slots=(\d+)")
#: the landings `pd_faults.PDFaultConnector` can make (kept here: that module imports vLLM)
FAULTS = (
    "none",
    "wrong_slots",
    "dropped_block",
    "corrupt_bytes",
    "bit_flip",
    "late_duplicate",
    "partial_layers",
    "partial_save",
)
PD_FAULTS = FAULTS[1:]


@dataclass(frozen=True)
class PDSpec:
    """What the campaign runs: `requests` clean requests, then `faults` x `seeds` fault cases."""

    requests: int = 100
    faults: tuple[str, ...] = ()
    seeds: int = 10
    first_seed: int = 0
    max_tokens: int = 8
    mode: str = "log"

    def __post_init__(self) -> None:
        bad = [f for f in self.faults if f not in PD_FAULTS]
        if bad:
            raise ValueError(f"--faults: unknown transfer fault {bad[0]!r}; choose from all, "
                             "none, " + ", ".join(PD_FAULTS))  # fmt: skip
        for name, value in (("--requests", self.requests), ("--seeds", self.seeds)):
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}; pass {name} 1 or more")


def pd_prompts(seed: int, count: int, block_size: int, max_len: int) -> list[tuple[int, ...]]:
    """`count` random prompts that ExampleConnector transfers whole: length L with
    `block_size + 2 <= L <= max_len` and `(L - 1) % block_size != 0` (its save and match
    lengths then agree; see the research note on ExampleConnector)."""
    rng = random.Random(seed)
    lengths = [n for n in range(block_size + 2, max_len + 1) if (n - 1) % block_size]
    if not lengths:
        raise ValueError(f"no prompt length fits block_size={block_size} and max_len={max_len}; "
                         "pass --max-num-batched-tokens of at least --block-size + 2")  # fmt: skip
    return [tuple(rng.randrange(1, 500) for _ in range(rng.choice(lengths))) for _ in range(count)]


def _servers(settings: VllmSettings, spec: PDSpec, work: Path,
             schedule: list[str]) -> tuple[VllmServer, VllmServer]:  # fmt: skip
    storage = work / "kv"
    storage.mkdir(parents=True, exist_ok=True)
    env = {"KVCANARY_MODE": spec.mode, "KVCANARY_RING_CAPACITY": "1000000"}
    # recover: the user asks vLLM to recompute a failed load (its default fails the request)
    policy = {"kv_load_failure_policy": "recompute"} if spec.mode == "recover" else {}
    user = {"kv_connector": "ExampleConnector", "kv_role": "kv_both", **policy,
            "kv_connector_extra_config": {"shared_storage_path": str(storage)}}  # fmt: skip
    faulty = {"kv_connector": "PDFaultConnector",
              "kv_connector_module_path": "kvcanary.app.vllm.pd_faults", "kv_role": "kv_both",
              **policy, "kv_connector_extra_config": {"shared_storage_path": str(storage),
                                                      "fault_schedule": schedule}}  # fmt: skip
    if "partial_save" in schedule:  # the storing engine's own connector stops its save
        user = {**faulty, "kv_connector_extra_config": {
            "shared_storage_path": str(storage), "save_fault_schedule": schedule}}  # fmt: skip
    return (VllmServer(settings, env=env, transfer_config=user, log_path=work / "prefill.log"),
            VllmServer(settings, env=env, transfer_config=faulty, log_path=work / "decode.log"))  # fmt: skip


def run_pd_campaign(settings: VllmSettings, spec: PDSpec, work: Path,
                    tick: Callable[[], None] = lambda: None) -> dict[str, Any]:  # fmt: skip
    """Run the campaign (see the module docstring); its figures and per-case rows. `tick` is
    called once per request (clean or fault case)."""
    cases = [(seed, f) for seed in range(spec.first_seed, spec.first_seed + spec.seeds)
             for f in spec.faults]  # fmt: skip
    schedule = ["none"] * spec.requests + [f for _, f in cases]
    clean = pd_prompts(spec.first_seed, spec.requests, settings.block_size,
                       settings.max_num_batched_tokens)  # fmt: skip
    faulty = [pd_prompts(10_000 + seed * 97 + i, 1, settings.block_size,
                         settings.max_num_batched_tokens)[0]
              for i, (seed, _) in enumerate(cases)]  # fmt: skip
    prefill, decode = _servers(settings, spec, work, schedule)
    try:
        start_all([prefill, decode])
        identical = failed = 0
        for prompt in clean:
            drive(prefill, [VllmRequest(prompt, 1)])
            [ref] = drive(prefill, [VllmRequest(prompt, spec.max_tokens)])
            [got] = drive(decode, [VllmRequest(prompt, spec.max_tokens)])
            failed += (ref.status != 200) + (got.status != 200)
            identical += got.status == 200 and got.output_ids == ref.output_ids
            tick()
        clean_violations = int(kvcanary_series(scrape(decode))["kvcanary_violations_total"])
        fault_outputs: list[bool] = []
        for prompt in faulty:
            drive(prefill, [VllmRequest(prompt, 1)])
            [got] = drive(decode, [VllmRequest(prompt, spec.max_tokens)])
            failed += got.status != 200
            if spec.mode == "recover":  # the damaged request recomputed: the right tokens
                [ref] = drive(prefill, [VllmRequest(prompt, spec.max_tokens)])
                fault_outputs.append(got.status == 200 and got.output_ids == ref.output_ids)
            tick()
        served = decode.alive() and prefill.alive()
        total = int(kvcanary_series(scrape(decode))["kvcanary_violations_total"]) if served else -1
    finally:
        prefill.close()
        decode.close()
    log = (work / "decode.log").read_text(errors="replace")
    journal, landed = _JOURNAL.findall(log), LANDED.findall(log)
    rows = []
    for i, (seed, fault) in enumerate(cases):
        k = spec.requests + i
        ok = k < len(journal) and k < len(landed) and journal[k][1] == fault
        found = int(landed[k][2]) if ok else 0
        row = {"seed": seed, "fault": fault, "landing_violations": found,
               "caught": ok and found > 0}  # fmt: skip
        if fault_outputs:
            row["output_identical"] = fault_outputs[i]
        rows.append(row)
    clean_landed = landed[: spec.requests]
    return {
        "engine": "vllm-openai-server x2 (prefill, decode), ExampleConnector",
        "dtype": decode.chosen_dtype() or settings.dtype,
        "clean_requests": spec.requests, "outputs_identical": identical,
        "clean_landings_verified": sum(1 for _, s, _ in clean_landed if s == "imported"),
        "clean_landing_violations": sum(int(v) for _, _, v in clean_landed),
        "clean_violations": clean_violations, "requests_failed": failed,
        "fault_cases": len(cases), "faults_caught": sum(r["caught"] for r in rows),
        "violations_total": total, "still_serving": served, "rows": rows,
        "decode_log": str(work / "decode.log"),
    }  # fmt: skip
