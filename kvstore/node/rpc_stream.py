"""The store node's streamed gRPC data calls: Get sends blocks' bytes in the reply stream, Put
takes them in the request stream. What clients on other hosts use when the bulk port is off, and
the path any client can fall back to."""

from __future__ import annotations

import time
from collections.abc import Generator, Iterator
from typing import TYPE_CHECKING

import grpc

from kvstore.bulk import Pacer
from kvstore.node.rpc_writes import Writes, abort
from kvstore.wire import BadChunk, Part, RawPutData, get_chunk
from protos import kvstore_pb2 as pb

if TYPE_CHECKING:  # the node owns its servicer: only the type goes the other way
    from kvstore.node.server import StoreNode

GetMessage = pb.KVGetChunk | bytes  # the first message is a KVGetChunk, the rest pre-serialized
PutMessage = pb.KVPutChunk | RawPutData | BadChunk  # as kvstore.wire.parse_put_chunk makes them


class StreamRpcs:
    """Get and Put of `node`, with its leases, checks and transfer metrics."""

    def __init__(self, node: StoreNode, writes: Writes):
        self.node, self.store, self.cfg, self.writes = node, node.store, node.cfg, writes

    def Get(self, req: pb.KVGetRequest, ctx: grpc.ServicerContext) -> Iterator[GetMessage]:
        inner = self._get(req)
        try:
            yield from self._paced(inner)
        finally:
            inner.close()  # a cancelled stream still releases its lease

    def _paced(self, messages: Iterator[GetMessage]) -> Iterator[GetMessage]:
        """Yield `messages` no faster than the node's link_gbps (read per message, so a change
        takes effect mid-stream)."""
        pacer = Pacer(lambda: self.node.link_gbps)
        for msg in messages:
            pacer.wait(len(msg) if isinstance(msg, bytes) else msg.ByteSize())
            yield msg

    def _get(self, req: pb.KVGetRequest) -> Generator[GetMessage, None, None]:
        t0 = time.perf_counter()
        lease_id, refs = self.store.acquire(list(req.keys), self.cfg.lease_s)
        self.node.publish_soon()
        sent = 0
        try:
            headed = self.store.read_headed(refs)
            views, headers = [memoryview(v) for v, _ in headed], [h for _, h in headed]
            yield pb.KVGetChunk(
                headers=[bytes(v[: h.header_len]) for v, h in zip(views, headers)],
                tiers=[r.tier for r in refs[: len(headers)]],
            )
            chunk = self.cfg.chunk_bytes
            parts, size = [], 0
            for layer in range(max((h.num_layers for h in headers), default=0)):
                for b, (view, h) in enumerate(zip(views, headers)):
                    if layer >= h.num_layers:
                        continue
                    start = h.layer_offset(layer)
                    end = start + h.layer_bytes
                    while start < end:
                        n = min(end - start, chunk - size)
                        # views into the leased slab range: the message is built by one copy
                        parts.append(Part(b, layer, start, view[start : start + n]))
                        size += n
                        start += n
                        if size >= chunk:
                            yield get_chunk(parts)
                            sent += size
                            parts, size = [], 0
            if parts:
                yield get_chunk(parts)
                sent += size
        finally:
            if lease_id:
                self.store.release(lease_id)
                self.node.publish_soon()
            self.node.metrics.record("get", "grpc", sent, time.perf_counter() - t0)

    def Put(
        self, request_iterator: Iterator[PutMessage], ctx: grpc.ServicerContext
    ) -> pb.KVPutReply:
        t0 = time.perf_counter()
        first = next(request_iterator, None)
        if isinstance(first, BadChunk):
            abort(ctx, grpc.StatusCode.INVALID_ARGUMENT, first.reason)
        if first is None or isinstance(first, RawPutData) or first.WhichOneof("kind") != "open":
            abort(ctx, grpc.StatusCode.INVALID_ARGUMENT, "a put stream must start with `open`")
        op = first.open
        keys, sizes = list(op.keys), list(op.sizes)
        self.writes.check(ctx, keys, sizes, op.model_fingerprint)
        lease_id, slots = self.writes.reserve(ctx, keys, sizes, op.parent)
        where = dict(slots)
        # no dram tier: no slots, so nothing is written through the empty view
        view = self.node.slab.view if self.node.slab else memoryview(b"")
        done, received = False, 0
        try:
            for msg in request_iterator:
                # The stream is alive: keep its reservation
                # (a lapsed one may be reused by another put).
                if slots and not self.store.renew(lease_id, self.cfg.lease_s):
                    abort(
                        ctx, grpc.StatusCode.ABORTED, "the put's reservation lapsed; nothing stored"
                    )
                if isinstance(msg, BadChunk):
                    abort(ctx, grpc.StatusCode.INVALID_ARGUMENT, msg.reason)
                if isinstance(msg, RawPutData):
                    for p in msg.parts:
                        if (
                            not 0 <= p.block < len(keys)
                            or p.offset < 0
                            or p.offset + len(p.data) > sizes[p.block]
                        ):
                            abort(
                                ctx,
                                grpc.StatusCode.INVALID_ARGUMENT,
                                f"data for block {p.block} at {p.offset}+{len(p.data)} "
                                "is outside the block",
                            )
                        off = where.get(p.block)
                        if off is not None:  # blocks already held are not rewritten
                            view[off + p.offset : off + p.offset + len(p.data)] = p.data
                            received += len(p.data)
                    continue
                kind = msg.WhichOneof("kind")
                if kind != "commit":
                    abort(
                        ctx,
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"unexpected `{kind}` in a put stream",
                    )
                headers = list(msg.commit.headers)
                if len(headers) != len(keys):
                    abort(
                        ctx,
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"{len(headers)} headers for {len(keys)} blocks",
                    )
                for i, off in slots:
                    if len(headers[i]) > sizes[i]:
                        abort(
                            ctx,
                            grpc.StatusCode.INVALID_ARGUMENT,
                            f"header of block {i} is longer than the block",
                        )
                    view[off : off + len(headers[i])] = headers[i]
                reply = (
                    self.writes.commit(ctx, lease_id, keys)
                    if slots
                    else pb.KVPutReply(stored=0, held=self.store.count_held(keys))
                )
                done = True
                self.node.metrics.record("put", "grpc", received, time.perf_counter() - t0)
                return reply
            abort(
                ctx,
                grpc.StatusCode.INVALID_ARGUMENT,
                "put stream ended without `commit`; nothing stored",
            )
        finally:
            if not done and slots:
                self.store.release(lease_id)
