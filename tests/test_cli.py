"""CLI: every bad input is exactly one line naming the knob, the value and the fix, exit 2, no
traceback, no file left behind; exit codes; help; check-config and small runs end to end."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvcanary.cli import main

SMALL = ["--quiet", "--model", "oracle", "--requests", "6", "--num-slots", "256"]
FAULT = {"KVCANARY_PERTURB_LATE_WRITE_PROB": "1", "KVCANARY_PERTURB_TARGET_GROUP": "full"}

# (args, env, knob, value): the line must name the knob and the value, then "; <fix>".
# Paths are relative to the test's empty working folder; "FILE" is an existing plain file there.
BAD: list[tuple[list[str], dict[str, str], str, str]] = [
    # parse errors echo the value typed
    (["run", "--requests", "1e20"], {}, "--requests", "'1e20'"),
    (["run", "--requests", "12abc"], {}, "--requests", "'12abc'"),
    (["run", "--seed", "2**70"], {}, "--seed", "'2**70'"),
    (["run", "--num-slots", "many"], {}, "--num-slots", "'many'"),
    (["run", "--metrics-port", "http"], {}, "--metrics-port", "'http'"),
    (["run", "--seed"], {}, "--seed", "needs a value"),
    (["run", "--bogus"], {}, "--bogus", "No such option"),
    (["selftest", "--seeds", "x"], {}, "--seeds", "'x'"),
    (["check-config", "--num-slots", "1.5"], {}, "--num-slots", "'1.5'"),
    # sizes of run: out of range, huge, too small for one request, contradictory
    (["run", "--requests", "0"], {}, "--requests", "got 0"),
    (["run", "--requests", "-3"], {}, "--requests", "got -3"),
    (["run", "--requests", str(10**20)], {}, "--requests", str(10**20)),
    (["run", "--seed", "-1"], {}, "--seed", "got -1"),
    (["run", "--seed", str(2**70)], {}, "--seed", str(2**70)),
    (["run", "--num-slots", "1"], {}, "--num-slots", "got 1"),
    (["run", "--num-slots", str(10**12)], {}, "--num-slots", str(10**12)),
    (["run", "--num-slots", "100"], {}, "--num-slots", "100"),
    (["run", "--max-context-len", "100"], {}, "--max-context-len", "100"),
    (["run", "--max-context-len", "0"], {}, "--max-context-len", "got 0"),
    (["run", "--max-context-len", str(2**40)], {}, "--max-context-len", str(2**40)),
    (["run", "--max-running-requests", "0"], {}, "--max-running-requests", "got 0"),
    (["run", "--max-running-requests", "4096", "--max-context-len", "65536"], {},
     "--max-running-requests", "4096"),
    (["run", "--max-batch-size", "0"], {}, "--max-batch-size", "got 0"),
    (["run", "--max-batch-size", "99999"], {}, "--max-batch-size", "99999"),
    (["run", "--chunked-prefill-size", "0"], {}, "--chunked-prefill-size", "got 0"),
    (["run", "--chunked-prefill-size", "-2"], {}, "--chunked-prefill-size", "got -2"),
    (["run", "--max-prefill-tokens", "0"], {}, "--max-prefill-tokens", "got 0"),
    (["run", "--max-prefill-tokens", "2", "--speculative-num-draft-tokens", "4"], {},
     "--max-prefill-tokens", "got 2"),
    (["run", "--speculative-num-draft-tokens", "-1"], {}, "--speculative-num-draft-tokens", "got -1"),
    (["run", "--speculative-num-draft-tokens", "1000"], {}, "--speculative-num-draft-tokens", "1000"),
    (["run", "--model", "big"], {}, "--model", "'big'"),
    (["run", "--dtype", "float16"], {}, "--dtype", "'float16'"),
    (["run", "--plant", "nope"], {}, "--plant", "'nope'"),
    (["run", "--plant", "retract_stale_row", "--plant", "retract_stale_row"], {}, "--plant",
     "retract_stale_row"),
    (["run", "--plant", "retract_stale_row", "--kv-canary", "none"], {}, "--plant", "none"),
    # canary flags
    (["run", "--kv-canary", "maybe"], {}, "--kv-canary", "'maybe'"),
    (["run", "--kv-canary-real-data", "some"], {}, "--kv-canary-real-data", "'some'"),
    (["run", "--kv-canary-sweep-interval", "-2"], {}, "--kv-canary-sweep-interval", "got -2"),
    (["run", "--kv-canary-sweep-interval", str(10**9)], {}, "--kv-canary-sweep-interval", "1000000000"),
    (["run", "--kv-canary", "none", "--kv-canary-sweep-interval", "3"], {},
     "--kv-canary-sweep-interval", "3"),
    (["run", "--kv-canary", "none", "--kv-canary-real-data", "all"], {}, "--kv-canary-real-data", "all"),
    (["check-config", "--kv-canary", "maybe"], {}, "--kv-canary", "'maybe'"),
    (["check-config", "--kv-canary-real-data", "some"], {}, "--kv-canary-real-data", "'some'"),
    (["check-config", "--kv-canary-sweep-interval", "3"], {}, "--kv-canary-sweep-interval", "3"),
    # check-config sizes: the flag as typed, run's name or the SPEC §6 one
    (["check-config", "--num-slots", "-5"], {}, "--num-slots", "got -5"),
    (["check-config", "--pool-slot-count", "-5"], {}, "--pool-slot-count", "got -5"),
    (["check-config", "--max-context-len", "0"], {}, "--max-context-len", "got 0"),
    (["check-config", "--max-seq-len-per-req", "0"], {}, "--max-seq-len-per-req", "got 0"),
    (["check-config", "--req-to-token-pool-size", "0"], {}, "--req-to-token-pool-size", "got 0"),
    (["check-config", "--cuda-graph-max-bs", "-1"], {}, "--cuda-graph-max-bs", "got -1"),
    (["check-config", "--speculative-num-draft-tokens", "-1"], {}, "--speculative-num-draft-tokens", "got -1"),
    (["check-config", "--max-prefill-tokens", "0"], {}, "--max-prefill-tokens", "got 0"),
    (["check-config", "--pool-slot-count", str(2**40)], {}, "--pool-slot-count", str(2**40)),
    # KVCANARY_* variables, on every command that reads them
    (["check-config"], {"KVCANARY_RING_CAPACITY": "0"}, "KVCANARY_RING_CAPACITY", "got 0"),
    (["run"], {"KVCANARY_RING_CAPACITY": "lots"}, "KVCANARY_RING_CAPACITY", "'lots'"),
    (["check-config"], {"KVCANARY_ENABLE_V": "maybe"}, "KVCANARY_ENABLE_V", "'maybe'"),
    (["selftest"], {"KVCANARY_ENABLE_V": "maybe"}, "KVCANARY_ENABLE_V", "'maybe'"),
    (["selftest"], {"KVCANARY_RING_CAPACITY": "-1"}, "KVCANARY_RING_CAPACITY", "-1"),
    (["run"], {"KVCANARY_PERTURB_SEED": "x"}, "KVCANARY_PERTURB_SEED", "'x'"),
    (["run"], {"KVCANARY_PERTURB_SEED": str(2**70)}, "KVCANARY_PERTURB_SEED", str(2**70)),
    (["run"], {"KVCANARY_PERTURB_WARMUP_STEPS": "-1"}, "KVCANARY_PERTURB_WARMUP_STEPS", "-1"),
    (["run"], {"KVCANARY_VERIFY_STRIDE": "0"}, "KVCANARY_VERIFY_STRIDE", "got 0"),
    (["check-config"], {"KVCANARY_VERIFY_STRIDE": "65"}, "KVCANARY_VERIFY_STRIDE", "[1, 64]"),
    (["run"], {"KVCANARY_PERTURB_LATE_WRITE_PROB": "2"}, "KVCANARY_PERTURB_LATE_WRITE_PROB", "'2'"),
    (["run"], {"KVCANARY_PERTURB_LATE_WRITE_PROB": "nan"}, "KVCANARY_PERTURB_LATE_WRITE_PROB", "'nan'"),
    (["run"], {"KVCANARY_PERTURB_LATE_WRITE_PROB": "1"}, "KVCANARY_PERTURB_TARGET_GROUP", "explicitly set"),
    (["run"], {"KVCANARY_PERTURB_LATE_WRITE_PROB": "1", "KVCANARY_PERTURB_TARGET_GROUP": "any"},
     "KVCANARY_PERTURB_TARGET_GROUP", "'any'"),
    (["run"], {**FAULT, "KVCANARY_PERTURB_TARGET_GROUP": "swa"}, "KVCANARY_PERTURB_TARGET_GROUP", "swa"),
    (["run"], {"KVCANARY_PERTURB_SWA_LUT_TAMPER_PROB": "1", "KVCANARY_PERTURB_TARGET_GROUP": "swa"},
     "KVCANARY_PERTURB_TARGET_GROUP", "swa"),
    (["run", "--kv-canary-real-data", "none"], {"KVCANARY_PERTURB_REAL_KV_USED_PROB": "1",
     "KVCANARY_PERTURB_TARGET_GROUP": "full"}, "--kv-canary-real-data", "real-KV"),
    (["run", "--kv-canary", "none"], FAULT, "KVCANARY_PERTURB_LATE_WRITE_PROB", "none"),
    (["run", "--model", "oracle"], {"KVCANARY_PERTURB_NEXT_TOKEN_SWAP_PROB": "1"},
     "KVCANARY_ENABLE_WRITE_INPUT_ASSERT", "NEXT_TOKEN_SWAP_PROB"),
    (["run"], {"KVCANARY_ENABLE_WRITE_INPUT_ASSERT": "1"}, "--model oracle", "tiny"),
    (["run"], {"KVCANARY_ENABLE_TOKEN_ORACLE": "1"}, "--model oracle", "tiny"),
    (["selftest"], FAULT, "KVCANARY_PERTURB_LATE_WRITE_PROB", "is set"),
    (["selftest"], {"KVCANARY_VERIFY_STRIDE": "4"}, "KVCANARY_VERIFY_STRIDE=4", "deadlines"),
    # output paths: checked before the run, nothing created
    (["run", "--json", "missing/out.json"], {}, "--json", "missing/out.json"),
    (["run", "--json", "FILE/out.json"], {}, "--json", "FILE/out.json"),
    (["run", "--json", "."], {}, "--json", "."),
    (["run", "--json", "/proc/out.json"], {}, "--json", "/proc/out.json"),
    (["run", "--events", "missing/ev.jsonl"], {}, "--events", "missing/ev.jsonl"),
    (["run", "--events", "/sys/ev.jsonl"], {}, "--events", "/sys/ev.jsonl"),
    (["run", "--json", "same.json", "--events", "same.json"], {}, "--events", "same.json"),
    (["run", "--json", "x.json", "--events", "./x.json"], {}, "--events", "x.json"),
    (["selftest", "--json", "missing/out.json"], {}, "--json", "missing/out.json"),
    (["selftest", "--html", "missing/out.html"], {}, "--html", "missing/out.html"),
    (["selftest", "--html", "/proc/out.html"], {}, "--html", "/proc/out.html"),
    (["selftest", "--json", "r", "--html", "r"], {}, "--html", "r"),
    # ports: range checked before anything, a busy port found before any file is written
    (["run", "--metrics-port", "-1"], {}, "--metrics-port", "got -1"),
    (["run", "--metrics-port", "70000"], {}, "--metrics-port", "got 70000"),
    (["run", "--metrics-port", "BUSY", "--events", "ev.jsonl"], {}, "--metrics-port", "in use"),
    # selftest's own knobs
    (["selftest", "--modes", "bogus"], {}, "--modes", "'bogus'"),
    (["selftest", "--plants", "bogus"], {}, "--plants", "'bogus'"),
    (["selftest", "--seeds", "0"], {}, "--seeds", "got 0"),
    (["selftest", "--seeds", str(10**9)], {}, "--seeds", "1000000000"),
    (["selftest", "--first-seed", "-1"], {}, "--first-seed", "got -1"),
    (["selftest", "--modes", "none", "--plants", "none"], {}, "--plants none", "nothing to test"),
    # selftest applies KVCANARY_* as run does, so it checks them as run does
    (["selftest", "--kv-canary", "recover"], {"KVCANARY_ENABLE_V": "maybe"}, "KVCANARY_ENABLE_V", "'maybe'"),
    (["selftest"], {"KVCANARY_STATS_PRINT_EVERY_N_STEPS": "-5"}, "KVCANARY_STATS_PRINT_EVERY_N_STEPS", "-5"),
    (["selftest"], {"KVCANARY_RING_CAPACITY": str(2**70)}, "KVCANARY_RING_CAPACITY", str(2**70)),
    (["run"], {"KVCANARY_RING_CAPACITY": str(10**12)}, "KVCANARY_RING_CAPACITY", str(10**12)),
    (["selftest", "--model", "tiny"], {"KVCANARY_ENABLE_WRITE_INPUT_ASSERT": "1"}, "--model oracle", "tiny"),
    (["selftest", "--model", "tiny"], {"KVCANARY_ENABLE_TOKEN_ORACLE": "1"}, "--model oracle", "tiny"),
    (["selftest", "--transfers"], {"KVCANARY_RING_CAPACITY": "64"}, "KVCANARY_RING_CAPACITY=64", "--transfers"),
    (["selftest", "--transfers"], {"KVCANARY_RING_CAPACITY": "x"}, "KVCANARY_RING_CAPACITY", "'x'"),
    (["selftest", "--transfers"], FAULT, "KVCANARY_PERTURB_LATE_WRITE_PROB", "is set"),
    # a plant the run could never trigger is refused, not a silent clean run (exit 0)
    (["run", "--plant", "spec_rollback_stale", "--speculative-num-draft-tokens", "0"], {},
     "--speculative-num-draft-tokens", "is 0"),
    (["run", "--plant", "spec_rollback_stale", "--model", "oracle"], {}, "--model", "oracle"),
    # selftest --transfers: the same seed checks, its own names, no silently ignored flag
    (["selftest", "--transfers", "--seeds", "0"], {}, "--seeds", "got 0"),
    (["selftest", "--transfers", "--first-seed", "-1"], {}, "--first-seed", "got -1"),
    (["selftest", "--transfers", "--modes", "bogus"], {}, "--modes", "'bogus'"),
    (["selftest", "--transfers", "--places", "moon"], {}, "--places", "'moon'"),
    (["selftest", "--transfers", "--places", "none"], {}, "--places", "'none'"),
    (["selftest", "--transfers", "--html", "r.html"], {}, "--html", "r.html"),
    (["selftest", "--transfers", "--plants", "all"], {}, "--plants", "all"),
    (["selftest", "--transfers", "--kv-canary", "raise"], {}, "--kv-canary", "raise"),
    (["selftest", "--transfers", "--model", "tiny"], {}, "--model", "tiny"),
    (["selftest", "--transfers", "--json", "missing/t.json"], {}, "--json", "missing/t.json"),
]  # fmt: skip
SUBPROCESS = {0, 14, 58, 75, 84}  # a few through a real `python -m kvcanary.cli` process


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("0.0.0.0", 0))
        sock.listen()
        yield sock.getsockname()[1]


def _clean_env(extra: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("KVCANARY_")} | extra


def kvcanary(
    args: list[str], env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """The real command, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "kvcanary.cli", *args], capture_output=True,
                          text=True, env=_clean_env(env or {}), cwd=cwd, timeout=600)  # fmt: skip


