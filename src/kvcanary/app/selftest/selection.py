"""What a self-test campaign runs, from the words of its command line: shared by
`kvcanary selftest` (modes and plants) and `kvcanary selftest --transfers` (faults and places)."""

from __future__ import annotations

from kvcanary.app.selftest.transfers import PLACES
from kvcanary.engine.transfer_faults import TRANSFER_FAULT_NAMES, validate_transfer_faults

__all__ = ["parse_names", "transfer_selection"]


def parse_names(value: str, known: tuple[str, ...]) -> tuple[str, ...]:
    """`all` -> every name of `known`; `none` or empty -> none; else the comma-separated names
    (lower-cased, stripped; the campaign checks them against `known`)."""
    word = value.strip().lower()
    if word == "all":
        return known
    if word in ("none", ""):
        return ()
    return tuple(n.strip() for n in word.split(",") if n.strip())


def transfer_selection(modes: str, places: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The transfer faults and places `--modes` and `--places` name (one-line ValueError)."""
    faults = parse_names(modes, TRANSFER_FAULT_NAMES)
    validate_transfer_faults(faults)
    where = parse_names(places, tuple(PLACES))
    bad = [p for p in where if p not in PLACES]
    if bad:
        raise ValueError(f"--places: unknown place {bad[0]!r}; choose from host, disagg")
    if not where:
        raise ValueError(f"--places {places!r} leaves nothing to test; pass --places host,disagg")
    return faults, where
