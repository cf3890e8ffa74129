"""The structured form of one violation row (SPEC §7.1, §7.5)."""

from __future__ import annotations

from dataclasses import dataclass

from kvcanary.contract.tags import WRITE_BITS, LaunchTag

__all__ = ["Violation"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Violation:
    """One ring row plus where and when it was reported.

    The eight ring columns keep their SPEC names. For verify rows `stored_chain_hash` is the stored
    PREV_HASH and `expected_aux` the expected chain hash; for write rows they are the running hash
    and the expected position. Hashes are the signed int64 bit patterns.
    """

    kernel_kind: int
    slot_idx: int
    position: int
    stored_token: int
    expected_token: int
    stored_chain_hash: int
    expected_aux: int
    fail_reason_bits: int
    step_when_pumped: int
    message: str
    expected_position: int | None = None

    @property
    def tag(self) -> LaunchTag | int:
        """The launch tag, or the raw int when it is not a known tag."""
        try:
            return LaunchTag(self.kernel_kind)
        except ValueError:
            return self.kernel_kind

    @property
    def is_write_row(self) -> bool:
        """True when bit 8 or 16 is set (write-input or chain-position rows)."""
        return bool(self.fail_reason_bits & WRITE_BITS)
