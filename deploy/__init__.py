"""Ray launcher, cluster configs and manifests."""

from deploy.actor import ServerActor, wait_healthy
from deploy.config import (
    DEFAULT_CONFIG,
    ROLES,
    ClusterConfig,
    PlacementConfig,
    RayConfig,
    cluster_config_from_dict,
    load_cluster_config,
    parse_overrides,
)
from deploy.launcher import Cluster, ServerInfo
from deploy.placement import NodeView, Placement, node_views, place_workers

__all__ = [
    "DEFAULT_CONFIG", "ROLES", "ClusterConfig", "PlacementConfig", "RayConfig", "cluster_config_from_dict",
    "load_cluster_config", "parse_overrides",
    "Cluster", "ServerInfo", "ServerActor", "wait_healthy",
    "NodeView", "Placement", "node_views", "place_workers",
]
