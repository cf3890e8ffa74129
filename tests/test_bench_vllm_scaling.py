"""bench/vllm_scaling.py runs end to end on a small grid and reports what the canary checked
per decode step and the fit (no timings asserted: speed goals live in the bench's output); bad
grid flags exit 2 with one line naming the flag. The canary settings the vLLM benches share
(`bench/vllm_hooks.py`): a sweep interval from `KVCANARY_SWEEP_INTERVAL` is honoured, and a
mode or real-data setting the bench would replace is refused before vLLM loads."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "vllm_scaling.py"

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _run(*flags: str, **env_vars: str) -> subprocess.CompletedProcess[str]:
    # the canary's variables only as each test sets them (an in-process engine of an earlier
    # test leaves its own in os.environ)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCANARY_")}
    env.update(env_vars, PYTHONPATH=str(ROOT / "src"))
    return subprocess.run([sys.executable, str(BENCH), *flags], capture_output=True, text=True,
                          env=env, timeout=900, check=False)  # fmt: skip


def test_small_grid_prints_table_and_fit(tmp_path: Path) -> None:
    out_json = tmp_path / "vllm_scaling.json"
    proc = _run("--batches", "1,2", "--prompts", "32,64", "--decode", "4", "--repeats", "2",
                "--json", str(out_json), KVCANARY_SWEEP_INTERVAL="2")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    # the user's sweep interval, not the bench's default, and said so
    assert "log + partial + sweep every 2 steps;" in proc.stdout
    assert re.search(r"c0 = -?[\d.]+ us per step .* c1 = -?[\d.]+ ns per entry", proc.stdout)
    # the grid is run once a pass, each pass fitted on its own as it ends
    assert re.findall(r"^pass (\d)/2: 4 cells, c0 = -?[\d.]+ us", proc.stdout, re.M) == ["1", "2"]
    figures = json.loads(out_json.read_text())
    assert figures["sweep_interval"] == 2
    assert len(figures["pass_fits"]) == 2
    cells = figures["cells"]
    assert [(c["batch"], c["prompt"]) for c in cells] == [(1, 32), (1, 64), (2, 32), (2, 64)]
    for c in cells:
        # a decode step verifies each context at HEAD and at TAIL, and writes each new token
        assert c["entries"] >= 2 * c["batch"] * c["prompt"]
        assert c["steps"] >= 4 and c["canary_us_median"] > 0
    # more context, more entries: the table is the one the fit needs
    assert cells[1]["entries"] > cells[0]["entries"] and cells[3]["entries"] > cells[2]["entries"]
    assert {"c0_us", "c1_ns_per_entry", "ols_r2", "max_relative_residual"} <= set(figures["fit"])


@pytest.mark.parametrize(("flags", "knob"), [
    (("--batches", "32"), "--batches"),
    (("--prompts", "600"), "--prompts"),
    (("--decode", "0"), "--decode"),
    (("--batches", "1,x"), "--batches"),
    (("--prompts", "0"), "--prompts"),
    (("--sweep-interval", "-1"), "--sweep-interval"),
    (("--sweep-interval", "often"), "--sweep-interval"),
])  # fmt: skip
def test_bad_grid_exits_2_naming_the_flag(flags: tuple[str, ...], knob: str) -> None:
    proc = _run(*flags)
    assert proc.returncode == 2
    assert knob in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(("name", "value"), [
    ("KVCANARY_SWEEP_INTERVAL", "often"),
    ("KVCANARY_SWEEP_INTERVAL", "-4"),
    ("KVCANARY_MODE", "raise"),
    ("KVCANARY_REAL_DATA", "all"),
])  # fmt: skip
def test_an_environment_the_bench_would_override_exits_2_naming_it(name: str, value: str) -> None:
    proc = _run(**{name: value})
    assert proc.returncode == 2
    assert f"{name}={value}" in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stdout == ""  # refused before any work
