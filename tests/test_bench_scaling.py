"""bench/scaling.py's smoke mode runs end to end and prints its table and fit (no timings
asserted: speed goals live in the bench's own output)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_scaling_quick_prints_table_and_fit(tmp_path: Path) -> None:
    out_json = tmp_path / "scaling.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "scaling.py"), "--quick", "--json", str(out_json)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [
        line.split()
        for line in proc.stdout.splitlines()
        if re.fullmatch(r"\s*\d+\s+\d+\s+[\d,]+\s+[\d,]+(\s+[\d.]+){4}\s*", line)
    ]
    assert [(int(r[0]), int(r[1])) for r in rows] == [(1, 256), (1, 1024), (8, 256), (8, 1024)]
    assert re.search(r"c0 = -?[\d.]+ us per step .* c1 = -?[\d.]+ ns per entry", proc.stdout)
    # `--quick` measures the grid twice, pass after pass, and pools each cell's steps
    assert re.findall(r"^pass (\d)/2: 4 cells, c0 = -?[\d.]+ us", proc.stdout, re.M) == ["1", "2"]
    figures = json.loads(out_json.read_text())
    cells = figures["cells"]
    assert [c["passes"] for c in cells] == [2, 2, 2, 2]
    assert len(figures["pass_fits"]) == 2
    # the bench counts what the canary verified: HEAD + TAIL over each context, plus the writes
    for cell in cells:
        assert cell["entries"] >= 2 * cell["batch"] * cell["context"]
        assert cell["bytes"] > 64 * cell["entries"] // 2
    assert {"c0_us", "c1_ns_per_entry", "ols_r2", "max_relative_residual"} <= set(figures["fit"])
