"""Saving pool blocks to this host's store node: whole runs of blocks (a decode worker's new
blocks, a prefill whose layer-by-layer publish did not happen), the check that a prompt's blocks
are all there before a decode worker pulls them, and opening a layer-by-layer put
(connector_layerwise.py streams its layers)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvstore.client.connector_metrics import ConnectorMetrics
from kvstore.client.connector_pool import PoolIO
from kvstore.client.store_client import BlockWriter, StoreClient


class BlockSaver:
    """Writes `pool`'s blocks to `local`, this host's store node; a failure is counted and
    logged, never raised (what is not stored is recomputed by whoever misses it)."""

    def __init__(self, pool: PoolIO, local: StoreClient, metrics: ConnectorMetrics) -> None:
        self._pool, self._local, self._metrics = pool, local, metrics

    def open_writer(self, keys: Sequence[bytes], parent: bytes | None) -> BlockWriter | None:
        """A layer-by-layer put of new blocks `keys` (counted as published); None (counted)
        when the store cannot take them now."""
        sl = self._pool.store_layout
        try:
            writer = self._local.open_put(
                list(keys),
                sl.block_shape,
                sl.dtype,
                self._pool.fingerprint,
                sl.store_codec,
                parent=parent,
            )
        except Exception as exc:  # noqa: BLE001 - compute anyway; ensure_stored tries again
            self._metrics.error("open_layerwise", exc)
            return None
        self._metrics.published("layerwise", len(keys))
        return writer

    def ensure_stored(self, keys: Sequence[bytes], ids: Sequence[int]) -> int:
        """See KVConnector.ensure_stored."""
        if not keys:
            return 0
        try:
            held = self._local.lookup(list(keys)).num_blocks
        except Exception as exc:  # noqa: BLE001
            self._metrics.error("ensure_stored", exc)
            return 0
        if held == len(keys):
            return held
        parent = keys[held - 1] if held else None
        return held + self.put(keys[held:], ids[held : len(keys)], parent, "ensure_stored")

    def put_blocks(
        self, keys: Sequence[bytes], blocks: torch.Tensor, parent: bytes | None, op: str = "put"
    ) -> int:
        """See KVConnector.put_blocks."""
        sl = self._pool.store_layout
        try:
            n = self._local.put(
                list(keys), blocks.to("cpu"), self._pool.fingerprint, sl.store_codec, parent=parent
            )
        except Exception as exc:  # noqa: BLE001 - a decode worker recomputes what it cannot pull
            self._metrics.error(op, exc)
            return 0
        self._metrics.published(op, len(keys))
        return n

    def put(
        self, keys: Sequence[bytes], ids: Sequence[int], parent: bytes | None, op: str = "put"
    ) -> int:
        """See KVConnector.put."""
        if not keys:
            return 0
        return self.put_blocks(keys, self._pool.stored_blocks(ids), parent, op)
