"""The output check every transfer run ends with: finished requests against the no-cache
reference (tiny model: `engine.reference.greedy_reference`) or the token oracle (oracle model).

Built from `RunSettings` alone, so a parent process can check outputs that a decode engine in
another process produced.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvcanary.app.session import RunSettings
from kvcanary.app.workload import PlannedRequest
from kvcanary.contract import TokenOracle, request_key
from kvcanary.engine.model import TinyLlama
from kvcanary.engine.reference import greedy_reference

__all__ = ["OutputCheck", "ReferenceOutputs"]


@dataclass(frozen=True, slots=True)
class OutputCheck:
    """Finished requests compared with the reference."""

    compared: int
    mismatched: tuple[str, ...]

    @property
    def identical(self) -> bool:
        """Every finished request matched."""
        return not self.mismatched


class ReferenceOutputs:
    """What each request must return with no cache at all."""

    def __init__(self, settings: RunSettings) -> None:
        """The model of `settings` (same weights seed), or its token oracle."""
        self._oracle = (
            TokenOracle(settings.model.vocab_size) if settings.model_kind == "oracle" else None
        )
        self._model = TinyLlama(settings.model) if self._oracle is None else None

    def expected(self, p: PlannedRequest) -> tuple[int, ...]:
        """The `max_new_tokens` tokens that follow `p.prompt`."""
        if self._oracle is not None:
            key = request_key(p.request_id)
            return tuple(
                self._oracle.token(key, len(p.prompt) + j) for j in range(p.max_new_tokens)
            )
        assert self._model is not None
        return tuple(greedy_reference(self._model, p.prompt, p.max_new_tokens))

    def check(
        self, planned: Iterable[PlannedRequest], outputs: dict[str, tuple[int, ...]]
    ) -> OutputCheck:
        """Compare `outputs` (finished requests only) with the reference."""
        compared, bad = 0, []
        for p in planned:
            got = outputs.get(p.request_id)
            if got is None:
                continue
            compared += 1
            if got != self.expected(p):
                bad.append(p.request_id)
        return OutputCheck(compared, tuple(bad))
