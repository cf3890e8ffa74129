"""The per-forward row checks take a Python-list path for small batches and a NumPy path for
large ones (`plan._check_active_rows`); both must accept and reject the same views with the same
SPEC messages, huge extend_lens included."""

from __future__ import annotations

import numpy as np
import pytest

from kvcanary.canary import plan
from kvcanary.contract.errors import CanaryContractError


def _outcome(rows: np.ndarray, extend_lens: np.ndarray, num_tokens: int) -> str:
    try:
        plan._check_active_rows(rows, extend_lens, num_tokens)
    except CanaryContractError as err:
        return str(err)
    return "ok"


def _case(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray, int]:
    rows = rng.integers(1, 50, size=n, dtype=np.int64)
    n_active = int(rng.integers(0, n + 1))
    rows[n_active:] = 0
    if n and rng.random() < 0.3:  # a padding row before an active one
        rows[int(rng.integers(0, n))] = 0
    extend = rng.integers(-3, 6, size=n, dtype=np.int64)
    if n and rng.random() < 0.2:
        extend[int(rng.integers(0, n))] = np.int64(2**62)  # the sum would overflow int64
    num_tokens = int(rng.integers(0, 5 * n + 2))
    return rows, extend, num_tokens


@pytest.mark.parametrize("n", [0, 1, 2, 5, 31, 32, 33, 40])
def test_list_and_numpy_paths_agree(n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(1000 + n)
    cases = [_case(rng, n) for _ in range(300)]
    small = [_outcome(*c) for c in cases] if n <= plan._SMALL_BATCH else None
    monkeypatch.setattr(plan, "_SMALL_BATCH", -1)  # every batch takes the NumPy path
    large = [_outcome(*c) for c in cases]
    monkeypatch.setattr(plan, "_SMALL_BATCH", 1 << 30)  # every batch takes the list path
    listed = [_outcome(*c) for c in cases]
    assert listed == large
    if small is not None:
        assert small == large
    assert (any(o == "ok" for o in large) and any(o != "ok" for o in large)) or n == 0
    assert any("precedes an active row" in o for o in large) or n < 2
    assert any("tokens but only" in o for o in large) or n == 0
