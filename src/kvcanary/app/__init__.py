"""Composition root: wires the reference engine and the canary for the CLI, examples and tests."""

from kvcanary.app.session import RunSettings, RunSummary, Stack, build_stack, run_session
from kvcanary.app.workload import WorkloadSpec, build_workload

__all__ = [
    "RunSettings",
    "RunSummary",
    "Stack",
    "WorkloadSpec",
    "build_stack",
    "build_workload",
    "run_session",
]