def in_process(args: list[str], env: dict[str, str]) -> tuple[int, str, str]:
    """`kvcanary ARGS` in this process (fast), with `env` as the only `KVCANARY_*` variables."""
    overrides: dict[str, str | None] = {k: None for k in os.environ if k.startswith("KVCANARY_")}
    runner = CliRunner()
    with runner.isolation(env={**overrides, **env}) as (out, err, _):
        code = main(args)
        return code, out.getvalue().decode(), err.getvalue().decode()


@pytest.mark.parametrize(("index", "case"), list(enumerate(BAD)), ids=lambda x: str(x)[:60])
def test_bad_input_is_one_line_exit_2_no_file(
    index: int, case: tuple[list[str], dict[str, str], str, str], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, busy_port: int,
) -> None:  # fmt: skip
    args, env, knob, value = case
    args = [str(busy_port) if a == "BUSY" else a for a in args]
    (tmp_path / "FILE").write_text("x")
    monkeypatch.chdir(tmp_path)
    if index in SUBPROCESS:
        done = kvcanary(args, env, cwd=tmp_path)
        code, out, err = done.returncode, done.stdout, done.stderr
    else:
        code, out, err = in_process(args, env)
    assert code == 2, err
    assert out == "" and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    line = lines[0]
    assert line.startswith(f"kvcanary {args[0]}: "), line
    assert knob in line and value in line, line
    fix = line.split("; ", 1)
    assert len(fix) == 2 and len(fix[1]) > 5, f"no fix in: {line}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["FILE"]


