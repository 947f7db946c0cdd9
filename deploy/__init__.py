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
from deploy.launcher import Cluster
from deploy.local import LocalCluster, ServerProcess
from deploy.placement import NodeView, Placement, node_views, place_workers
from deploy.wiring import ServerInfo, Wiring

__all__ = [
    "DEFAULT_CONFIG",
    "ROLES",
    "ClusterConfig",
    "PlacementConfig",
    "RayConfig",
    "cluster_config_from_dict",
    "load_cluster_config",
    "parse_overrides",
    "Cluster",
    "LocalCluster",
    "ServerProcess",
    "ServerInfo",
    "Wiring",
    "ServerActor",
    "wait_healthy",
    "NodeView",
    "Placement",
    "node_views",
    "place_workers",
]
