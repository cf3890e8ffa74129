"""EngineConfig: the serving knobs of the reference engine, validated once at construction."""

from __future__ import annotations

from dataclasses import dataclass

from kvcanary.engine.plants import validate_plants

__all__ = ["EngineConfig"]


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    """Knobs of the scheduler and its pools. The model's own shape lives in `engine/model.py`.

    Attributes:
        num_slots: KV pool slots, reserved slot 0 included.
        max_context_len: positions per `req_to_token` row (longest sequence).
        vocab_size: token id range; the oracle drafter samples from it.
        max_running_requests: requests holding a `req_to_token` row at once.
        max_batch_size: batch rows (chunks) per forward.
        chunked_prefill_size: most prefill tokens of one request per forward; None or -1 means
            unlimited.
        max_prefill_tokens: per-step token budget (prefill, decode and verify tokens together);
            decodes that do not fit wait for a later step.
        speculative_num_draft_tokens: drafts per speculative verify (k); 0 turns it off.
        enable_prefix_cache: share KV of common prefixes through the radix cache.
        seed: seeds the slot allocator's initial free order and the planted bugs' choices.
        plants: planted bugs to switch on (names from `engine.plants.PLANT_NAMES`); empty for
            a correct engine.
        plant_warmup_steps: engine steps before any plant may fire, so clean history exists.
        plant_max_fires: how many times each plant fires at most.
        recovery_retries: recomputes a request may take after canary incidents (mode `recover`,
            SPEC §14.3) before the next incident ends it with `finish_reason="kv_corruption"`;
            0 fails at the first incident.
        write_final_token: run one more forward for a request's last sampled token before it
            finishes, so the canary's write-input assert checks that token before delivery
            (set with mode `recover`: a token swapped at the sampler is otherwise never written
            and so never checked). Skipped when the sequence fills `max_context_len`.
    """

    num_slots: int
    max_context_len: int
    vocab_size: int
    max_running_requests: int = 16
    max_batch_size: int = 16
    chunked_prefill_size: int | None = None
    max_prefill_tokens: int = 4096
    speculative_num_draft_tokens: int = 0
    enable_prefix_cache: bool = True
    seed: int = 0
    plants: tuple[str, ...] = ()
    plant_warmup_steps: int = 10
    plant_max_fires: int = 1
    recovery_retries: int = 2
    write_final_token: bool = False

    def __post_init__(self) -> None:
        _at_least("num_slots", self.num_slots, 2, "slot 0 is reserved; give the pool more slots")
        _at_least("max_context_len", self.max_context_len, 1, "allow at least one position")
        _at_least("vocab_size", self.vocab_size, 1, "use the model's vocabulary size")
        _at_least("max_running_requests", self.max_running_requests, 1, "allow one request")
        _at_least("max_batch_size", self.max_batch_size, 1, "allow one row per forward")
        _at_least(
            "speculative_num_draft_tokens",
            self.speculative_num_draft_tokens,
            0,
            "use 0 to turn speculation off",
        )
        if isinstance(self.plants, str):
            raise ValueError(
                f"EngineConfig.plants must be a tuple of plant names, got {self.plants!r}; "
                f"write ({self.plants!r},)"
            )
        validate_plants(self.plants)
        _at_least("plant_warmup_steps", self.plant_warmup_steps, 0, "use 0 to arm at once")
        _at_least("plant_max_fires", self.plant_max_fires, 1, "drop the plant to turn it off")
        _at_least(
            "recovery_retries", self.recovery_retries, 0, "use 0 to fail at the first incident"
        )
        chunk = self.chunked_prefill_size
        if chunk is not None and chunk != -1 and chunk < 1:
            raise ValueError(
                f"EngineConfig.chunked_prefill_size must be None, -1 or >= 1, got {chunk}; use None for unlimited"
            )
        if self.max_prefill_tokens < self.speculative_num_draft_tokens + 1:
            raise ValueError(
                f"EngineConfig.max_prefill_tokens must be >= speculative_num_draft_tokens + 1 = "
                f"{self.speculative_num_draft_tokens + 1}, got {self.max_prefill_tokens}; raise it"
            )

    @property
    def chunk_limit(self) -> int | None:
        """`chunked_prefill_size` normalised: None when unlimited."""
        chunk = self.chunked_prefill_size
        return None if chunk is None or chunk == -1 else chunk

    @property
    def max_request_tokens(self) -> int:
        """Longest `prompt + max_new_tokens` a request may ask for: every position but the last
        sampled one needs a slot and a `req_to_token` column."""
        return min(self.max_context_len, self.num_slots - 1) + 1


def _at_least(name: str, value: int, low: int, fix: str) -> None:
    if value < low:
        raise ValueError(f"EngineConfig.{name} must be >= {low}, got {value}; {fix}")
