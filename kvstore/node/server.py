"""StoreNode: one host's store (dram slab + ssd) served over gRPC, published to the global index."""

from __future__ import annotations

import logging
import socket
import threading
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvstore.block_header import BlockCorrupt
from kvstore.bulk import Pacer
from kvstore.index import Index
from kvstore.index_publisher import IndexPublisher
from kvstore.node.bulk_server import BulkServer
from kvstore.node.config import StoreConfig
from kvstore.node.metrics import StoreMetrics
from kvstore.node.ssd import SsdTier
from kvstore.node.store import BlockStore
from kvstore.slab import ShmSlab, remove_stale
from kvstore.types import NodeInfo, StoreFull, boot_id, grpc_options, write_problem
from kvstore.wire import BadChunk, Part, RawPutData, add_servicer, get_chunk
from protos import kvstore_pb2 as pb
from servekit.call_limit import CONTROL_THREADS, CallLimit
from servekit.memory import memory_usage
from servekit.security import add_port, server_interceptors

log = logging.getLogger(__name__)
SERVICE = "halfmoon.KVStore"


class _Servicer:
    def __init__(self, node: StoreNode):
        self.node = node
        self.store = node.store
        self.cfg = node.cfg
        self._shm_path = node.slab.path if node.slab else ""

    # ------------------------------------------------------------------ checks

    def _check_write(self, ctx, keys, sizes, fingerprint: str) -> None:
        problem = write_problem(keys, sizes, fingerprint, self.cfg.model_fingerprint)
        if problem:
            ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)

    def _reserve(self, ctx, keys, sizes, parent: bytes):
        parents = [parent or None] + list(keys[:-1])
        try:
            return self.store.reserve(list(keys), list(sizes), parents, self.cfg.lease_s)
        except StoreFull as e:
            ctx.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))

    def _commit(self, ctx, lease_id: int, keys, payloads: bool = True) -> pb.KVPutReply:
        try:
            stored = self.store.commit(lease_id, payloads=payloads)
        except BlockCorrupt as e:
            ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, f"block refused: {e}")
        except KeyError as e:
            ctx.abort(grpc.StatusCode.NOT_FOUND, str(e).strip("'\""))
        self.node.publish_soon()
        return pb.KVPutReply(stored=stored, held=self.store.count_held(list(keys)))

    # ------------------------------------------------------------------ RPCs

    def Lookup(self, req, ctx):
        found = self.store.lookup_sizes(list(req.keys))
        return pb.KVLookupReply(
            num_blocks=len(found), tiers=[t for t, _ in found], sizes=[n for _, n in found]
        )

    def Get(self, req, ctx):
        inner = self._get(req)
        try:
            yield from self._paced(inner)
        finally:
            inner.close()  # a cancelled stream still releases its lease

    def _paced(self, messages):
        """Yield `messages` no faster than the node's link_gbps (read per message, so a change
        takes effect mid-stream)."""
        pacer = Pacer(lambda: self.node.link_gbps)
        for msg in messages:
            pacer.wait(len(msg) if isinstance(msg, bytes) else msg.ByteSize())
            yield msg

    def _get(self, req):
        t0 = time.perf_counter()
        lease_id, refs = self.store.acquire(list(req.keys), self.cfg.lease_s)
        self.node.publish_soon()
        sent = 0
        try:
            headed = self.store.read_headed(refs)
            views, headers = [v for v, _ in headed], [h for _, h in headed]
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

    def Put(self, request_iterator, ctx):
        t0 = time.perf_counter()
        first = next(request_iterator, None)
        if isinstance(first, BadChunk):
            ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, first.reason)
        if first is None or isinstance(first, RawPutData) or first.WhichOneof("kind") != "open":
            ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, "a put stream must start with `open`")
        op = first.open
        keys, sizes = list(op.keys), list(op.sizes)
        self._check_write(ctx, keys, sizes, op.model_fingerprint)
        lease_id, slots = self._reserve(ctx, keys, sizes, op.parent)
        where = dict(slots)
        view = self.node.slab.view if self.node.slab else None
        done, received = False, 0
        try:
            for msg in request_iterator:
                # The stream is alive: keep its reservation
                # (a lapsed one may be reused by another put).
                if slots and not self.store.renew(lease_id, self.cfg.lease_s):
                    ctx.abort(
                        grpc.StatusCode.ABORTED, "the put's reservation lapsed; nothing stored"
                    )
                if isinstance(msg, BadChunk):
                    ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, msg.reason)
                kind = "data" if isinstance(msg, RawPutData) else msg.WhichOneof("kind")
                if kind == "data":
                    for p in msg.parts:
                        if (
                            not 0 <= p.block < len(keys)
                            or p.offset < 0
                            or p.offset + len(p.data) > sizes[p.block]
                        ):
                            ctx.abort(
                                grpc.StatusCode.INVALID_ARGUMENT,
                                f"data for block {p.block} at {p.offset}+{len(p.data)} "
                                "is outside the block",
                            )
                        off = where.get(p.block)
                        if off is not None:  # blocks already held are not rewritten
                            view[off + p.offset : off + p.offset + len(p.data)] = p.data
                            received += len(p.data)
                elif kind == "commit":
                    headers = list(msg.commit.headers)
                    if len(headers) != len(keys):
                        ctx.abort(
                            grpc.StatusCode.INVALID_ARGUMENT,
                            f"{len(headers)} headers for {len(keys)} blocks",
                        )
                    for i, off in slots:
                        if len(headers[i]) > sizes[i]:
                            ctx.abort(
                                grpc.StatusCode.INVALID_ARGUMENT,
                                f"header of block {i} is longer than the block",
                            )
                        view[off : off + len(headers[i])] = headers[i]
                    reply = (
                        self._commit(ctx, lease_id, keys)
                        if slots
                        else pb.KVPutReply(stored=0, held=self.store.count_held(keys))
                    )
                    done = True
                    self.node.metrics.record("put", "grpc", received, time.perf_counter() - t0)
                    return reply
                else:
                    ctx.abort(
                        grpc.StatusCode.INVALID_ARGUMENT, f"unexpected `{kind}` in a put stream"
                    )
            ctx.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "put stream ended without `commit`; nothing stored",
            )
        finally:
            if not done and slots:
                self.store.release(lease_id)

    def Lease(self, req, ctx):
        if req.mode == pb.KVLeaseRequest.READ:
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
        if req.mode == pb.KVLeaseRequest.WRITE:
            keys, sizes = list(req.keys), list(req.sizes)
            self._check_write(ctx, keys, sizes, req.model_fingerprint)
            lease_id, slots = self._reserve(ctx, keys, sizes, req.parent)
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
        if req.mode == pb.KVLeaseRequest.RENEW:
            if not self.store.renew(req.lease_id, self.cfg.lease_s):
                ctx.abort(
                    grpc.StatusCode.NOT_FOUND,
                    f"lease {req.lease_id} is not held (expired or released)",
                )
            return pb.KVLeaseReply(lease_id=req.lease_id, ttl_s=self.cfg.lease_s)
        ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown lease mode {req.mode}")

    def Release(self, req, ctx):
        released = self.store.release(req.lease_id, list(req.corrupt))
        self.node.publish_soon()
        return pb.KVReleaseReply(released=released)

    def Commit(self, req, ctx):
        try:
            pending = self.store.pending(req.lease_id)
        except KeyError:
            ctx.abort(
                grpc.StatusCode.NOT_FOUND,
                f"no open write lease {req.lease_id} (expired or never granted)",
            )
        reply = self._commit(
            ctx, req.lease_id, [k for k, _, _ in pending], payloads=not req.writer_hashed
        )
        self.node.metrics.record("put", "shm", sum(s for _, _, s in pending))
        return reply

    def Stats(self, req, ctx):
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

    def Clear(self, req, ctx):
        dropped, deferred = self.store.clear()
        # an administrative call, not the data path: the index hears of it before the reply
        self.node.flush()
        return pb.KVClearReply(dropped=dropped, deferred=deferred)

    def Info(self, req, ctx):
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


