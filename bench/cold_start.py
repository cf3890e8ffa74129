"""Cold vs warm `kvcanary run`: what the first run on a fresh machine costs (issue 12).

Runs `kvcanary run ARGS` twice in subprocesses, both with `XDG_CACHE_HOME` set to one new empty
folder: the first run finds no compiled kernels there (cold: it compiles them, as on a fresh
machine or after a kernel edit), the second finds them (warm). For each run it prints

* start: seconds from launch until the first engine step is logged (`--events`), i.e. imports,
  engine and model set-up and, cold, kernel compilation;
* total: seconds until the process exits; cpu: CPU seconds of the process (user + system);
* canary / compile: `canary_seconds` and `kernel_compile_seconds` from the run's `--json`
  summary (compile is reported only by a cold run; canary time excludes it);

then cold - warm for start and total, and the compile line the cold run printed. The goal is
cold total <= warm total + 10 s. CPU seconds are printed too because wall clock on a shared
machine depends on its load (the 1-minute load average is printed before each run).

    python bench/cold_start.py [--json PATH] [-- RUN ARGS...]   (default: `kvcanary run`)
    python bench/cold_start.py -- --requests 8 --quiet
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _cpu_children() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _first_step(events: Path) -> bool:
    try:
        with events.open() as lines:
            return any('"event":"step"' in line for line in lines)
    except OSError:
        return False


def one_run(run_args: list[str], cache_home: Path, work: Path, name: str) -> dict[str, Any]:
    """One `kvcanary run` in a subprocess with `cache_home` as XDG_CACHE_HOME; its figures."""
    events, summary = work / f"{name}.events.jsonl", work / f"{name}.json"
    cmd = [sys.executable, "-m", "kvcanary.cli", "run", *run_args,
           "--events", str(events), "--json", str(summary)]  # fmt: skip
    env = dict(os.environ, XDG_CACHE_HOME=str(cache_home))
    env.pop("NUMBA_CACHE_DIR", None)  # a user's own cache folder would make both runs warm
    load = os.getloadavg()[0]
    cpu0, start = _cpu_children(), time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    first_step = None
    while proc.poll() is None:  # a bench, not a test: poll the events file for the first step
        if first_step is None and _first_step(events):
            first_step = time.perf_counter() - start
        time.sleep(0.05)
    total = time.perf_counter() - start
    stderr = proc.stderr.read() if proc.stderr else ""
    if proc.returncode != 0:
        raise SystemExit(f"{name} run exited {proc.returncode}:\n{stderr}")
    figures = json.loads(summary.read_text())
    compile_line = next((ln for ln in stderr.splitlines() if "compiling kernels" in ln), "")
    return {
        "load_1min": round(load, 2),
        "start_seconds": round(first_step if first_step is not None else total, 2),
        "total_seconds": round(total, 2),
        "cpu_seconds": round(_cpu_children() - cpu0, 2),
        "canary_seconds": figures.get("canary_seconds"),
        "kernel_compile_seconds": figures.get("kernel_compile_seconds"),
        "compile_line": compile_line,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON to PATH")
    p.add_argument("run_args", nargs="*", help="arguments of `kvcanary run` (after --)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvcanary-cold-") as tmp:
        work = Path(tmp)
        cache_home = work / "cache"
        cache_home.mkdir()
        cold = one_run(args.run_args, cache_home, work, "cold")
        warm = one_run(args.run_args, cache_home, work, "warm")
    result = {
        "command": "kvcanary run " + " ".join(args.run_args),
        "cold": cold,
        "warm": warm,
        "cold_minus_warm_start_seconds": round(cold["start_seconds"] - warm["start_seconds"], 2),
        "cold_minus_warm_total_seconds": round(cold["total_seconds"] - warm["total_seconds"], 2),
        "cold_minus_warm_cpu_seconds": round(cold["cpu_seconds"] - warm["cpu_seconds"], 2),
    }
    print(f"command: {result['command']}   (machine: {os.cpu_count()} CPUs)")
    print(f"{'run':5} {'load':>5} {'start s':>8} {'total s':>8} {'cpu s':>7} {'canary s':>9} "
          f"{'compile s':>9}")  # fmt: skip
    for name, r in (("cold", cold), ("warm", warm)):
        print(f"{name:5} {r['load_1min']:5.2f} {r['start_seconds']:8.2f} {r['total_seconds']:8.2f} "
              f"{r['cpu_seconds']:7.2f} {r['canary_seconds']!s:>9} "
              f"{r['kernel_compile_seconds']!s:>9}")  # fmt: skip
    print(f"cold - warm: start {result['cold_minus_warm_start_seconds']:+.2f} s, total "
          f"{result['cold_minus_warm_total_seconds']:+.2f} s, cpu "
          f"{result['cold_minus_warm_cpu_seconds']:+.2f} s (goal: total <= +10 s)")  # fmt: skip
    print(f"cold run said: {cold['compile_line'] or '(no compile line)'}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
