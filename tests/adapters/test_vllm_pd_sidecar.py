"""Prefill -> decode between two real vLLM OpenAI servers over vLLM's ExampleConnector (shared
storage), each with the canary (`KVCANARY_MODE=log`, the plugin composes it after the user's
connector): the prefill engine writes each saved request's records beside its KV, the decode
engine imports them at its own landing slots and verifies them before HEAD. Clean: every landing
verified, 0 violations, decode output identical to the prefill engine's own greedy output. Faults
(SPEC §14.4): a sidecar removed (KV landed without records) and two sidecars swapped (another
request's records) are each reported on the decode engine, for that landing only; and the
fault connector (`kvcanary.app.vllm.pd_faults`, loaded by vLLM through `kv_connector_module_path`)
breaks landings (wrong slots, a block never written, corrupted bytes, one flipped bit, a late
duplicate of the previous landing, a landing that stops after layer 0, a save that stops after
layer 0), each caught 1:1; in mode
`recover` each bad landing is recomputed for its request only."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvcanary.adapters.vllm.pd_sidecar import SIDECAR_FILE
from kvcanary.app.vllm.engine import VllmSettings
from kvcanary.app.vllm.model import ensure_tiny_llama
from kvcanary.app.vllm.pd_campaign import FAULTS
from kvcanary.app.vllm.server import VllmServer, drive, kvcanary_series, scrape, start_all
from kvcanary.app.vllm.workload import VllmRequest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BLOCK = 32
LANDED = re.compile(
    r"kv-canary: landed KV of (\d+) slots verified \(sidecar (\w+)\): (\d+) violations"
)


def _prompts(seed: int, count: int, length: int) -> list[tuple[int, ...]]:
    # (L - 1) % BLOCK != 0, so ExampleConnector's match and save lengths agree; L below the
    # prefill engine's token budget, so the prompt is saved whole in its first step
    assert (length - 1) % BLOCK and BLOCK + 2 <= length <= 128
    rng = random.Random(seed)
    return [tuple(rng.randrange(1, 500) for _ in range(length)) for _ in range(count)]


def _folders(storage: Path) -> set[Path]:
    return {p.parent for p in storage.glob(f"*/{SIDECAR_FILE}")}


def test_pd_pair_lands_verified_kv_and_reports_bad_sidecars(tmp_path: Path) -> None:
    storage = tmp_path / "kv"
    storage.mkdir()
    user = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(storage)}}  # fmt: skip
    settings = VllmSettings(model=ensure_tiny_llama(), dtype="auto", kv_blocks=64,
                            block_size=BLOCK)  # fmt: skip
    prefill, decode = (VllmServer(settings, env={"KVCANARY_MODE": "log"}, transfer_config=user,
                                  log_path=tmp_path / f"{name}.log")
                       for name in ("prefill", "decode"))  # fmt: skip
    try:
        start_all([prefill, decode])
        clean = _prompts(seed=1, count=4, length=100)
        faulty = _prompts(seed=2, count=3, length=70)
        folder = {}
        for prompt in clean + faulty:  # prefill: one token, the KV and its records saved
            before = _folders(storage)
            [r] = drive(prefill, [VllmRequest(prompt, 1)])
            assert r.status == 200, r.error
            [folder[prompt]] = _folders(storage) - before
        # the reference: the prefill engine's own greedy output
        reference = [drive(prefill, [VllmRequest(p, 8)])[0].output_ids for p in clean]
        got = [drive(decode, [VllmRequest(p, 8)])[0].output_ids for p in clean]
        assert got == reference and all(len(o) == 8 for o in got)
        clean_log = decode.log_path.read_text(errors="replace")  # type: ignore[union-attr]
        landed = LANDED.findall(clean_log)
        assert len(landed) == len(clean) and all(v == "0" and s == "imported"
                                                 for _, s, v in landed), landed  # fmt: skip
        assert kvcanary_series(scrape(decode))["kvcanary_violations_total"] == 0
        # faults: the decode engine lands the KV of `faulty` with bad records
        sidecars = [folder[p] for p in faulty]
        (sidecars[0] / SIDECAR_FILE).unlink()  # landed without records
        a, b = sidecars[1] / SIDECAR_FILE, sidecars[2] / SIDECAR_FILE
        tmp = tmp_path / "swap"
        shutil.copyfile(a, tmp)
        shutil.copyfile(b, a)
        shutil.copyfile(tmp, b)  # each carries the other request's records
        results = drive(decode, [VllmRequest(p, 4) for p in faulty], concurrency=1)
        assert [r.status for r in results] == [200] * 3  # log mode keeps serving
        assert decode.alive()
        after = kvcanary_series(scrape(decode))
    finally:
        prefill.close()
        decode.close()
    log = decode.log_path.read_text(errors="replace")[len(clean_log) :]  # type: ignore[union-attr]
    landed = LANDED.findall(log)
    assert [s for _, s, _ in landed] == ["missing", "imported", "imported"], landed
    assert all(int(v) > 0 for _, _, v in landed), landed  # every bad landing reported
    # log mode leaves the bad records in place, so HEAD / TAIL of the forwards that read them
    # report them again: the landing's own rows are a part of the total
    assert after["kvcanary_violations_total"] >= sum(int(v) for _, _, v in landed)


FAULT_LINE = re.compile(r"kvcanary-pd-fault: load=(\d+) fault=(\w+) slots=(\d+)")


def test_fault_connector_landings_are_caught_one_to_one(tmp_path: Path) -> None:
    storage = tmp_path / "kv"
    storage.mkdir()
    settings = VllmSettings(model=ensure_tiny_llama(), dtype="auto", kv_blocks=64,
                            block_size=BLOCK)  # fmt: skip
    faulty = {"kv_connector": "PDFaultConnector",
              "kv_connector_module_path": "kvcanary.app.vllm.pd_faults", "kv_role": "kv_both",
              "kv_connector_extra_config": {"shared_storage_path": str(storage),
                                            "fault_schedule": list(FAULTS)}}  # fmt: skip
    # the prefill engine's own connector stops the saves scheduled `partial_save` (store i is
    # prompt i: every prompt is saved once, in order)
    storing = {**faulty, "kv_connector_extra_config": {"shared_storage_path": str(storage),
                                                       "save_fault_schedule": list(FAULTS)}}  # fmt: skip
    prefill = VllmServer(settings, env={"KVCANARY_MODE": "log"}, transfer_config=storing,
                         log_path=tmp_path / "prefill.log")  # fmt: skip
    decode = VllmServer(settings, env={"KVCANARY_MODE": "log"}, transfer_config=faulty,
                        log_path=tmp_path / "decode.log")  # fmt: skip
    prompts = _prompts(seed=3, count=2 * len(FAULTS), length=100)
    try:
        start_all([prefill, decode])
        for prompt in prompts:
            assert drive(prefill, [VllmRequest(prompt, 1)])[0].status == 200
        # one landing at a time, so load i of the schedule is request i
        results = drive(decode, [VllmRequest(p, 4) for p in prompts], concurrency=1)
        assert [r.status for r in results] == [200] * len(prompts)
        assert decode.alive()
    finally:
        prefill.close()
        decode.close()
    log = decode.log_path.read_text(errors="replace")  # type: ignore[union-attr]
    journal = FAULT_LINE.findall(log)
    landed = LANDED.findall(log)
    assert [f for _, f, _ in journal] == [FAULTS[i % len(FAULTS)] for i in range(len(prompts))]
    assert len(landed) == len(journal), (journal, landed)
    # a save that stopped part-way has no sidecar (it is the save's last entry)
    assert [s for _, s, _ in landed] == [
        "missing" if f == "partial_save" else "imported" for _, f, _ in journal
    ], landed
    for (_, fault, _), (_, _, violations) in zip(journal, landed, strict=True):
        # 1:1: a clean landing reports nothing, every faulty one is reported at its landing
        assert (int(violations) > 0) == (fault != "none"), (fault, violations)


def test_the_disaggregate_command_runs_clean_and_catches_every_fault(tmp_path: Path) -> None:
    # CI size; the closing note's measurement runs --requests 100 --seeds 10
    out = tmp_path / "pd.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCANARY_")}
    result = subprocess.run(
        [sys.executable, "-m", "kvcanary.cli", "vllm", "--disaggregate", "--requests", "3",
         "--faults", "all", "--seeds", "1", "--json", str(out)],
        capture_output=True, text=True, env=env, timeout=1200,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["outputs_identical"] == doc["clean_landings_verified"] == 3
    assert doc["clean_violations"] == 0 and doc["requests_failed"] == 0
    assert [r["fault"] for r in doc["rows"]] == list(FAULTS[1:])
    assert doc["faults_caught"] == doc["fault_cases"] == len(FAULTS) - 1 and doc["still_serving"]
    assert "transfer faults (caught at the landing / cases)" in result.stdout


def test_recover_mode_recomputes_only_the_request_whose_landing_was_bad(tmp_path: Path) -> None:
    # SPEC §14.4 / §14.3: each bad landing becomes a vLLM load error for that request, which
    # recomputes it (the user's kv_load_failure_policy=recompute, kept by the plugin): every
    # fault case ends with the prefill engine's own greedy tokens, the clean requests untouched
    out = tmp_path / "pd.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCANARY_")}
    result = subprocess.run(
        [sys.executable, "-m", "kvcanary.cli", "vllm", "--disaggregate", "--kv-canary",
         "recover", "--requests", "2", "--faults", "all", "--seeds", "1", "--json", str(out)],
        capture_output=True, text=True, env=env, timeout=1200,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["outputs_identical"] == 2 and doc["clean_violations"] == 0
    assert doc["requests_failed"] == 0 and doc["still_serving"]
    assert [(r["fault"], r["caught"], r["output_identical"]) for r in doc["rows"]] == [
        (f, True, True) for f in FAULTS[1:]
    ]
    assert "transfer faults (caught at the landing / cases)" in result.stdout
