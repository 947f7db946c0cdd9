"""The store node's Prometheus metrics, in a registry of its own."""

from __future__ import annotations

import threading
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvstore.index_publisher import IndexPublisher
from kvstore.node.store import BlockStore


class _StoreCollector:
    """Reads the store's counters (and its index publisher's) at scrape time."""

    def __init__(self, store: BlockStore):
        self.store = store
        self.publisher: IndexPublisher | None = None

    def collect(self):
        s = self.store.stats()
        used = GaugeMetricFamily(
            "halfmoon_store_bytes", "Encoded block bytes held", labels=["node", "tier"]
        )
        cap = GaugeMetricFamily(
            "halfmoon_store_capacity_bytes", "Tier capacity", labels=["node", "tier"]
        )
        blocks = GaugeMetricFamily("halfmoon_store_blocks", "Blocks held", labels=["node", "tier"])
        hits = CounterMetricFamily(
            "halfmoon_store_hits", "Blocks read, by tier", labels=["node", "tier"]
        )
        ev = CounterMetricFamily(
            "halfmoon_store_evictions", "Blocks evicted, by tier", labels=["node", "tier"]
        )
        for t in s.tiers:
            used.add_metric([s.node_id, t.tier], t.used_bytes)
            cap.add_metric([s.node_id, t.tier], t.capacity_bytes)
            blocks.add_metric([s.node_id, t.tier], t.blocks)
            hits.add_metric([s.node_id, t.tier], t.hits)
            ev.add_metric([s.node_id, t.tier], t.evictions)
        yield from (used, cap, blocks, hits, ev)
        misses = CounterMetricFamily(
            "halfmoon_store_misses", "Blocks asked for past the held prefix", labels=["node"]
        )
        misses.add_metric([s.node_id], s.misses)
        moves = CounterMetricFamily(
            "halfmoon_store_moves", "Blocks moved between tiers", labels=["node", "kind"]
        )
        moves.add_metric([s.node_id, "promotion"], s.promotions)
        moves.add_metric([s.node_id, "demotion"], s.demotions)
        leases = GaugeMetricFamily("halfmoon_store_leases", "Leases held", labels=["node"])
        leases.add_metric([s.node_id], s.leases)
        corrupt = CounterMetricFamily(
            "halfmoon_store_corrupt_blocks",
            "Blocks that failed their checksums (dropped; readers recompute them), by tier",
            labels=["node", "tier"],
        )
        for tier, n in self.store.corrupt.items():
            corrupt.add_metric([s.node_id, tier], n)
        yield from (misses, moves, leases, corrupt)
        p = self.publisher
        if p is not None:
            republished = CounterMetricFamily(
                "halfmoon_store_index_republished",
                "Times the node published its whole listing (start, or the index lost entries)",
                labels=["node"],
            )
            republished.add_metric([s.node_id], p.republished)
            dropped = CounterMetricFamily(
                "halfmoon_store_index_dropped_events",
                "Block changes not published (index down or queue full; the listing covers them)",
                labels=["node"],
            )
            dropped.add_metric([s.node_id], p.dropped_events)
            fresh = GaugeMetricFamily(
                "halfmoon_store_index_up_to_date",
                "1 when the index holds this node's entries as they are",
                labels=["node"],
            )
            fresh.add_metric([s.node_id], float(p.up_to_date))
            yield from (republished, dropped, fresh)


class StoreMetrics:
    """Counters the node updates as it serves, plus the store's own state at scrape time."""

    def __init__(self, store: BlockStore):
        self.registry = CollectorRegistry(auto_describe=True)
        self._collector = _StoreCollector(store)
        self.registry.register(self._collector)
        self.index_errors = Counter(
            "halfmoon_store_index_errors",
            "Index calls that failed (Redis down or slow), by operation; serving goes on",
            ["node", "op"],
            registry=self.registry,
        )
        self.busy_refusals = Counter(
            "halfmoon_store_busy_refusals",
            "Get/Put calls refused at once (RESOURCE_EXHAUSTED): every data-call slot was taken",
            ["node"],
            registry=self.registry,
        )
        self.transfer_bytes = Counter(
            "halfmoon_store_transfer_bytes",
            "Block bytes moved by the node",
            ["node", "op", "path"],
            registry=self.registry,
        )
        self.transfer_seconds = Counter(
            "halfmoon_store_transfer_seconds",
            "Seconds spent serving transfers",
            ["node", "op", "path"],
            registry=self.registry,
        )
        self.node_id = store.node_id
        self._http: tuple[WSGIServer, threading.Thread] | None = None  # the exporter, once served

    @property
    def publisher(self) -> IndexPublisher | None:
        return self._collector.publisher

    @publisher.setter
    def publisher(self, publisher: IndexPublisher | None) -> None:
        self._collector.publisher = publisher

    def index_error(self, op: str, exc: BaseException) -> None:
        """One failed index call (the publisher logs the first of an outage)."""
        self.index_errors.labels(self.node_id, op).inc()

    def record(self, op: str, path: str, nbytes: int, seconds: float = 0.0) -> None:
        self.transfer_bytes.labels(self.node_id, op, path).inc(nbytes)
        if seconds:
            self.transfer_seconds.labels(self.node_id, op, path).inc(seconds)

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        self._http = start_http_server(port, addr=host, registry=self.registry)

    def stop(self) -> None:
        if self._http is not None:
            server, thread = self._http
            server.shutdown()
            server.server_close()
            thread.join(timeout=2)
            self._http = None
