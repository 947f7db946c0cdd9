"""StoreNode: one host's store (dram slab + ssd) served over gRPC, published to the global index;
its start-up, housekeeping and stop. The gRPC calls are served by rpc_stream.py (Get, Put),
rpc_shm.py (Lookup and the shared-memory path) and rpc_admin.py (Stats, Clear, Info)."""

from __future__ import annotations

import logging
import socket
import threading
import time
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvstore.index import Index
from kvstore.index_publisher import IndexPublisher
from kvstore.node.bulk_server import BulkServer
from kvstore.node.config import StoreConfig
from kvstore.node.metrics import StoreMetrics
from kvstore.node.rpc_admin import AdminRpcs
from kvstore.node.rpc_shm import ShmRpcs
from kvstore.node.rpc_stream import StreamRpcs
from kvstore.node.rpc_writes import Writes
from kvstore.node.ssd import SsdTier
from kvstore.node.store import BlockStore
from kvstore.slab import ShmSlab, remove_stale
from kvstore.types import NodeInfo, grpc_options
from kvstore.wire import add_servicer
from servekit.call_limit import CONTROL_THREADS, CallLimit
from servekit.security import add_port, server_interceptors

log = logging.getLogger(__name__)
SERVICE = "halfmoon.KVStore"


class _Servicer:
    """The KVStore service of `node`: each call served by the part whose job it is, under the
    method names add_servicer looks up."""

    def __init__(self, node: StoreNode):
        writes = Writes(node)  # the put's checks, reservation and commit, shared by two parts
        stream, shm, admin = StreamRpcs(node, writes), ShmRpcs(node, writes), AdminRpcs(node)
        self.Get, self.Put = stream.Get, stream.Put
        self.Lookup, self.Lease, self.Release, self.Commit = (
            shm.Lookup,
            shm.Lease,
            shm.Release,
            shm.Commit,
        )
        self.Stats, self.Clear, self.Info = admin.Stats, admin.Clear, admin.Info


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
    d: dict[str, Any] = {}  # StoreConfig fields by name
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
