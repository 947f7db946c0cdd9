"""Small result types shared by the store's client, node and index."""

from __future__ import annotations

from typing import NamedTuple


class LookupResult(NamedTuple):
    num_blocks: int  # leading keys held
    tiers: list[str]  # tier of each held block: device | dram | ssd
    sizes: tuple[int, ...] = ()  # encoded bytes of each held block (what fetching it moves)


class NodeInfo(NamedTuple):
    node_id: str
    address: str  # gRPC address HOST:PORT
    host: str  # host the node runs on (hostname)
    shm_path: str  # its dram slab's file ("" = none)
    dram_bytes: int  # dram tier capacity
    ssd_bytes: int  # ssd tier capacity
    model_fingerprint: str  # "" = accepts any
    started_at: float  # unix time the node started
