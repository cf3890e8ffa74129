"""Where a run's events go: JSON lines (`--events`) and Prometheus counters (`--metrics-port`).

The event log is line-buffered and flushed per event, so a run killed by a signal keeps every
event written so far. It holds `start`, `config`, `injection`, `step`, `violation` and `end`.
The violations counter exists for every known (reason, launch tag) pair from the start, so a
clean run exports zeros rather than no series.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, fields, is_dataclass
from pathlib import Path
from typing import IO, Any

from prometheus_client import CollectorRegistry, Counter, start_http_server

from kvcanary.contract import (
    FailReason,
    Incident,
    LaunchTag,
    Violation,
    fail_reason_labels,
    tag_name,
)

__all__ = ["EventLog", "RunMetrics", "StepObserver", "jsonable"]


class EventLog:
    """Writes one JSON object per line, `{"event": NAME, ...}`, flushed as it is written."""

    def __init__(self, path: Path) -> None:
        self._file: IO[str] = path.open("w", encoding="utf-8", buffering=1)  # line-buffered

    def write(self, event: str, **fields: Any) -> None:
        """Write one event (values JSON cannot hold are written as their `str`)."""
        line = json.dumps({"event": event, **fields}, separators=(",", ":"), default=str)
        self._file.write(line + "\n")
        self._file.flush()

    def close(self) -> None:
        """Flush and close the file."""
        self._file.close()


class RunMetrics:
    """Prometheus counters of one run, on their own registry (served when a port is given)."""

    def __init__(self, port: int | None = None, *, addr: str = "0.0.0.0") -> None:
        self.registry = CollectorRegistry()
        self.steps = Counter("kvcanary_steps", "Engine steps", registry=self.registry)
        self.protected = Counter(
            "kvcanary_protected_slot_checks",
            "Slot verify and write entries",
            registry=self.registry,
        )
        self.sweeps = Counter(
            "kvcanary_sweep_passes", "Prefix-cache sweeps", registry=self.registry
        )
        self.violations = Counter(
            "kvcanary_violations", "Violations by reason and launch tag", ["reason", "launch_tag"],
            registry=self.registry,
        )  # fmt: skip
        self.incidents = Counter(
            "kvcanary_incidents", "Incidents handed to the engine (mode recover) by stage and tag",
            ["stage", "launch_tag"], registry=self.registry,
        )  # fmt: skip
        for tag in LaunchTag:
            for reason in FailReason:
                self.violations.labels(reason.label, tag.name)  # 0 from the start
        self._server: Any = None
        #: the port served (the OS picks a free one for port 0); None when not serving
        self.port: int | None = None
        if port is not None:  # OSError when the port is in use or not allowed
            self._server, _ = start_http_server(port, addr=addr, registry=self.registry)
            self.port = int(self._server.server_port)

    def close(self) -> None:
        """Stop serving."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class StepObserver:
    """Feeds the event log and the metrics after every engine step."""

    def __init__(self, events: EventLog | None = None, metrics: RunMetrics | None = None) -> None:
        self.events = events
        self.metrics = metrics
        self._protected = 0
        self._sweeps = 0

    def on_step(
        self,
        *,
        step: int,
        stats: dict[str, int],
        protected: int,
        sweeps: int,
        violations: list[Violation],
        injections: Sequence[Any] = (),
        incidents: list[Incident] | None = None,
    ) -> None:
        """Record one step: the faults injected in it, its summary, each violation and each
        incident (mode `recover`, one JSON object per incident: `{"event": "incident", ...}`)."""
        for incident in incidents or ():
            if self.events is not None:
                self.events.write("incident", **incident.as_json())
            if self.metrics is not None:
                self.metrics.incidents.labels(incident.stage, incident.tag_name).inc()
        if self.events is not None:
            for inj in injections:
                self.events.write("injection", engine_step=step, **_fields(inj))
        for v in violations:
            labels = fail_reason_labels(v.fail_reason_bits)
            if self.events is not None:
                self.events.write(
                    "violation", step=step, launch_tag=tag_name(v.kernel_kind), reasons=labels,
                    **{k: val for k, val in asdict(v).items() if k != "message"},
                )  # fmt: skip
            if self.metrics is not None:
                for label in labels:
                    self.metrics.violations.labels(label, tag_name(v.kernel_kind)).inc()
        if self.events is not None:
            self.events.write("step", step=step, protected_slot_checks=protected, sweep_passes=sweeps,
                              violations=len(violations), **stats)  # fmt: skip
        if self.metrics is not None:
            self.metrics.steps.inc()
            self.metrics.protected.inc(protected - self._protected)
            self.metrics.sweeps.inc(sweeps - self._sweeps)
        self._protected, self._sweeps = protected, sweeps

    def event(self, event: str, **fields: Any) -> None:
        """Write one non-step event (start, config, end) when there is an event log."""
        if self.events is not None:
            self.events.write(event, **{k: jsonable(v) for k, v in fields.items()})

    def close(self) -> None:
        """Close the event log and stop serving metrics."""
        if self.events is not None:
            self.events.close()
        if self.metrics is not None:
            self.metrics.close()


def _fields(record: Any) -> dict[str, Any]:
    """A dataclass record as JSON-ready fields."""
    value = jsonable(record)
    return value if isinstance(value, dict) else {"record": value}


def jsonable(value: Any) -> Any:
    """Dataclasses, enums and mappings as plain JSON values (anything else: itself or `str`)."""
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)
