"""The KV connector: the one path between a worker's paged KV pool and the store.

It looks up and loads the longest cached prefix walking device -> host DRAM -> host SSD -> a
remote node, publishes new blocks layer by layer while later layers compute, stages transfers in
host memory (the pool may live on a GPU), keeps one client per store address, and accounts for
every miss, timeout and error in metrics and logs. A failure is never an error for the request:
what could not be loaded is recomputed by the caller, slower and never wrong.

The pool is seen only through its tensor `kv[num_blocks, *layout.block_shape]` and its layout;
allocation stays with the worker, which passes `allocate`/`free` where blocks are needed.

`KVConnector` is the façade a worker holds; each job is a collaborator of its own module:
connector_pool (the pool, its store layout, copies in and out), connector_clients (a client per
store node), connector_loader (prefix loads and pulls), connector_saver and connector_layerwise
(writing blocks), connector_chunk_publish and connector_chunk_fetch (CacheGen chunks),
connector_tail (the inline tail), connector_device (the device tier) and connector_metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future

import numpy as np
import torch
from prometheus_client import CollectorRegistry

from kernels import ReleasingThreadPool
from kernels.layout import KVLayout
from kvstore.client.connector_chunk_fetch import ChunkFetch, ChunkFetcher, ChunkPlan
from kvstore.client.connector_chunk_publish import ChunkPublisher
from kvstore.client.connector_clients import StoreClients
from kvstore.client.connector_device import ResidentBlocks
from kvstore.client.connector_layerwise import LayerPublisher
from kvstore.client.connector_loader import TIERS, PrefixLoad, PrefixLoader
from kvstore.client.connector_metrics import ConnectorMetrics
from kvstore.client.connector_pool import PoolIO
from kvstore.client.connector_saver import BlockSaver
from kvstore.client.connector_tail import InlineTail, write_tokens
from kvstore.client.store_client import StoreClient
from kvstore.index import Index
from kvstore.links import LinkSpeed
from servekit.security import SecurityConfig

# The records and helpers callers import from here, wherever they are defined now.
__all__ = [
    "TIERS",
    "ChunkFetch",
    "ChunkPlan",
    "KVConnector",
    "LayerPublisher",
    "PrefixLoad",
    "write_tokens",
]


class KVConnector:
    """Moves blocks between one worker's pool and the store (see the module docstring).

    kv: the pool tensor; layout: what a block holds (kernels.KVLayout); store_layout: what a
    block is stored as, when it differs (a full-precision prefill pool whose blocks are stored
    KIVI-packed: packed on the way out, unpacked on the way in); fingerprint: the block format's
    model fingerprint (weights + the store layout). store_address/store_node: this host's store
    node. index_url: the global index (to reach other hosts' nodes and to publish the device
    tier). device_node: the index node id of this worker's device tier ("" = no device tier).
    """

    def __init__(
        self,
        kv: torch.Tensor,
        layout: KVLayout,
        fingerprint: str,
        store_address: str,
        *,
        store_node: str = "",
        index_url: str = "",
        device_node: str = "",
        worker: str = "",
        registry: CollectorRegistry | None = None,
        timeout_s: float = 30.0,
        index_period_s: float = 0.2,
        index_ttl_s: float = 5.0,
        store_layout: KVLayout | None = None,
        security: SecurityConfig | None = None,
    ):
        self.kv, self.layout, self.fingerprint = kv, layout, fingerprint
        self.store_layout = store_layout or layout
        self.security = security  # servekit.SecurityConfig of the store channels (None: open)
        self.store_address, self.store_node = store_address, store_node
        self.device_node = device_node
        self.worker, self.timeout_s = worker or device_node or store_node, timeout_s
        m = self._metrics = ConnectorMetrics(registry or CollectorRegistry(), self.worker)
        self.m_blocks, self.m_misses, self.m_errors = m.m_blocks, m.m_misses, m.m_errors
        self.m_cachegen_bytes, self.m_cachegen_blocks = m.m_cachegen_bytes, m.m_cachegen_blocks
        self.m_published = m.m_published
        self._pool = PoolIO(kv, layout, self.store_layout, fingerprint, m)
        self.packs, self.wire_block_bytes = self._pool.packs, self._pool.wire_block_bytes
        self._resident = ResidentBlocks(device_node, m)
        self.device = self._resident.tier
        # CacheGen: the next chunk crosses the link on this thread while the last one decodes.
        # Both pools' tasks copy with torch ops: their threads free their OpenMP workers after each
        self._fetcher = ReleasingThreadPool(max_workers=1, thread_name_prefix=f"{worker}-fetch")
        self._index = Index(index_url) if index_url else None
        self._publisher = ReleasingThreadPool(max_workers=1, thread_name_prefix=f"{self.worker}-kv")
        # fails fast when the host's store is away
        self._clients = StoreClients(store_address, store_node, self._index, m, timeout_s, security)
        self._local = self._clients.local
        self._loader = PrefixLoader(self._pool, self._clients, self._resident, m)
        self._saver = BlockSaver(self._pool, self._local, m)
        self._tail = InlineTail(self._pool, m)
        self._chunk_publisher = ChunkPublisher(self._pool, self._local, self._publisher, m)
        self._chunk_fetcher = ChunkFetcher(self._pool, self._clients, self._fetcher, m)
        self._resident.publish(self._index, fingerprint, index_period_s, index_ttl_s)

    def pool_bytes(self) -> np.ndarray:
        """The pool's bytes as a flat uint8 array (a view, made once), for copies that read
        blocks where they lie; only for a contiguous CPU pool."""
        return self._pool.pool_bytes()

    def client(self, address: str, transport: str = "auto") -> StoreClient:
        """The client of the store node at `address` over `transport` (StoreClient's: "auto" =
        shm on this host; one per address and transport, made on first use)."""
        return self._clients.get(address, transport)

    # ---- loading (prefill) ----

    def load_prefix(
        self,
        keys: Sequence[bytes],
        cap: int,
        fetch_from: str,
        fetch_blocks: int,
        allocate: Callable[[int], list[int]],
        free: Callable[[list[int]], None],
    ) -> PrefixLoad:
        """The longest cached run of keys[:cap] into pool blocks: the device tier, then this
        host's store node, then `fetch_from` (another node) up to `fetch_blocks` blocks, and
        nothing from anywhere else. `allocate` may raise (pool short): what was taken is given
        back before the exception goes on."""
        return self._loader.load_prefix(keys, cap, fetch_from, fetch_blocks, allocate, free)

    def links(self) -> dict[str, LinkSpeed]:
        """Store node id -> the link to it as this worker's fetches measured it."""
        return self._loader.links()

    def pull(self, address: str, keys: Sequence[bytes], ids: Sequence[int]) -> int:
        """Decode side: the leading blocks of `keys` held at the store node at `address` into
        pool blocks `ids`; how many (the rest is the caller's to recompute)."""
        return self._loader.pull(address, keys, ids)

    # ---- the tail, carried inline in full precision ----

    def encode_tail(self, block_ids: Sequence[int], tokens: int) -> bytes:
        """The first `tokens` token slots across full-precision pool blocks `block_ids`, as one
        block in the block format (checksummed): `[L, 2, tokens, heads, head_dim]`, or
        `[L, tokens, C]` for an MLA latent cache."""
        return self._tail.encode(block_ids, tokens)

    def decode_tail(self, data: bytes, tokens: int, shape: tuple[int, ...]) -> torch.Tensor | None:
        """An inline tail `[L, 2, tokens, heads, head_dim]` or `[L, tokens, C]` (`shape`: a
        full-precision block's);
        None (counted and logged) when it is corrupt, of another model or of the wrong shape."""
        return self._tail.decode(data, tokens, shape)

    def load_tail(self, data: bytes, tokens: int, block_ids: Sequence[int]) -> bool:
        """Write an inline tail into the first `tokens` slots across full-precision pool blocks
        `block_ids`; False (counted) when it cannot be used."""
        return self._tail.load(data, tokens, block_ids)

    # ---- publishing ----

    def open_layerwise(
        self, keys: Sequence[bytes], ids: Sequence[int], parent: bytes | None
    ) -> LayerPublisher | None:
        """A publisher for new full blocks `keys` held in pool blocks `ids`, written layer by
        layer as they are computed; None (counted) when the store cannot take them now."""
        if not keys:
            return None
        writer = self._saver.open_writer(keys, parent)
        if writer is None:
            return None
        return LayerPublisher(self, writer, self._pool.index(ids))

    def ensure_stored(self, keys: Sequence[bytes], ids: Sequence[int]) -> int:
        """Every block of `keys` (in pool blocks `ids`) in this host's store, so that a decode
        worker can pull them all; how many the store holds afterwards."""
        return self._saver.ensure_stored(keys, ids)

    def put_blocks(
        self, keys: Sequence[bytes], blocks: torch.Tensor, parent: bytes | None, op: str = "put"
    ) -> int:
        """Write blocks already in the store layout (`[n, *store_layout.block_shape]`) under
        `keys` to this host's store; how many it took."""
        return self._saver.put_blocks(keys, blocks, parent, op)

    def put(
        self, keys: Sequence[bytes], ids: Sequence[int], parent: bytes | None, op: str = "put"
    ) -> int:
        """Write pool blocks `ids` under `keys` to this host's store; how many it took."""
        return self._saver.put(keys, ids, parent, op)

    # ---- CacheGen chunks (kvstore/client/cachegen_stream.py) ----

    def publish_chunks(
        self, keys: Sequence[bytes], ids: Sequence[int], levels: Sequence[int], chunk_blocks: int
    ) -> Future | None:
        """Encode every whole chunk of the run `keys` (from block 0; pool blocks `ids`, full
        precision) that this host's store lacks at any of `levels`, and put it there. The chunks
        are copied out of the pool now and encoded in the background: the Future gives the
        records written (None: nothing to do). Failures are counted and logged; the raw blocks
        serve the prefix anyway."""
        return self._chunk_publisher.publish(keys, ids, levels, chunk_blocks)

    def fetch_chunks(
        self,
        fetch_from: str,
        keys: Sequence[bytes],
        table: list[int],
        want: int,
        allocate: Callable[[int], list[int]],
        plan: ChunkPlan,
    ) -> ChunkFetch:
        """Adaptive streaming from node `fetch_from`: extend `table` (the prefix loaded so far)
        towards `want` blocks chunk by chunk, each at the option CacheGen's rule picks
        (kvstore/client/cachegen_stream.py): a CacheGen level, or the chunk's blocks as stored
        (RAW_LEVEL, lossless, when plan.raw), from the measured link throughput, the measured
        decode (or copy) time of each option and the remaining budget. The link carries chunks
        one after another up to PREFETCH_CHUNKS ahead of the one this thread decodes or copies;
        chunks enter the pool in order. Stops at the first chunk that is not held, fails its
        checks, or is better recomputed."""
        return self._chunk_fetcher.fetch_chunks(fetch_from, keys, table, want, allocate, plan)

    # ---- the device tier ----

    def keep(
        self,
        keys: Sequence[bytes],
        table: list[int],
        pinned: Sequence[bytes],
        free: Callable[[list[int]], None],
    ) -> None:
        """After a request: its full blocks (`keys`, the first len(keys) of `table`) stay
        resident as the device tier; its pins are released; the rest of `table` is freed."""
        self._resident.keep(keys, table, pinned, free)

    def drop(
        self, table: list[int], pinned: Sequence[bytes], free: Callable[[list[int]], None]
    ) -> None:
        """Give back what a request held without keeping anything: pins released, the blocks
        it owns (after the pinned ones) freed."""
        self._resident.drop(table, pinned, free)

    def evict_device(self, n: int) -> list[int]:
        """Up to n unpinned device-tier blocks, least recently used first (now the caller's)."""
        return self._resident.evict(n)

    def device_blocks(self) -> int:
        return self._resident.blocks()

    # ---- lifecycle ----

    def close(self) -> None:
        self._resident.stop_publishing()
        self._publisher.shutdown(wait=True)
        self._fetcher.shutdown(wait=True)
        if self._index is not None:
            self._resident.unregister(self._index)
            self._index.close()
        self._clients.close()
