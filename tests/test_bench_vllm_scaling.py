"""bench/vllm_scaling.py runs end to end on a small grid and reports what the canary checked
per decode step and the fit (no timings asserted: speed goals live in the bench's output); bad
grid flags exit 2 with one line naming the flag; a sweep interval from `KVCANARY_SWEEP_INTERVAL`
is honoured (the settings all vLLM benches share: test_bench_vllm_settings.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.vllm_benches import run_bench

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_small_grid_prints_table_and_fit(tmp_path: Path) -> None:
    out_json = tmp_path / "vllm_scaling.json"
    proc = run_bench("vllm_scaling", "--batches", "1,2", "--prompts", "32,64", "--decode", "4",
                     "--repeats", "2", "--json", str(out_json),
                     KVCANARY_SWEEP_INTERVAL="2")  # fmt: skip
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
])  # fmt: skip
def test_bad_grid_exits_2_naming_the_flag(flags: tuple[str, ...], knob: str) -> None:
    proc = run_bench("vllm_scaling", *flags)
    assert proc.returncode == 2
    assert knob in proc.stderr and "Traceback" not in proc.stderr
