"""The token oracle (SPEC §10): deterministic "sampled" tokens for tests and mock models.

Pure integer functions, shared by engines (as a sampler) and by whoever builds
`ForwardView.expected_inputs`. The canary core only needs to know one is present.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

__all__ = ["MASK64", "TokenOracle", "request_key", "splitmix64"]

MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """SplitMix64 finaliser on u64 (SPEC §4); input is masked to 64 bits."""
    x &= MASK64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & MASK64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & MASK64
    x ^= x >> 31
    return x


def request_key(request_id: str, room_id: int | None = None) -> int:
    """The oracle key of a request: `room_id` when given and >= 0, else BLAKE2b (digest_size=8)
    of the UTF-8 id read as a little-endian signed int64."""
    if room_id is not None and room_id >= 0:
        return room_id
    digest = hashlib.blake2b(request_id.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


@dataclass(frozen=True, slots=True)
class TokenOracle:
    """`token(key, pos) = splitmix64(u64(key) ^ u64(pos)) mod vocab_size` (unsigned modulo)."""

    vocab_size: int

    def __post_init__(self) -> None:
        if self.vocab_size < 1:
            raise ValueError(
                f"kv-canary: TokenOracle.vocab_size must be positive, got {self.vocab_size}"
            )

    def token(self, key: int, position: int) -> int:
        """The token the oracle expects at `position` of the request with `key`."""
        return splitmix64((key & MASK64) ^ (position & MASK64)) % self.vocab_size

    def next_token(self, key: int, last_position: int) -> int:
        """What the oracle sampler returns for a row whose last input sits at `last_position`."""
        return self.token(key, last_position + 1)

    def expected_token(self, key: int, prompt: list[int] | tuple[int, ...], index: int) -> int:
        """Expected token at sequence index `index`: the user prompt inside it, the oracle after."""
        return prompt[index] if index < len(prompt) else self.token(key, index)
