"""`kvcanary vllm --offload`: vLLM's host offload tier on the CPU platform (the canary's
`CanaryCPUOffloadingSpec` under the user's `OffloadingConnector`), one OpenAI server on
127.0.0.1 with the canary composed by the plugin's `KVCANARY_MODE` shortcut.

The server gets few device blocks, so a prompt's blocks leave the device while three other
prompts run and a repeat of the prompt restores them from the host tier. A round is: the prompt
(greedy, `max_tokens` tokens), three others, the prompt again. Clean rounds: the repeat's tokens
must equal the first's and every restore must carry its stamps and verify clean. Fault rounds:
the spec is `OffloadFaultSpec` with a schedule that is `none` for the clean rounds, then each
host-tier fault per seed; each restore line of the canary is correlated 1:1 with the fault
journal line of the same load. In mode `recover` (the user's `kv_load_failure_policy=recompute`)
a fault round's repeat must also get the first's tokens: the bad restore is a vLLM load error
and the request recomputes instead of reading it.
"""

from __future__ import annotations

import dataclasses
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcanary.app.vllm.engine import VllmSettings
from kvcanary.app.vllm.server import HttpResult, VllmServer, drive, kvcanary_series, scrape
from kvcanary.app.vllm.workload import VllmRequest

__all__ = ["OFFLOAD_FAULTS", "OffloadSpec", "offload_round", "run_offload_campaign"]

#: the canary's line per restore (adapters/vllm/offload.py) and the fault journal's
RESTORED = re.compile(r"kv-canary: offload load of (\d+) blocks \(stamps (\d+)\): (\d+) viol")
_JOURNAL = re.compile(r"kvcanary-offload-fault: load=(\d+) fault=(\w+) blocks=(\d+)")
#: the restores `offload_faults.OffloadFaultSpec` can make (kept here: that module imports vLLM)
OFFLOAD_FAULTS = ("none", "wrong_page", "bit_flip", "lost_store")
#: prompt length: six full blocks of 32 go to the host tier, the device holds 20 blocks
PROMPT_TOKENS = 200
DEVICE_BLOCKS = 20


@dataclass(frozen=True)
class OffloadSpec:
    """What the campaign runs: `rounds` clean rounds, then `faults` x `seeds` fault rounds."""

    rounds: int = 20
    faults: tuple[str, ...] = ()
    seeds: int = 10
    first_seed: int = 0
    max_tokens: int = 8
    mode: str = "log"

    def __post_init__(self) -> None:
        bad = [f for f in self.faults if f not in OFFLOAD_FAULTS[1:]]
        if bad:
            raise ValueError(f"--faults: unknown host-tier fault {bad[0]!r}; choose from all, "
                             "none, " + ", ".join(OFFLOAD_FAULTS[1:]))  # fmt: skip
        for name, value in (("--requests", self.rounds), ("--seeds", self.seeds)):
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}; pass {name} 1 or more")


def offload_server(settings: VllmSettings, work: Path, schedule: list[str] | None = None,
                   mode: str = "log") -> VllmServer:  # fmt: skip
    """One OpenAI server with the host tier (`schedule`: the fault spec's, None: the clean
    spec) and few device blocks."""
    if schedule is None:
        spec = {"spec_name": "CanaryCPUOffloadingSpec",
                "spec_module_path": "kvcanary.adapters.vllm.offload"}  # fmt: skip
    else:
        spec = {"spec_name": "OffloadFaultSpec",
                "spec_module_path": "kvcanary.app.vllm.offload_faults", "fault_schedule": schedule}  # fmt: skip
    # recover: the user asks vLLM to recompute a failed load (its default fails the request)
    policy = {"kv_load_failure_policy": "recompute"} if mode == "recover" else {}
    user = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", **policy,
            "kv_connector_extra_config": {**spec, "cpu_bytes_to_use": 64 << 20}}  # fmt: skip
    sized = dataclasses.replace(settings, kv_blocks=DEVICE_BLOCKS,
                                max_num_batched_tokens=max(settings.max_num_batched_tokens, 256))  # fmt: skip
    return VllmServer(sized, env={"KVCANARY_MODE": mode, "KVCANARY_RING_CAPACITY": "1000000"},
                      transfer_config=user, log_path=work / "server.log")  # fmt: skip


