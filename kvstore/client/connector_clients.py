"""The connector's store clients: one `StoreClient` per store address and transport, made on
first use and shared by every operation, and the way from an index node id to its client."""

from __future__ import annotations

import threading

import torch

from kvstore.client.connector_metrics import ConnectorMetrics
from kvstore.client.store_client import StoreClient
from kvstore.index import Index
from servekit.security import SecurityConfig


class StoreClients:
    """The clients of one worker's connector. `local` (this host's node at `store_address`,
    index id `store_node`) is made at once: a connector fails fast when its host's store is away.
    `index` resolves other nodes' ids to addresses (None: only this host's node is known)."""

    def __init__(
        self,
        store_address: str,
        store_node: str,
        index: Index | None,
        metrics: ConnectorMetrics,
        timeout_s: float,
        security: SecurityConfig | None,
    ) -> None:
        self.store_address, self.store_node = store_address, store_node
        self._index, self._metrics = index, metrics
        self._timeout_s, self._security = timeout_s, security
        self._clients: dict[tuple[str, str], StoreClient] = {}  # (address, transport) -> client
        self._lock = threading.Lock()
        self.local = self.get(store_address)

    def get(self, address: str, transport: str = "auto") -> StoreClient:
        """The client of the store node at `address` over `transport` (StoreClient's: "auto" =
        shm on this host; one per address and transport, made on first use)."""
        with self._lock:
            c = self._clients.get((address, transport))
            if c is None:
                # Outside inference mode: the client maps its shm slab as a tensor later writes
                # update, which inference tensors would forbid.
                with torch.inference_mode(False):
                    c = self._clients[(address, transport)] = StoreClient(
                        address,
                        transport,
                        timeout_s=self._timeout_s,
                        security=self._security,
                        # a bulk port that would not open: blocks go over gRPC, counted
                        on_fallback=lambda why: self._metrics.count_error(
                            "bulk_connect", "fallback"
                        ),
                    )
            return c

    def for_node(self, node: str, transport: str = "auto") -> StoreClient | None:
        """The client of the store node an index id names; None (counted) when unknown."""
        if node == self.store_node:
            return self.local if transport == "auto" else self.get(self.store_address, transport)
        try:
            info = self._index.nodes().get(node) if self._index is not None else None
            if info is None or not info.address:
                raise KeyError(f"store node {node!r} is not in the index")
            return self.get(info.address, transport)
        except Exception as exc:  # noqa: BLE001 - the prefix is recomputed instead
            self._metrics.error("resolve_node", exc)
            return None

    def close(self) -> None:
        with self._lock:
            for c in self._clients.values():
                c.close()
            self._clients.clear()
