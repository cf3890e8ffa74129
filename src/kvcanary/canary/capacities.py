"""Pre-sized launch capacities (SPEC §6)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CanaryLaunchCapacities"]


def _require_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"kv-canary: {name} must be an int, got {type(value)}")
    return value


@dataclass(frozen=True, slots=True, kw_only=True)
class CanaryLaunchCapacities:
    """Upper bounds on one forward's work, fixed at install so buffers are allocated once.

    `write_req_capacity` bounds batch rows, `write_entry_capacity` token entries, and
    `verify_capacity` the verify entries per group (3x the pool: radix sharing lets the sum of
    prefix lengths exceed it). `max_seq_len_per_req` is the width of the truth-token table.
    """

    write_req_capacity: int
    write_entry_capacity: int
    verify_capacity: int
    max_seq_len_per_req: int

    @classmethod
    def from_args(
        cls,
        *,
        req_to_token_pool_size: int,
        max_seq_len_per_req: int,
        pool_slot_count: int,
        cuda_graph_max_bs: int | None,
        speculative_num_draft_tokens: int | None,
        max_prefill_tokens: int,
        chunked_prefill_size: int | None,
    ) -> CanaryLaunchCapacities:
        """Derive capacities from engine sizes; validation order and messages are SPEC §6's."""
        values: dict[str, object] = {
            "req_to_token_pool_size": req_to_token_pool_size,
            "max_seq_len_per_req": max_seq_len_per_req,
            "pool_slot_count": pool_slot_count,
            "cuda_graph_max_bs": 0 if cuda_graph_max_bs is None else cuda_graph_max_bs,
            "speculative_num_draft_tokens": (
                0 if speculative_num_draft_tokens is None else speculative_num_draft_tokens
            ),
            "max_prefill_tokens": max_prefill_tokens,
            "chunked_prefill_size": -1 if chunked_prefill_size is None else chunked_prefill_size,
        }
        ints = {name: _require_int(name, value) for name, value in values.items()}
        for name in ("req_to_token_pool_size", "max_seq_len_per_req", "pool_slot_count"):
            if ints[name] <= 0:
                raise ValueError(f"kv-canary: {name} must be positive, got {ints[name]}")
        for name in ("cuda_graph_max_bs", "speculative_num_draft_tokens"):
            if ints[name] < 0:
                raise ValueError(f"kv-canary: {name} must be non-negative, got {ints[name]}")
        if ints["max_prefill_tokens"] <= 0:
            raise ValueError(
                f"kv-canary: max_prefill_tokens must be positive, got {ints['max_prefill_tokens']}"
            )
        chunk = ints["chunked_prefill_size"]
        prefill_limit = (
            ints["max_prefill_tokens"] if chunk < 0 else min(ints["max_prefill_tokens"], chunk)
        )
        max_bs = max(ints["cuda_graph_max_bs"], ints["req_to_token_pool_size"])
        return cls(
            write_req_capacity=max_bs,
            write_entry_capacity=max(
                max_bs * max(1, ints["speculative_num_draft_tokens"]), prefill_limit
            ),
            verify_capacity=3 * ints["pool_slot_count"],
            max_seq_len_per_req=ints["max_seq_len_per_req"],
        )