def offload_round(server: VllmServer, seed: int, max_tokens: int) -> tuple[HttpResult, HttpResult]:
    """A prompt, three prompts that evict its blocks, the prompt again (restored from the host
    tier): the first and the repeated results."""
    rng = random.Random(seed)
    prompt, *others = (tuple(rng.randrange(1, 500) for _ in range(PROMPT_TOKENS))
                       for _ in range(4))  # fmt: skip
    [first] = drive(server, [VllmRequest(prompt, max_tokens)])
    drive(server, [VllmRequest(p, 1) for p in others], concurrency=1)
    [again] = drive(server, [VllmRequest(prompt, max_tokens)])
    return first, again


def run_offload_campaign(settings: VllmSettings, spec: OffloadSpec, work: Path,
                         tick: Callable[[], None] = lambda: None) -> dict[str, Any]:  # fmt: skip
    """Run the campaign (see the module docstring); its figures and per-case rows."""
    cases = [(seed, f) for seed in range(spec.first_seed, spec.first_seed + spec.seeds)
             for f in spec.faults]  # fmt: skip
    schedule = ["none"] * spec.rounds + [f for _, f in cases]
    server = offload_server(settings, work, schedule if cases else None, spec.mode)
    fault_outputs: list[bool] = []
    identical = failed = 0
    try:
        server.start()
        for i in range(spec.rounds):
            first, again = offload_round(server, spec.first_seed * 1000 + i, spec.max_tokens)
            failed += (first.status != 200) + (again.status != 200)
            identical += again.status == 200 and again.output_ids == first.output_ids
            tick()
        clean_violations = int(kvcanary_series(scrape(server))["kvcanary_violations_total"])
        for i, (seed, _) in enumerate(cases):
            first, again = offload_round(server, 100_000 + seed * 97 + i, spec.max_tokens)
            failed += (first.status != 200) + (again.status != 200)
            # recover: the bad restore recomputed, so the repeat gets the first's tokens
            fault_outputs.append(again.status == 200 and again.output_ids == first.output_ids)
            tick()
        served = server.alive()
    finally:
        server.close()
    log = (work / "server.log").read_text(errors="replace")
    restores = RESTORED.findall(log)
    journal = _JOURNAL.findall(log) if cases else [("", "none", "")] * len(restores)
    clean = [r for (_, f, _), r in zip(journal, restores, strict=False) if f == "none"]
    rows: list[dict[str, Any]] = []
    for (_, fault, _), (_, _, found) in zip(journal, restores, strict=False):
        if fault != "none":
            rows.append({"fault": fault, "restore_violations": int(found),
                         "caught": int(found) > 0})  # fmt: skip
    if spec.mode == "recover":
        for row, same in zip(rows, fault_outputs, strict=False):
            row["output_identical"] = same
    return {
        "engine": "vllm-openai-server, OffloadingConnector + CanaryCPUOffloadingSpec",
        "dtype": server.chosen_dtype() or settings.dtype,
        "clean_rounds": spec.rounds, "repeats_identical": identical,
        "clean_restores": len(clean),
        "clean_restores_stamped": sum(1 for n, s, _ in clean if n == s),
        "clean_restore_violations": sum(int(v) for _, _, v in clean),
        "clean_violations": clean_violations, "requests_failed": failed,
        "fault_cases": len(cases), "fault_restores": len(rows),
        "faults_caught": sum(r["caught"] for r in rows), "still_serving": served,
        "rows": rows, "log": str(work / "server.log"),
    }  # fmt: skip
