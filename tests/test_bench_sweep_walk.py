"""bench/sweep_walk.py runs end to end on small pools: both walks sweep every written slot of a
clean pool (the bench stops on a violation), and bad sizes exit 2 with one line (no timings
asserted: the cost side is the bench's own output)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src")}


def test_sweep_walk_bench_sweeps_every_written_slot(tmp_path: Path) -> None:
    out_json = tmp_path / "sweep.json"
    args = ["--blocks", "33,100", "--block-size", "4", "--requests", "8", "--repeats", "2",
            "--json", str(out_json)]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "sweep_walk.py"), *args],
        capture_output=True, text=True, timeout=600, check=False, env=ENV,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    sizes = json.loads(out_json.read_text())["sizes"]
    # (blocks - 1) // requests blocks a request, 4 slots a block, each swept by both walks
    assert [(s["blocks"], s["entries"]) for s in sizes] == [(33, 32 * 4), (100, 96 * 4)]
    assert all(s["runs_us"] > 0 and s["array_us"] > 0 for s in sizes)


def test_sweep_walk_bench_refuses_a_pool_too_small() -> None:
    bad = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "sweep_walk.py"), "--blocks", "10", "--requests", "8"],
        capture_output=True, text=True, timeout=120, check=False, env=ENV,
    )  # fmt: skip
    assert bad.returncode == 2 and "--blocks must each be at least 2 * --requests + 1" in bad.stderr
