"""The engine-neutral interface between a serving engine and the canary (SPEC §2).

Stdlib and torch only. Engines build `ForwardView`s and `BufferGroupSpec`s and drive a
`CanaryHooks`; the canary implements `CanaryHooks`. Neither side imports the other.
"""

from kvcanary.contract.errors import CanaryContractError
from kvcanary.contract.groups import MAX_SOURCES_PER_HALF, BufferGroupSpec, GroupKind, RealKvSource
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
