"""Where a run's events go: JSON lines (`--events`) and Prometheus counters (`--metrics-port`)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import IO, Any

from prometheus_client import CollectorRegistry, Counter, start_http_server

from kvcanary.contract import Incident, Violation, fail_reason_labels, tag_name

__all__ = ["EventLog", "RunMetrics", "StepObserver"]


class EventLog:
    """Appends one JSON object per line: `{"event": "violation", ...}` or `{"event": "step", ...}`."""

    def __init__(self, path: Path) -> None:
        self._file: IO[str] = path.open("w", encoding="utf-8")

    def write(self, event: str, **fields: Any) -> None:
        """Write one event."""
        self._file.write(json.dumps({"event": event, **fields}, separators=(",", ":")) + "\n")

    def close(self) -> None:
        """Flush and close the file."""
        self._file.close()


class RunMetrics:
    """Prometheus counters of one run, on their own registry (served when a port is given)."""

    def __init__(self, port: int | None = None) -> None:
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
        if port is not None:
            start_http_server(port, registry=self.registry)


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
        incidents: list[Incident] | None = None,
    ) -> None:
        """Record one step: its summary, each violation it reported and each incident (mode
        `recover`, one JSON object per incident: `{"event": "incident", ...}`)."""
        for incident in incidents or ():
            if self.events is not None:
                self.events.write("incident", **incident.as_json())
            if self.metrics is not None:
                self.metrics.incidents.labels(incident.stage, incident.tag_name).inc()
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

    def close(self) -> None:
        """Close the event log."""
        if self.events is not None:
            self.events.close()
