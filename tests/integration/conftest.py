"""Integration tests run the tiny model on tensors far too small to gain from intra-op threads;
one thread keeps them fast on a small shared CI machine (and results do not depend on it)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def single_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
