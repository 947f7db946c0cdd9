"""Front door: tokenize, KV-cache-aware routing, SLO prediction, admission, failover."""

from conductor.config import ConductorConfig
from conductor.corrections import Correction
from conductor.detok import IncrementalText
from conductor.policy import POLICIES, Policy, admit, make_policy
from conductor.policy_types import (
    ClusterState,
    Decision,
    DecodeCandidate,
    Link,
    MissesObjectives,
    PrefillCandidate,
    Rejected,
    RequestInfo,
)
from conductor.server import Conductor

__all__ = [
    "POLICIES",
    "ClusterState",
    "Conductor",
    "ConductorConfig",
    "Correction",
    "Decision",
    "DecodeCandidate",
    "IncrementalText",
    "Link",
    "MissesObjectives",
    "Policy",
    "PrefillCandidate",
    "Rejected",
    "RequestInfo",
    "admit",
    "make_policy",
]
