"""The device tier as the connector runs it: a request's full blocks kept resident in the worker's
own pool after it (kvstore/client/device.py), pinned while later requests use them, and published
to the global index as a node of its own so that routing sees them."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Sequence

from kvstore.client.connector_metrics import ConnectorMetrics, failure_kind
from kvstore.client.device import DeviceTier
from kvstore.index import Index
from kvstore.index_publisher import IndexPublisher
from kvstore.types import NodeInfo


class ResidentBlocks:
    """The device tier of index node `device_node` ("" = none: every block is freed after its
    request). `tier` is the DeviceTier, or None."""

    def __init__(self, device_node: str, metrics: ConnectorMetrics) -> None:
        self.device_node, self._metrics = device_node, metrics
        self.tier = DeviceTier() if device_node else None
        self._publisher: IndexPublisher | None = None

    def publish(self, index: Index | None, fingerprint: str, period_s: float, ttl_s: float) -> None:
        """Publish the tier to `index` (None: nowhere) as a node of its own (registered,
        heartbeats, its changes, its whole listing again after the index lost them), from a
        thread of its own."""
        tier = self.tier
        if tier is None or index is None:
            return
        info = NodeInfo(
            self.device_node, "", socket.gethostname(), "", 0, 0, fingerprint, time.time()
        )
        self._publisher = IndexPublisher(
            index,
            info,
            lambda: (tier.drain_events(), False),
            tier.listing,
            heartbeat_s=ttl_s / 3,
            ttl_s=ttl_s,
            period_s=period_s,
            # counted here; the publisher logs the first failure of an outage
            on_error=lambda op, exc: self._metrics.count_error(f"index_{op}", failure_kind(exc)),
        )
        self._publisher.start()

    def match(self, keys: Sequence[bytes]) -> list[int]:
        """Pool blocks of the longest resident run of `keys`, pinned (none without a tier)."""
        return self.tier.match(keys) if self.tier is not None else []

    def keep(
        self,
        keys: Sequence[bytes],
        table: list[int],
        pinned: Sequence[bytes],
        free: Callable[[list[int]], None],
    ) -> None:
        """After a request: its full blocks (`keys`, the first len(keys) of `table`) stay
        resident; its pins are released; the rest of `table` is freed."""
        n = len(keys)
        rest = list(table[n:])
        fresh_keys, fresh_ids = list(keys[len(pinned) : n]), list(table[len(pinned) : n])
        if self.tier is not None:
            self.tier.release(pinned)
            rest += self.tier.insert(fresh_keys, fresh_ids)
        else:
            rest += fresh_ids
        free(rest)

    def drop(
        self, table: list[int], pinned: Sequence[bytes], free: Callable[[list[int]], None]
    ) -> None:
        """Give back what a request held without keeping anything: pins released, the blocks
        it owns (after the pinned ones) freed."""
        if self.tier is not None:
            self.tier.release(pinned)
        free(list(table[len(pinned) :]))

    def evict(self, n: int) -> list[int]:
        """Up to n unpinned resident blocks, least recently used first (now the caller's)."""
        return self.tier.evict(n) if self.tier is not None else []

    def blocks(self) -> int:
        """How many blocks are resident."""
        return len(self.tier) if self.tier is not None else 0

    def stop_publishing(self) -> None:
        if self._publisher is not None:
            self._publisher.stop()

    def unregister(self, index: Index) -> None:
        """Take the tier's node out of `index` (a failure is counted and logged)."""
        if self.tier is not None:
            try:
                index.unregister(self.device_node)
            except Exception as exc:  # noqa: BLE001 - its registration expires anyway
                self._metrics.error("index_unregister", exc)
