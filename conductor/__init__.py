"""Front door: tokenize, KV-cache-aware routing, SLO prediction, admission, failover."""

from conductor.config import ConductorConfig
from conductor.detok import IncrementalText
from conductor.policy import (
    POLICIES,
    ClusterState,
    Decision,
    DecodeCandidate,
    Link,
    Policy,
    PrefillCandidate,
    Rejected,
    RequestInfo,
    make_policy,
)


def __getattr__(name: str):
    # The server pulls in the store client; policy users (simulators, workers) need not import it.
    if name == "Conductor":
        from conductor.server import Conductor

        return Conductor
    raise AttributeError(name)


__all__ = [
    "POLICIES",
    "ClusterState",
    "Conductor",
    "ConductorConfig",
    "Decision",
    "DecodeCandidate",
    "IncrementalText",
    "Link",
    "Policy",
    "PrefillCandidate",
    "Rejected",
    "RequestInfo",
    "make_policy",
]
