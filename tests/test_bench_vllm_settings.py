"""The canary settings the vLLM benches share (`bench/vllm_hooks.py`): a bad `--sweep-interval`,
or an environment the bench would override (`KVCANARY_MODE`, `KVCANARY_REAL_DATA`) or cannot
read (`KVCANARY_SWEEP_INTERVAL`), exits 2 with one line naming it, before vLLM loads. The
benches' own runs (test_bench_vllm_overhead.py, test_bench_vllm_scaling.py) assert that the
bench's own values in the environment are accepted and a valid `KVCANARY_SWEEP_INTERVAL`
honoured."""

from __future__ import annotations

import pytest

from tests.vllm_benches import VLLM_BENCHES, run_bench

pytestmark = [pytest.mark.vllm]


@pytest.mark.parametrize("bench", VLLM_BENCHES)
@pytest.mark.parametrize("value", ["-1", "often"])
def test_a_bad_sweep_interval_flag_exits_2_naming_it(bench: str, value: str) -> None:
    proc = run_bench(bench, "--sweep-interval", value)
    assert proc.returncode == 2
    assert "--sweep-interval" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("bench", VLLM_BENCHES)
@pytest.mark.parametrize(("name", "value"), [
    ("KVCANARY_SWEEP_INTERVAL", "often"),
    ("KVCANARY_SWEEP_INTERVAL", "-4"),
    ("KVCANARY_MODE", "raise"),
    ("KVCANARY_MODE", "recover"),
    ("KVCANARY_REAL_DATA", "all"),
    ("KVCANARY_REAL_DATA", "none"),
])  # fmt: skip
def test_an_environment_the_bench_would_override_exits_2_naming_it(
    bench: str, name: str, value: str
) -> None:
    proc = run_bench(bench, **{name: value})
    assert proc.returncode == 2
    assert f"{name}={value}" in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stdout == ""  # refused before any work
