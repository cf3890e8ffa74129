"""bench/verify_stride.py runs end to end on a small batch: every corruption is reported within
its stride's bound, and a stride thins the verify entries it claims to (no timings asserted:
the cost side is the bench's own output)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_verify_stride_bench_reports_latencies_within_the_bound(tmp_path: Path) -> None:
    out_json = tmp_path / "stride.json"
    args = ["--strides", "1,3,8", "--requests", "4", "--context", "300", "--steps", "8",
            "--trials", "12", "--json", str(out_json)]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "verify_stride.py"), *args],
        capture_output=True, text=True, timeout=600, check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    figures = json.loads(out_json.read_text())["strides"]
    assert set(figures) == {"1", "3", "8"}
    for stride, f in figures.items():
        assert f["missed"] == 0 and 0 <= f["latency_max_steps"] <= int(stride) - 1, (stride, f)
    assert figures["1"]["latency_max_steps"] == 0
    assert figures["8"]["latency_max_steps"] > 0  # some corruption waited for its phase
    full = figures["1"]["verify_entries_per_step"]
    assert figures["3"]["verify_entries_per_step"] < 0.6 * full
    assert figures["8"]["verify_entries_per_step"] < 0.4 * full
    bad = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "verify_stride.py"), "--strides", "2,4"],
        capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )  # fmt: skip
    assert bad.returncode == 2 and "--strides must start with 1" in bad.stderr
