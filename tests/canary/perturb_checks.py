"""Attribution of violation rows to injections (SPEC §11.2 "tests MUST assert")."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvcanary.canary import PerturbRecord
from kvcanary.contract import LaunchTag, Violation

CP = 1 | 2  # verify_chain_hash | verify_position
RKV = 4
WRITE_TOKEN, WRITE_POSITION = 8, 16


def tag(stage: str, group: str) -> LaunchTag:
    """The K-half tag of `stage` in `group`."""
    return LaunchTag.of(stage, "k", group)


@dataclass
class Expect:
    """What one injection must and may produce.

    `must`: (tag, slot, any-of bits, max latency) rows that have to appear.
    `allowed`: (tag, slot) -> bits a row there may carry; every row must fit one injection.
    """

    record: PerturbRecord
    must: list[tuple[LaunchTag, int, int, int]] = field(default_factory=list)
    allowed: dict[tuple[LaunchTag, int], int] = field(default_factory=dict)

    def allow(self, tags: tuple[LaunchTag, ...], slot: int, bits: int) -> Expect:
        """Permit `bits` at `slot` under each of `tags`."""
        for t in tags:
            self.allowed[t, slot] = self.allowed.get((t, slot), 0) | bits
        return self

    def need(self, tags: tuple[LaunchTag, ...], slot: int, bits: int, latency: int) -> Expect:
        """Require a row with some of `bits` at `slot` under each tag within `latency` steps
        (and permit it)."""
        self.must += [(t, slot, bits, latency) for t in tags]
        return self.allow(tags, slot, bits)

    def matches(self, v: Violation) -> bool:
        """True when `v` is explained by this injection."""
        allowed = self.allowed.get((LaunchTag(v.kernel_kind), v.slot_idx))
        return (
            allowed is not None
            and v.fail_reason_bits & ~allowed == 0
            and v.step_when_pumped >= self.record.step
        )


def dedupe(rows: list[Violation]) -> dict[tuple[int, int, int], Violation]:
    """First row per (tag, slot, bits): a persistent corruption is re-reported every check."""
    out: dict[tuple[int, int, int], Violation] = {}
    for v in rows:
        out.setdefault((v.kernel_kind, v.slot_idx, v.fail_reason_bits), v)
    return out


def assert_attributed(rows: list[Violation], expects: list[Expect]) -> None:
    """Every expected row appears in time, and every row maps to exactly one injection."""
    for e in expects:
        for t, slot, bits, latency in e.must:
            hits = [
                v
                for v in rows
                if v.kernel_kind == t and v.slot_idx == slot and v.fail_reason_bits & bits
                and 0 <= v.step_when_pumped - e.record.step <= latency
            ]  # fmt: skip
            assert hits, f"no {t.name} row with bits {bits} at slot {slot} for {e.record}"
    for key, v in dedupe(rows).items():
        owners = [e for e in expects if e.matches(v)]
        assert len(owners) == 1, f"row {key} maps to {len(owners)} injections: {v.message}"
