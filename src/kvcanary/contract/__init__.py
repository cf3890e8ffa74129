"""The engine-neutral interface between a serving engine and the canary (SPEC §2).

Stdlib and torch only. Engines build `ForwardView`s and `BufferGroupSpec`s and drive a
`CanaryHooks`; the canary implements `CanaryHooks`. Neither side imports the other.

The names below load on first access (PEP 562), not when a submodule is imported: the canary's
kernels use `contract.oracle` alone and must not pay for importing torch (`contract.groups`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvcanary.contract.errors import CanaryContractError
    from kvcanary.contract.groups import (
        MAX_SOURCES_PER_HALF,
        BufferGroupSpec,
        GroupKind,
        RealKvSource,
    )
    from kvcanary.contract.hooks import CanaryHooks, NullHooks
    from kvcanary.contract.incident import Incident, IncidentRow, IncidentSource
    from kvcanary.contract.oracle import TokenOracle, request_key, splitmix64
    from kvcanary.contract.tags import FailReason, LaunchTag, fail_reason_labels, tag_name
    from kvcanary.contract.transfer import (
        NullSidecars,
        SidecarRecords,
        SidecarTransfer,
        layered_transfer_order,
    )
    from kvcanary.contract.view import ExpectedInputs, ForwardView, TruthTable
    from kvcanary.contract.violation import Violation
    from kvcanary.contract.walker import PrefixCacheWalker, walk_node_slots

#: public name -> the submodule that defines it
_HOMES = {
    "BufferGroupSpec": "groups",
    "CanaryContractError": "errors",
    "CanaryHooks": "hooks",
    "ExpectedInputs": "view",
    "FailReason": "tags",
    "ForwardView": "view",
    "GroupKind": "groups",
    "Incident": "incident",
    "IncidentRow": "incident",
    "IncidentSource": "incident",
    "LaunchTag": "tags",
    "MAX_SOURCES_PER_HALF": "groups",
    "NullHooks": "hooks",
    "NullSidecars": "transfer",
    "PrefixCacheWalker": "walker",
    "RealKvSource": "groups",
    "SidecarRecords": "transfer",
    "SidecarTransfer": "transfer",
    "TokenOracle": "oracle",
    "TruthTable": "view",
    "Violation": "violation",
    "fail_reason_labels": "tags",
    "layered_transfer_order": "transfer",
    "request_key": "oracle",
    "splitmix64": "oracle",
    "tag_name": "tags",
    "walk_node_slots": "walker",
}

__all__ = [
    "MAX_SOURCES_PER_HALF",
    "BufferGroupSpec",
    "CanaryContractError",
    "CanaryHooks",
    "ExpectedInputs",
    "FailReason",
    "ForwardView",
    "GroupKind",
    "Incident",
    "IncidentRow",
    "IncidentSource",
    "LaunchTag",
    "NullHooks",
    "NullSidecars",
    "PrefixCacheWalker",
    "RealKvSource",
    "SidecarRecords",
    "SidecarTransfer",
    "TokenOracle",
    "TruthTable",
    "Violation",
    "fail_reason_labels",
    "layered_transfer_order",
    "request_key",
    "splitmix64",
    "tag_name",
    "walk_node_slots",
]
assert sorted(__all__) == sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))
