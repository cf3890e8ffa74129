"""Launch tags and fail-reason bits (SPEC §5.4, §7.2; compatible with SGLang's kv-canary)."""

from __future__ import annotations

import enum

__all__ = ["NUM_LAUNCH_TAGS", "FailReason", "LaunchTag", "fail_reason_labels", "tag_name"]


class LaunchTag(enum.IntEnum):
    """One verify/write endpoint: `{STAGE}_{HALF}_{GROUP}`. Values are frozen (compat)."""

    HEAD_K_FULL = 0
    HEAD_V_FULL = 1
    TAIL_K_FULL = 2
    TAIL_V_FULL = 3
    SWEEP_K_FULL = 4
    SWEEP_V_FULL = 5
    HEAD_K_SWA = 6
    HEAD_V_SWA = 7
    TAIL_K_SWA = 8
    TAIL_V_SWA = 9
    SWEEP_K_SWA = 10
    SWEEP_V_SWA = 11

    @classmethod
    def of(cls, stage: str, half: str, group: str) -> LaunchTag:
        """The tag for `stage` (head/tail/sweep), `half` (k/v) and `group` (full/swa)."""
        return cls[f"{stage}_{half}_{group}".upper()]

    @property
    def is_sweep(self) -> bool:
        """True for the SWEEP_* tags."""
        return self.name.startswith("SWEEP_")


NUM_LAUNCH_TAGS = len(LaunchTag)


class FailReason(enum.IntFlag):
    """Bits of FAIL_REASON_BITS, in ascending order (compat)."""

    VERIFY_CHAIN_HASH_MISMATCH = 1
    VERIFY_POSITION_MISMATCH = 2
    VERIFY_REAL_KV_HASH_MISMATCH = 4
    WRITE_TOKEN_MISMATCH = 8
    WRITE_POSITION_MISMATCH = 16
    VERIFY_TOKEN_MISMATCH = 32

    @property
    def label(self) -> str:
        """Lower-cased name without `_mismatch`, e.g. `verify_chain_hash` (single bits only)."""
        name = self.name or ""
        return name.lower().removesuffix("_mismatch")


WRITE_BITS = FailReason.WRITE_TOKEN_MISMATCH | FailReason.WRITE_POSITION_MISMATCH


def fail_reason_labels(bits: int) -> list[str]:
    """Labels of the set bits in ascending bit order; empty for 0."""
    return [reason.label for reason in FailReason if bits & reason.value]


def tag_name(tag: int) -> str:
    """The tag's name, or `unknown(N)` for a value outside the table."""
    try:
        return LaunchTag(tag).name
    except ValueError:
        return f"unknown({tag})"
