"""Front door: tokenize, KV-cache-aware routing, SLO prediction, admission, failover."""

from conductor.config import ConductorConfig
from conductor.detok import IncrementalText
from conductor.policy import (
    POLICIES,
    ClusterState,
    Decision,
    DecodeCandidate,
    Policy,
    PrefillCandidate,
    Rejected,
    RequestInfo,
    blocks_needed,
    make_policy,
    reusable_blocks,
)
from conductor.serverkit import GrpcServer, config_from_dict, config_from_yaml
from conductor.timing import DecodeTimeModel, LinearTimeModel, PrefillTimeModel


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
    "DecodeTimeModel",
    "GrpcServer",
    "IncrementalText",
    "LinearTimeModel",
    "Policy",
    "PrefillCandidate",
    "PrefillTimeModel",
    "Rejected",
    "RequestInfo",
    "blocks_needed",
    "config_from_dict",
    "config_from_yaml",
    "make_policy",
    "reusable_blocks",
]