def test_at_least_60_bad_inputs() -> None:
    assert len(BAD) >= 60


def test_version_and_short_help() -> None:
    code, out, _ = in_process(["--version"], {})
    assert code == 0 and re.fullmatch(r"kvcanary \d+\.\d+\.\d+\n", out)
    code, out, _ = in_process(["run", "-h"], {})
    assert code == 0 and "--num-slots" in out and "4 internal error" in " ".join(out.split())


@pytest.mark.parametrize("command", ["run", "check-config", "selftest", "vllm"])
def test_help_at_80_columns_shows_every_flag_whole(command: str) -> None:
    done = subprocess.run([sys.executable, "-m", "kvcanary.cli", command, "--help"],
                          capture_output=True, text=True, env=_clean_env({"COLUMNS": "80"}))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert max(len(line) for line in done.stdout.splitlines()) <= 80
    assert "…" not in done.stdout
    if command == "run":
        for flag in ("--kv-canary-sweep-interval", "--speculative-num-draft-tokens",
                     "--max-running-requests", "--metrics-port", "--plant"):  # fmt: skip
            assert flag in done.stdout


def test_internal_error_exits_4(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvcanary.cli.commands as commands

    def boom(*args: object, **kwargs: object) -> None:
        raise RuntimeError("planted bug")

    monkeypatch.setattr(commands, "run_session", boom)
    code, _, err = in_process(["run", *SMALL], {})
    assert code == 4 and "RuntimeError: planted bug" in err and "internal error" in err


@pytest.mark.parametrize(("signal_exc", "code"), [("SIGTERM", 143), ("SIGINT", 130)])
def test_signal_inside_compiled_code_is_the_signal_not_a_bug(
    monkeypatch: pytest.MonkeyPatch, signal_exc: str, code: int
) -> None:
    """CI saw SIGTERM land in numba's unpickle callback: a SystemError caused by Terminated."""
    import kvcanary.cli.commands as commands
    from kvcanary.app.session import Terminated

    def wrapped(*args: object, **kwargs: object) -> None:
        inner = Terminated() if signal_exc == "SIGTERM" else KeyboardInterrupt()
        try:
            try:
                raise inner
            except KeyboardInterrupt as exc:
                raise SystemError("<function _numba_unpickle> returned a result") from exc
        except SystemError as exc:
            raise SystemError("CPUDispatcher(build_plan) returned a result") from exc

    monkeypatch.setattr(commands, "run_session", wrapped)
    got, _, err = in_process(["run", *SMALL], {})
    assert got == code and "internal error" not in err and "Traceback" not in err


def test_a_system_error_without_a_signal_is_still_a_bug(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvcanary.cli.commands as commands

    def wrapped(*args: object, **kwargs: object) -> None:
        try:
            raise ValueError("inner")
        except ValueError as exc:
            raise SystemError("outer") from exc

    monkeypatch.setattr(commands, "run_session", wrapped)
    code, _, err = in_process(["run", *SMALL], {})
    assert code == 4 and "internal error" in err


def test_check_config_prints_capacities() -> None:
    code, out, err = in_process(["check-config", "--kv-canary", "log", "--cuda-graph-max-bs", "160",
                                 "--speculative-num-draft-tokens", "4",
                                 "--chunked-prefill-size", "8192"], {})  # fmt: skip
    assert code == 0, err
    assert "write_req_capacity=160" in out and "write_entry_capacity=8192" in out
    code, same, _ = in_process(["check-config", "--kv-canary", "log", "--max-batch-size", "160",
                                "--speculative-num-draft-tokens", "4",
                                "--chunked-prefill-size", "8192"], {})  # fmt: skip
    assert code == 0 and same == out  # run's names and the SPEC §6 names mean the same


@pytest.mark.slow
def test_small_clean_run_writes_summary_events_and_zero_metrics(tmp_path: Path) -> None:
    out, events = tmp_path / "summary.json", tmp_path / "events.jsonl"
    result = kvcanary(["run", *SMALL, "--json", str(out), "--events", str(events),
                       "--metrics-port", "0"])  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert re.search(r"Prometheus metrics on http://127\.0\.0\.1:\d+/metrics", result.stderr)
    summary = json.loads(out.read_text())
    assert summary["violations"] == 0 and summary["violations_by_reason"] == {}
    assert summary["requests_finished"] + summary["requests_aborted"] == 6
    assert summary["protected_slot_checks"] > 0 and summary["sweep_passes"] > 0
    for key in ("tokens_generated", "forward_steps", "retractions", "evictions", "radix_hit_tokens",
                "spec_accepted_tokens", "wall_seconds", "canary_seconds"):  # fmt: skip
        assert key in summary
    kinds = [json.loads(line)["event"] for line in events.read_text().splitlines()]
    assert kinds[:2] == ["start", "config"] and kinds[-1] == "end"
    assert set(kinds[2:-1]) == {"step"} and len(kinds) - 3 == summary["engine_steps"]


@pytest.mark.slow
def test_violations_in_log_mode_exit_1(tmp_path: Path) -> None:
    out, events = tmp_path / "summary.json", tmp_path / "events.jsonl"
    env = {**FAULT, "KVCANARY_PERTURB_WARMUP_STEPS": "3"}
    result = kvcanary(["run", *SMALL, "--json", str(out), "--events", str(events)], env)
    assert result.returncode == 1, result.stderr
    summary = json.loads(out.read_text())
    assert summary["violations"] > 0
    assert summary["requests_finished"] + summary["requests_aborted"] == 6  # log mode keeps serving
    assert "replay: KVCANARY_PERTURB_LATE_WRITE_PROB=1" in result.stderr
    kinds = [json.loads(line)["event"] for line in events.read_text().splitlines()]
    assert "injection" in kinds and "violation" in kinds
    assert kinds.index("injection") < kinds.index("violation")


@pytest.mark.slow
def test_raise_mode_prints_first_line_and_a_replay_that_reproduces_it(tmp_path: Path) -> None:
    out = tmp_path / "summary.json"
    env = {"KVCANARY_PERTURB_REAL_KV_USED_PROB": "1", "KVCANARY_PERTURB_TARGET_GROUP": "full",
           "KVCANARY_PERTURB_WARMUP_STEPS": "3"}  # fmt: skip
    result = kvcanary(["run", *SMALL, "--kv-canary", "raise", "--json", str(out)], env)
    assert result.returncode == 3, result.stderr
    summary = json.loads(out.read_text())
    assert summary["violations"] > 0
    assert summary["requests_finished"] + summary["requests_aborted"] < 6  # stopped early
    lines = result.stderr.strip().splitlines()
    first = next(line for line in lines if line.startswith("kv_canary violation:"))
    assert "launch_tag=" in first and "slot_idx=" in first
    replay = lines[-1].split("replay: ", 1)[1]
    assert "KVCANARY_PERTURB_REAL_KV_USED_PROB=1" in replay and "--kv-canary raise" in replay
    # the user's path: the printed command in a shell with no KVCANARY_* set, the script on PATH
    path = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    again = subprocess.run(["bash", "-c", replay], capture_output=True, text=True,
                           env=_clean_env({"PATH": path}), timeout=600)  # fmt: skip
    assert again.returncode == 3, again.stderr
    assert first in again.stderr.splitlines()


@pytest.mark.slow
@pytest.mark.parametrize(("signum", "code", "name"), [(2, 130, "SIGINT"), (15, 143, "SIGTERM")])
def test_signal_gives_partial_summary_json_and_flushed_events(
    tmp_path: Path, signum: int, code: int, name: str
) -> None:
    import time

    out, events = tmp_path / "summary.json", tmp_path / "events.jsonl"
    args = ["run", "--quiet", "--model", "oracle", "--requests", "5000", "--json", str(out),
            "--events", str(events)]  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-m", "kvcanary.cli", *args], env=_clean_env({}),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:  # wait for the condition: a few steps are on disk
        if events.exists() and events.read_text().count('"event":"step"') >= 3:
            break
        time.sleep(0.2)
    seen_before = events.read_text().count('"event":"step"')
    assert seen_before >= 3
    proc.send_signal(signum)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == code, stderr
    summary = json.loads(out.read_text())
    assert summary["interrupted"] == name and summary["engine_steps"] >= seen_before
    assert summary["requests_finished"] + summary["requests_aborted"] < 5000
    kinds = [json.loads(line)["event"] for line in events.read_text().splitlines()]
    assert kinds[0] == "start" and kinds[-1] == "end"
    assert f"{name}: stopped early" in stderr and "interrupted" in stdout
