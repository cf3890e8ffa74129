"""bench/vllm_overhead.py runs both arms end to end on a small workload and writes its figures
(no timings asserted: the on/off ratios are the bench's output, not a test's); bad flags and an
environment the bench would override exit 2 with one line naming them, before vLLM loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "vllm_overhead.py"

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _run(*flags: str, **env_vars: str) -> subprocess.CompletedProcess[str]:
    # the canary's variables only as each test sets them (an in-process engine of an earlier
    # test leaves its own in os.environ)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCANARY_")}
    env.update(env_vars, PYTHONPATH=str(ROOT / "src"))
    return subprocess.run([sys.executable, str(BENCH), *flags], capture_output=True, text=True,
                          env=env, timeout=900, check=False)  # fmt: skip


def test_small_workload_reports_both_kinds(tmp_path: Path) -> None:
    out_json = tmp_path / "vllm_overhead.json"
    proc = _run("--rounds", "1", "--prefill-requests", "2", "--prompt-len", "64",
                "--decode-requests", "2", "--decode-tokens", "8", "--sweep-interval", "2",
                "--json", str(out_json))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "canary: log, real-data partial, sweep every 2 steps" in proc.stdout
    figures = json.loads(out_json.read_text())
    assert figures["sweep_interval"] == 2
    for kind in ("prefill", "decode"):
        f = figures[kind]
        assert f["on_seconds_median"] > 0 and f["off_seconds_median"] > 0
        assert f["overhead_ratio"] == pytest.approx(
            f["on_seconds_median"] / f["off_seconds_median"], rel=1e-2
        )
        assert f["fastest_overhead_ratio"] > 0
        # the on arm ran the canary (its own time is timed inside the adapter), and no more
        # than the whole run
        assert 0 < f["canary_share_of_on"] < 1
    assert figures["decode"]["steps_per_run"] >= 8


@pytest.mark.parametrize(("flags", "knob"), [
    (("--rounds", "0"), "--rounds"),
    (("--decode-tokens", "0"), "--decode-tokens"),
    (("--hidden", "100"), "--hidden"),
    (("--sweep-interval", "-1"), "--sweep-interval"),
])  # fmt: skip
def test_bad_flag_exits_2_naming_it(flags: tuple[str, ...], knob: str) -> None:
    proc = _run(*flags)
    assert proc.returncode == 2
    assert knob in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(("name", "value"), [
    ("KVCANARY_SWEEP_INTERVAL", "often"),
    ("KVCANARY_MODE", "recover"),
    ("KVCANARY_REAL_DATA", "none"),
])  # fmt: skip
def test_an_environment_the_bench_would_override_exits_2_naming_it(name: str, value: str) -> None:
    proc = _run(**{name: value})
    assert proc.returncode == 2
    assert f"{name}={value}" in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stdout == ""
