"""The store node's small unary data calls: Lookup, and the shared-memory path's Lease, Release
and Commit. On that path a client on the node's host copies blocks' bytes straight from or into
the node's slab (the file at shm_path), and these calls only hand out and take back the ranges."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from kvstore.node.rpc_writes import Writes, abort
from protos import kvstore_pb2 as pb

if TYPE_CHECKING:  # the node owns its servicer: only the type goes the other way
    from kvstore.node.server import StoreNode


class ShmRpcs:
    """Lookup, Lease, Release and Commit of `node`."""

    def __init__(self, node: StoreNode, writes: Writes):
        self.node, self.store, self.cfg, self.writes = node, node.store, node.cfg, writes
        self._shm_path = node.slab.path if node.slab else ""

    def Lookup(self, req: pb.KVLookupRequest, ctx: grpc.ServicerContext) -> pb.KVLookupReply:
        found = self.store.lookup_sizes(list(req.keys))
        return pb.KVLookupReply(
            num_blocks=len(found), tiers=[t for t, _ in found], sizes=[n for _, n in found]
        )

    def Lease(self, req: pb.KVLeaseRequest, ctx: grpc.ServicerContext) -> pb.KVLeaseReply:
        if req.mode == pb.KVLeaseRequest.READ:
            return self._read_lease(req)
        if req.mode == pb.KVLeaseRequest.WRITE:
            return self._write_lease(req, ctx)
        if req.mode == pb.KVLeaseRequest.RENEW:
            if not self.store.renew(req.lease_id, self.cfg.lease_s):
                abort(
                    ctx,
                    grpc.StatusCode.NOT_FOUND,
                    f"lease {req.lease_id} is not held (expired or released)",
                )
            return pb.KVLeaseReply(lease_id=req.lease_id, ttl_s=self.cfg.lease_s)
        abort(ctx, grpc.StatusCode.INVALID_ARGUMENT, f"unknown lease mode {req.mode}")

    def _read_lease(self, req: pb.KVLeaseRequest) -> pb.KVLeaseReply:
        lease_id, refs = self.store.acquire(list(req.keys), self.cfg.lease_s)
        self.node.publish_soon()
        self.node.metrics.record("get", "shm", sum(r.length for r in refs))
        if req.packed and all(r.data is None for r in refs):
            return pb.KVLeaseReply(
                lease_id=lease_id,
                ttl_s=self.cfg.lease_s,
                shm_path=self._shm_path,
                indices=range(len(refs)),
                offsets=[r.offset for r in refs],
                lengths=[r.length for r in refs],
                tiers=[r.tier for r in refs],
            )
        return pb.KVLeaseReply(
            lease_id=lease_id,
            ttl_s=self.cfg.lease_s,
            shm_path=self._shm_path,
            slots=[
                pb.KVBlockSlot(
                    index=i, offset=r.offset, length=r.length, tier=r.tier, data=r.data or b""
                )
                for i, r in enumerate(refs)
            ],
        )

    def _write_lease(self, req: pb.KVLeaseRequest, ctx: grpc.ServicerContext) -> pb.KVLeaseReply:
        keys, sizes = list(req.keys), list(req.sizes)
        self.writes.check(ctx, keys, sizes, req.model_fingerprint)
        lease_id, slots = self.writes.reserve(ctx, keys, sizes, req.parent)
        self.node.publish_soon()  # a reservation may have evicted blocks
        if req.packed:
            return pb.KVLeaseReply(
                lease_id=lease_id if slots else 0,
                ttl_s=self.cfg.lease_s,
                shm_path=self._shm_path,
                indices=[i for i, _ in slots],
                offsets=[off for _, off in slots],
                lengths=[sizes[i] for i, _ in slots],
            )
        return pb.KVLeaseReply(
            lease_id=lease_id if slots else 0,
            ttl_s=self.cfg.lease_s,
            shm_path=self._shm_path,
            slots=[
                pb.KVBlockSlot(index=i, offset=off, length=sizes[i], tier="dram")
                for i, off in slots
            ],
        )

    def Release(self, req: pb.KVReleaseRequest, ctx: grpc.ServicerContext) -> pb.KVReleaseReply:
        released = self.store.release(req.lease_id, list(req.corrupt))
        self.node.publish_soon()
        return pb.KVReleaseReply(released=released)

    def Commit(self, req: pb.KVCommitRequest, ctx: grpc.ServicerContext) -> pb.KVPutReply:
        try:
            pending = self.store.pending(req.lease_id)
        except KeyError:
            abort(
                ctx,
                grpc.StatusCode.NOT_FOUND,
                f"no open write lease {req.lease_id} (expired or never granted)",
            )
        reply = self.writes.commit(
            ctx, req.lease_id, [k for k, _, _ in pending], payloads=not req.writer_hashed
        )
        self.node.metrics.record("put", "shm", sum(s for _, _, s in pending))
        return reply
