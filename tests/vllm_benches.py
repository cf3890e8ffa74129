"""Running the vLLM bench scripts (`bench/vllm_*.py`) as a user does: a fresh process, the
package on the path, and the canary's variables only as a test sets them (an in-process engine
of an earlier test leaves its own in `os.environ`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: the vLLM benches, which share `bench/vllm_hooks.py`'s canary settings
VLLM_BENCHES = ("vllm_overhead", "vllm_scaling", "vllm_hooks")


def run_bench(name: str, *flags: str, **env_vars: str) -> subprocess.CompletedProcess[str]:
    """`python bench/<name>.py FLAGS` with `env_vars` added to a `KVCANARY_*`-free environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCANARY_")}
    env.update(env_vars, PYTHONPATH=str(ROOT / "src"))
    return subprocess.run([sys.executable, str(ROOT / "bench" / f"{name}.py"), *flags],
                          capture_output=True, text=True, env=env, timeout=900,
                          check=False)  # fmt: skip