class StoreNode:
    """A store node: start() serves it and returns "HOST:PORT"; stop() ends it (shm unlinked)."""

    def __init__(self, cfg: StoreConfig):
        self.cfg = cfg
        self.slab: ShmSlab | None = None
        self.ssd: SsdTier | None = None
        self.index: Index | None = None
        self.publisher: IndexPublisher | None = None  # keeps the index current (with redis_url)
        self.server: grpc.Server | None = None
        self.address = ""
        self.bulk: BulkServer | None = None  # the bulk port (kvstore/bulk.py), unless turned off
        self.bulk_port = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.link_gbps = cfg.link_gbps
        try:
            if cfg.dram_bytes:
                for path in remove_stale(cfg.shm_dir):
                    log.warning(
                        "removed %s: a slab no live process maps (its node was killed)", path
                    )
                self.slab = ShmSlab.create(cfg.shm_dir, cfg.node_id, cfg.dram_bytes)
            if cfg.ssd_dir:
                self.ssd = SsdTier(cfg.ssd_dir, cfg.ssd_bytes)
            self.store = BlockStore(cfg.node_id, self.slab, self.ssd, cfg.model_fingerprint)
        except BaseException:
            self._close_tiers()
            raise
        self.metrics = StoreMetrics(self.store)

    def set_link_gbps(self, gbps: float) -> None:
        """Pace Get streams to `gbps` Gbit/s from their next message on (0 = unlimited)."""
        if gbps < 0:
            raise ValueError(f"link_gbps must be >= 0, got {gbps}")
        self.link_gbps = gbps

    @property
    def info(self) -> NodeInfo:
        return NodeInfo(
            self.cfg.node_id,
            self.address,
            socket.gethostname(),
            self.slab.path if self.slab else "",
            self.cfg.dram_bytes,
            self.cfg.ssd_bytes,
            self.cfg.model_fingerprint,
            self._started,
        )

    def start(self) -> str:
        cfg = self.cfg
        self._started = time.time()
        self.call_limit = CallLimit(
            (f"/{SERVICE}/Get", f"/{SERVICE}/Put"),
            cfg.grpc_workers,
            f"store node {cfg.node_id}",
            self.metrics.busy_refusals.labels(cfg.node_id).inc,
        )
        self.server = grpc.server(
            futures.ThreadPoolExecutor(
                max_workers=cfg.grpc_workers + CONTROL_THREADS, thread_name_prefix="kvstore"
            ),
            options=grpc_options(cfg.max_message_bytes),
            # every store method is internal: the cluster token when one is configured; access
            # first, so a refused caller takes no data-call slot
            interceptors=[*server_interceptors(cfg.security), self.call_limit],
        )
        add_servicer(_Servicer(self), self.server)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        port = add_port(self.server, f"{cfg.host}:{cfg.port}", cfg.security, client_facing=False)
        if port == 0:
            raise RuntimeError(f"store node {cfg.node_id} could not bind {cfg.host}:{cfg.port}")
        self.address = f"{cfg.host}:{port}"
        if cfg.bulk_port >= 0:
            self.bulk = BulkServer(self)
            self.bulk_port = self.bulk.start()
        if cfg.redis_url:
            self.index = Index(cfg.redis_url, timeout_s=cfg.index_timeout_s)
            self.publisher = IndexPublisher(
                self.index,
                self.info,
                self.store.take_events,
                self.store.listing,
                heartbeat_s=cfg.heartbeat_s,
                ttl_s=self._ttl,
                sweep=True,
                retry_s=min(1.0, cfg.heartbeat_s),
                on_error=self.metrics.index_error,
            )
            self.metrics.publisher = self.publisher
            self.publisher.start()
            # Registered, with what the ssd tier kept across a restart, before serving; entries
            # of an earlier run of this node are replaced. An index that does not answer now
            # delays nothing: the publisher publishes the listing once it does.
            self.publisher.sync(timeout_s=max(2.0, 3 * cfg.index_timeout_s))
        else:
            self.store.drain_events()
        self.server.start()
        for service in ("", SERVICE):
            self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        if cfg.metrics_port:
            self.metrics.serve(cfg.metrics_port, cfg.host)
        self._thread = threading.Thread(
            target=self._housekeeping, name=f"kvstore-{cfg.node_id}", daemon=True
        )
        self._thread.start()
        log.info("store node %s serving at %s", cfg.node_id, self.address)
        return self.address

    @property
    def _ttl(self) -> float:
        return 3 * self.cfg.heartbeat_s

    def publish_soon(self) -> None:
        """The store's block changes go to the index from the publisher's thread (never waits:
        the index is advisory, the data path does not depend on Redis)."""
        if self.publisher is not None:
            self.publisher.notify()
        else:
            self.store.drain_events()

    def flush(self, timeout_s: float = 2.0) -> bool:
        """Publish the changes queued so far and wait (at most timeout_s) until the index has
        them; whether it does (False: no index, or it did not answer)."""
        if self.publisher is None:
            self.store.drain_events()
            return False
        return self.publisher.sync(timeout_s)

    def _housekeeping(self) -> None:
        tick = min(0.25, self.cfg.heartbeat_s / 2, self.cfg.lease_s / 4)
        while not self._stop.wait(tick):
            if self.store.expire():
                self.publish_soon()

    def stop(self, grace: float = 1.0) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.server is not None:
            for service in ("", SERVICE):
                self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
            self.server.stop(grace).wait()
            self.server = None
        if self.bulk is not None:
            self.bulk.stop()
            self.bulk = None
        self.metrics.stop()
        try:
            self.store.persist()
        except Exception as e:  # lmdb full or gone: what is on ssd already stays
            log.warning("could not persist dram blocks: %s", e)
        if self.publisher is not None:
            self.publisher.stop()
            self.publisher = None
        if self.index is not None:
            try:
                self.index.unregister(self.cfg.node_id)
            except Exception as e:  # noqa: BLE001 - its heartbeat lapses, others sweep it
                log.warning("index unregister failed: %s", e)
            self.index.close()
            self.index = None
        self._close_tiers()

    def _close_tiers(self) -> None:
        if self.ssd is not None:
            self.ssd.close()
            self.ssd = None
        if self.slab is not None:
            self.slab.close()
            self.slab = None

    def __enter__(self) -> StoreNode:
        if self.server is None:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    """`python -m kvstore.node [--config YAML] [--set key=value ...]`: serve one store node."""
    import argparse
    import signal

    import yaml

    p = argparse.ArgumentParser(prog="python -m kvstore.node")
    p.add_argument("--config", help="YAML mapping of StoreConfig fields")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args(argv)
    d = {}
    if args.config:
        with open(args.config) as f:
            d = yaml.safe_load(f) or {}
    for kv in args.set:
        k, _, v = kv.partition("=")
        d[k] = yaml.safe_load(v)
    node = StoreNode(StoreConfig.from_dict(d))
    print(node.start(), flush=True)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    node.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
