"""Which Ray node each server goes to, and what it asks Ray for there (a pure function of the
nodes)."""

from __future__ import annotations

from typing import NamedTuple


class NodeView(NamedTuple):
    """A live Ray node, as placement sees it."""

    node_id: str  # Ray's node id (hex)
    ip: str  # the address its servers advertise when the host is "auto"
    resources: dict[str, float]  # total resources it advertises (CPU, GPU, custom)


class Placement(NamedTuple):
    """Where one actor goes and what it reserves."""

    node_id: str
    ip: str
    num_gpus: float  # 0 on a node without GPUs
    resources: dict[str, float]  # custom resources to reserve (the role's, where the node has it)


def node_views(ray_nodes: list[dict]) -> list[NodeView]:
    """Live nodes from `ray.nodes()`, head first as Ray lists them."""
    return [
        NodeView(n["NodeID"], n.get("NodeManagerAddress", ""), dict(n.get("Resources", {})))
        for n in ray_nodes
        if n.get("Alive", False)
    ]


def place_workers(
    nodes: list[NodeView], count: int, resource: str, resource_amount: float, gpus_per_worker: float
) -> list[Placement]:
    """Round-robin over the nodes that advertise `resource`, or over every node when none does.

    A worker asks for a GPU (`gpus_per_worker`) where its node has one, so Ray binds it to that GPU.
    """
    if not nodes:
        raise RuntimeError("no live Ray nodes to place workers on")
    tagged = [n for n in nodes if resource and n.resources.get(resource, 0) > 0]
    pool = tagged or nodes
    out = []
    for i in range(count):
        n = pool[i % len(pool)]
        gpus = gpus_per_worker if n.resources.get("GPU", 0) > 0 else 0.0
        res = {resource: resource_amount} if tagged else {}
        out.append(Placement(n.node_id, n.ip, gpus, res))
    return out
