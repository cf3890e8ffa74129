"""Install the canary on the reference engine, flip one KV byte, and watch the canary name it.

Run: `python examples/canary_on_refengine.py`
"""

from __future__ import annotations

import logging

import torch

from kvcanary.app.session import RunSettings, build_stack
from kvcanary.canary import CanaryConfig, CanaryMode, RealDataMode
from kvcanary.engine.config import EngineConfig
from kvcanary.engine.model import ModelConfig


def main() -> None:
    """Serve two requests, corrupt one cached K byte mid-flight, print the first violation."""
    logging.disable(logging.WARNING)
    settings = RunSettings(
        canary=CanaryConfig(
            mode=CanaryMode.LOG, real_data=RealDataMode.PARTIAL, stats_print_every_n_steps=0
        ),
        engine=EngineConfig(
            num_slots=256, max_context_len=128, vocab_size=256, max_running_requests=4
        ),
        model=ModelConfig(vocab_size=256),
    )
    stack = build_stack(settings)
    stack.engine.add_request("a", list(range(1, 40)), 12)
    stack.engine.add_request("b", [*range(1, 20), 99, 98, 97], 12)
    for _ in range(3):
        stack.engine.step()
    row = stack.engine.request("a").row
    slot = int(stack.table.tensor[row, 5])
    k_bytes = stack.pool.k(0)[slot].reshape(-1).view(torch.uint8)  # a view: [heads, dim] -> bytes
    k_bytes[0] ^= 0xFF  # a bit flip in request a's cached key at position 5
    print(f"flipped byte 0 of layer-0 K at slot {slot} (request a, position 5)")
    stack.engine.run_until_idle()
    first = stack.hooks.violations[0]
    print(first.message.splitlines()[0])
    print(f"violations: {len(stack.hooks.violations)}, all at slot {slot}: "
          f"{all(v.slot_idx == slot for v in stack.hooks.violations)}")  # fmt: skip


if __name__ == "__main__":
    main()
