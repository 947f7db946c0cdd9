"""The store node's administrative gRPC calls: Stats, Clear and Info. Off the data path: what an
operator, the conductor's StoreControl or a client's start-up asks."""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING

import grpc

from kvstore.types import boot_id
from protos import kvstore_pb2 as pb
from servekit.memory import memory_usage

if TYPE_CHECKING:  # the node owns its servicer: only the type goes the other way
    from kvstore.node.server import StoreNode


class AdminRpcs:
    """Stats, Clear and Info of `node`."""

    def __init__(self, node: StoreNode):
        self.node, self.store, self.cfg = node, node.store, node.cfg

    def Stats(self, req: pb.KVStatsRequest, ctx: grpc.ServicerContext) -> pb.KVStatsReply:
        s = self.store.stats()
        mem = memory_usage()
        return pb.KVStatsReply(
            rss_bytes=mem.rss,
            uss_bytes=mem.uss,
            pss_bytes=mem.pss,
            # what it is configured to hold in memory: its tiers but the SSD
            configured_bytes=sum(t.capacity_bytes for t in s.tiers if t.tier != "ssd"),
            node_id=s.node_id,
            hits=s.hits,
            misses=s.misses,
            promotions=s.promotions,
            demotions=s.demotions,
            leases=s.leases,
            pending_blocks=s.pending_blocks,
            tiers=[
                pb.KVTierStats(
                    tier=t.tier,
                    used_bytes=t.used_bytes,
                    capacity_bytes=t.capacity_bytes,
                    blocks=t.blocks,
                    hits=t.hits,
                    evictions=t.evictions,
                )
                for t in s.tiers
            ],
        )

    def Clear(self, req: pb.KVClearRequest, ctx: grpc.ServicerContext) -> pb.KVClearReply:
        dropped, deferred = self.store.clear()
        # an administrative call, not the data path: the index hears of it before the reply
        self.node.flush()
        return pb.KVClearReply(dropped=dropped, deferred=deferred)

    def Info(self, req: pb.KVInfoRequest, ctx: grpc.ServicerContext) -> pb.KVInfoReply:
        n = self.node
        return pb.KVInfoReply(
            node_id=self.cfg.node_id,
            hostname=socket.gethostname(),
            boot_id=boot_id(),
            shm_path=n.slab.path if n.slab else "",
            shm_size=n.slab.size if n.slab else 0,
            model_fingerprint=self.cfg.model_fingerprint,
            max_message_bytes=self.cfg.max_message_bytes,
            chunk_bytes=self.cfg.chunk_bytes,
            lease_s=self.cfg.lease_s,
            bulk_port=n.bulk_port,
        )
