"""The connector's accounting: its counters (labelled with the worker) and how a failure or a
miss is recorded. Every part of the connector records through one `ConnectorMetrics`, so that a
failure anywhere is counted and logged the same way (a failure is never the request's error:
what could not be loaded is recomputed)."""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter

from kvstore.block_header import BlockCorrupt
from kvstore.control import StoreUnavailable
from kvstore.types import StoreFull

# One logger for every module of the connector, under the name it has always logged as: log
# configuration that names kvstore.client.connector keeps hearing all of it.
log = logging.getLogger("kvstore.client.connector")


def failure_kind(exc: BaseException) -> str:
    """A metric label for why a transfer failed."""
    if isinstance(exc, StoreFull):
        return "full"
    if isinstance(exc, BlockCorrupt):
        return "corrupt"
    if isinstance(exc, StoreUnavailable):
        return "timeout" if "DEADLINE" in str(exc) else "unavailable"
    return "error"


class ConnectorMetrics:
    """The counters of one worker's connector, in `registry`."""

    def __init__(self, registry: CollectorRegistry, worker: str) -> None:
        self.worker = worker
        self.m_blocks = Counter(
            "halfmoon_kv_loaded_blocks",
            "Blocks moved into the pool, by source tier",
            ["worker", "tier"],
            registry=registry,
        )
        self.m_misses = Counter(
            "halfmoon_kv_missed_blocks",
            "Blocks asked for and not loaded (recomputed instead), by operation",
            ["worker", "op"],
            registry=registry,
        )
        self.m_errors = Counter(
            "halfmoon_kv_errors",
            "Connector failures by operation and kind",
            ["worker", "op", "kind"],
            registry=registry,
        )
        self.m_cachegen_bytes = Counter(
            "halfmoon_kv_cachegen_bytes",
            "Bytes of CacheGen chunks fetched (what crossed the link)",
            ["worker"],
            registry=registry,
        ).labels(worker)
        self.m_cachegen_blocks = Counter(
            "halfmoon_kv_cachegen_blocks",
            "Blocks loaded from CacheGen chunks",
            ["worker"],
            registry=registry,
        ).labels(worker)
        self.m_published = Counter(
            "halfmoon_kv_published_blocks",
            "Blocks written to the store",
            ["worker", "how"],
            registry=registry,
        )

    def error(self, op: str, exc: BaseException) -> None:
        """A failure of `op`: counted by kind and logged."""
        kind = failure_kind(exc)
        self.m_errors.labels(self.worker, op, kind).inc()
        log.warning("%s: kv %s failed (%s): %s: %s", self.worker, op, kind, type(exc).__name__, exc)

    def count_error(self, op: str, kind: str) -> None:
        """A failure counted only: for those whose owner logs them itself (the index publisher
        logs an outage's first failure, a client its fallback)."""
        self.m_errors.labels(self.worker, op, kind).inc()

    def miss(self, op: str, n: int) -> None:
        """`n` blocks `op` was asked for and did not load (the caller recomputes them)."""
        if n > 0:
            self.m_misses.labels(self.worker, op).inc(n)

    def loaded(self, tier: str, n: int) -> None:
        """`n` blocks moved into the pool from `tier` (counted even when 0: the series exists)."""
        self.m_blocks.labels(self.worker, tier).inc(n)

    def published(self, how: str, n: int) -> None:
        """`n` blocks written to the store, by how (layerwise, put, cachegen, ...)."""
        self.m_published.labels(self.worker, how).inc(n)
