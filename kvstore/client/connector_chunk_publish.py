"""Publishing a prompt's CacheGen chunks (kvstore/client/cachegen_stream.py): each whole chunk of
its blocks, coded at every level this host's store lacks, so that a worker across a slow link can
fetch it smaller than its raw blocks (connector_chunk_fetch.py)."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Executor, Future

import torch

from kvstore.client.cachegen_stream import chunk_key, chunk_keys, encode_chunk
from kvstore.client.connector_metrics import ConnectorMetrics
from kvstore.client.connector_pool import PoolIO
from kvstore.client.store_client import StoreClient


class ChunkPublisher:
    """Codes `pool`'s chunks on `publisher` (the connector's publishing thread) into `local`,
    this host's store node; a failure is counted and logged: the raw blocks serve the prefix."""

    def __init__(
        self, pool: PoolIO, local: StoreClient, publisher: Executor, metrics: ConnectorMetrics
    ) -> None:
        self._pool, self._local = pool, local
        self._publisher, self._metrics = publisher, metrics

    def publish(
        self, keys: Sequence[bytes], ids: Sequence[int], levels: Sequence[int], chunk_blocks: int
    ) -> Future | None:
        """See KVConnector.publish_chunks."""
        n_chunks = len(keys) // chunk_blocks
        if not levels or not n_chunks:
            return None
        todo: dict[int, list[int]] = {}  # level -> chunks the store lacks
        try:
            for level in levels:
                held = self._local.lookup(chunk_keys(list(keys), chunk_blocks, level)).num_blocks
                if held < n_chunks:
                    todo[level] = list(range(held, n_chunks))
        except Exception as exc:  # noqa: BLE001
            self._metrics.error("publish_chunks", exc)
            return None
        chunks = sorted({c for cs in todo.values() for c in cs})
        if not chunks:
            return None
        kv = self._pool.kv
        copies: dict[int, torch.Tensor] = {}  # chunk -> its blocks, copied out of the pool now
        for c in chunks:
            idx = self._pool.index(ids[c * chunk_blocks : (c + 1) * chunk_blocks])
            copies[c] = kv[idx].float().cpu()
        return self._publisher.submit(self._put_chunks, list(keys), todo, copies, chunk_blocks)

    def _put_chunks(
        self,
        keys: list[bytes],
        todo: dict[int, list[int]],
        copies: dict[int, torch.Tensor],
        chunk_blocks: int,
    ) -> int:
        """Code and put chunks `todo` (level -> chunks) from their `copies`; records written."""
        written = 0
        for level, cs in todo.items():
            for c in cs:
                try:
                    payload = encode_chunk(copies[c], level)
                    written += self._local.put(
                        [chunk_key(keys[(c + 1) * chunk_blocks - 1], level)],
                        payload[None],
                        self._pool.fingerprint,
                        codec=f"cachegen{level}",
                    )
                except Exception as exc:  # noqa: BLE001 - the raw blocks still serve the prefix
                    self._metrics.error("publish_chunks", exc)
        self._metrics.published("cachegen", written)
        return written
