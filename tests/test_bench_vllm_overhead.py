"""bench/vllm_overhead.py runs both arms end to end on a small workload and writes its figures
(no timings asserted: the on/off ratios are the bench's output, not a test's); bad counts exit 2
with one line naming the flag, before vLLM loads (the settings all vLLM benches share:
test_bench_vllm_settings.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.vllm_benches import run_bench

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_small_workload_reports_both_kinds(tmp_path: Path) -> None:
    out_json = tmp_path / "vllm_overhead.json"
    # the bench's own mode and real-data setting in the environment: nothing to override
    proc = run_bench("vllm_overhead", "--rounds", "1", "--prefill-requests", "2",
                     "--prompt-len", "64", "--decode-requests", "2", "--decode-tokens", "8",
                     "--sweep-interval", "2", "--json", str(out_json), KVCANARY_MODE="log",
                     KVCANARY_REAL_DATA="Partial")  # fmt: skip
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
])  # fmt: skip
def test_bad_flag_exits_2_naming_it(flags: tuple[str, ...], knob: str) -> None:
    proc = run_bench("vllm_overhead", *flags)
    assert proc.returncode == 2
    assert knob in proc.stderr and "Traceback" not in proc.stderr
