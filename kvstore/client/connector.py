"""The KV connector: the one path between a worker's paged KV pool and the store.

It looks up and loads the longest cached prefix walking device -> host DRAM -> host SSD -> a
remote node, publishes new blocks layer by layer while later layers compute, stages transfers in
host memory (the pool may live on a GPU), keeps one client per store address, and accounts for
every miss, timeout and error in metrics and logs. A failure is never an error for the request:
what could not be loaded is recomputed by the caller, slower and never wrong.

The pool is seen only through its tensor `kv[num_blocks, *layout.block_shape]` and its layout;
allocation stays with the worker, which passes `allocate`/`free` where blocks are needed.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import NamedTuple

import torch
from prometheus_client import CollectorRegistry, Counter

from kernels import ReleasingThreadPool
from kvstore.block_header import BlockCorrupt
from kvstore.client.block_format import decode_block, encode_block, make_header, parse_header
from kvstore.client.cachegen_stream import (
    RAW_LEVEL,
    OptionCost,
    Throughput,
    choose_level,
    chunk_costs,
    chunk_key,
    chunk_keys,
    decode_chunk_record,
    encode_chunk,
    pipeline_done,
    tokens_to_blocks,
)
from kvstore.client.device import DeviceTier
from kvstore.client.store_client import BlockWriter, StoreClient, StoreUnavailable
from kvstore.index import Index
from kvstore.index_publisher import IndexPublisher
from kvstore.links import LinkModel, LinkSpeed
from kvstore.types import NodeInfo, StoreFull

log = logging.getLogger(__name__)

TIERS = ("device", "dram", "ssd", "remote")
# What a CacheGen chunk is assumed to decode at (pool bytes a second) until it is measured: about
# what kvstore/cachegen.py does on one core of this project's CPUs.
DECODE_PRIOR_BYTES_PER_S = 60e6
# What a raw chunk's blocks are assumed to copy into the pool at (pool bytes a second) until it is
# measured: a memory copy, far faster than any link or the entropy decoder.
COPY_PRIOR_BYTES_PER_S = 2e9
# CacheGen streaming: at most this many chunks queued on the link while this thread lands one (a
# coded chunk decodes slower than the link carries a raw one: more than one keeps the link busy)
PREFETCH_CHUNKS = 3
# What `fetch_chunks` logs when it stops at a chunk (worker, chunk, node, why); the rest is a miss
STOPPED = "%s: kv fetch_chunks stopped at chunk %d from %s: %s (recomputed from there)"


class PrefixLoad(NamedTuple):
    """What `load_prefix` put in the pool."""

    table: list[int]  # pool block ids holding the prefix, in order (device-tier ones first)
    pinned: list[bytes]  # device-tier keys pinned for the request: give them to `keep`/`drop`
    counts: dict[str, int]  # blocks by tier they came from: device, dram, ssd, remote
    transfer_ms: float  # time spent moving blocks into the pool
    fetched_bytes: int = 0  # bytes the remote fetch moved over the link
    fetch_ms: float = 0.0  # time the remote fetch took (its lookup and transfer)


class ChunkPlan(NamedTuple):
    """How one prefix load streams CacheGen chunks from another node."""

    levels: tuple[int, ...]  # levels to consider (those the node may hold)
    chunk_blocks: int  # blocks per chunk
    deadline: float  # time.perf_counter() by which the fetch must be done
    recompute_s_per_chunk: float  # predicted time to recompute one chunk instead
    prior_bytes_per_s: float  # assumed throughput before a transfer to the node is measured
    raw: bool = True  # the chunk's stored blocks are an option too (RAW_LEVEL, the top one)


class ChunkFetch(NamedTuple):
    """What `fetch_chunks` did."""

    levels: list[int]  # the option of each chunk fetched, in order: a level, or RAW_LEVEL
    blocks: int  # pool blocks it added
    bytes: int  # bytes that crossed the link (records and raw blocks)
    ms: float  # time it took (lookups, transfers, decoding)
    decode_ms: float = 0.0  # of which this thread decoded or copied chunks into the pool
    wait_ms: float = 0.0  # of which this thread waited for a transfer to arrive


class _OnLink(NamedTuple):
    """A chunk whose transfer is queued on (or crossing) the link, in `fetch_chunks`."""

    chunk: int  # its index in the prefix
    option: int  # the level it goes at, or RAW_LEVEL
    cost: OptionCost  # what the rule predicted it takes
    keys: list[bytes]  # raw: the blocks fetched (those not loaded already); coded: its record's key
    future: Future  # coded: the record or None; raw: (staging blocks, how many arrived intact)


def _failure_kind(exc: BaseException) -> str:
    """A metric label for why a transfer failed."""
    if isinstance(exc, StoreFull):
        return "full"
    if isinstance(exc, BlockCorrupt):
        return "corrupt"
    if isinstance(exc, StoreUnavailable):
        return "timeout" if "DEADLINE" in str(exc) else "unavailable"
    return "error"


def _token_axis(block_shape: Sequence[int]) -> int:
    """Where tokens run in a block: [L, 2, T, H, D] (K and V) or [L, T, C] (an MLA latent)."""
    return 2 if len(block_shape) == 5 else 1


def write_tokens(kv: torch.Tensor, block_ids: list[int], tokens: torch.Tensor) -> None:
    """Write `tokens` ([L, 2, T, heads, head_dim], or [L, T, C] for a latent cache) into the first
    T token slots across the full-precision pool blocks `block_ids` of `kv`, in order."""
    axis = _token_axis(kv.shape[1:])
    bs = kv.shape[1 + axis]
    for i, b in enumerate(block_ids):
        n = min(bs, tokens.shape[axis] - i * bs)
        if n <= 0:
            break
        kv[b].narrow(axis, 0, n).copy_(tokens.narrow(axis, i * bs, n))


class LayerPublisher:
    """Streams the layers of a run of new full blocks to the store as prefill computes them.

    A CPU pool whose blocks are stored as they are, into this host's shared memory, is copied
    (and hashed) layer by layer in the caller's thread, straight from the pool: one C pass of a
    few tens of microseconds a layer. Handing that to a thread cost a 1,024-token prefill on 2
    cores 45-60 ms: the forward's OpenMP threads wait at every barrier for a core the publisher
    holds, and its Python work (a gather, then a copy and a hash per block) for the GIL. Other
    pools (a device, a packed store layout, a store across the network) gather each layer and
    send it from a background thread, while later layers compute. The commit goes out as soon as
    the last layer is written, from that thread, while the forward's last layer and its LM head
    still compute: a cold prompt's first token had waited 2.6-5.8 ms for it after the forward.
    Blocks whose every layer is written are complete whatever the forward does afterwards, so a
    forward that fails after that leaves them stored."""

    def __init__(self, connector: KVConnector, writer: BlockWriter, ids: torch.Tensor):
        self._c, self._writer, self._ids = connector, writer, ids
        self._futures: list[Future] = []
        self._inline_error: BaseException | None = None
        self._commit: Future | None = None  # sent at the last layer
        pool = connector.kv
        self._pool_bytes = None
        if not connector.packs and writer.can_copy_layers(pool):
            self._pool_bytes = connector.pool_bytes()
            elt = pool.element_size()
            self._layer_bytes = pool.stride(1) * elt
            self._offsets = [int(b) * pool.stride(0) * elt for b in ids.tolist()]

    def layer_done(self, layer: int) -> None:
        """Called after `layer` is computed: copied into the store now, or gathered now (a copy)
        and sent in the background."""
        if self._pool_bytes is not None:
            if self._inline_error is None:
                try:
                    shift = layer * self._layer_bytes
                    # the forward's threads would only wait for this copy: they share it
                    self._writer.copy_layer(
                        layer,
                        self._pool_bytes,
                        [o + shift for o in self._offsets],
                        threads=torch.get_num_threads(),
                    )
                except Exception as exc:  # noqa: BLE001 - raised again at finish (aborts)
                    self._inline_error = exc
        else:
            data = self._c.kv[self._ids, layer]
            self._futures.append(self._c._publisher.submit(self._write, layer, data))
        if layer == self._writer.header.num_layers - 1 and self._inline_error is None:
            # after every layer's write on the publisher's one thread
            self._commit = self._c._publisher.submit(self._writer.commit)

    def _write(self, layer: int, data: torch.Tensor) -> None:
        if self._c.packs:
            data = self._c.store_layout.pack_layer(data)
        self._writer.write_layer(layer, data.to("cpu"))

    def finish(self, ok: bool) -> bool:
        """The commit's outcome where every layer went (sent at the last one); else commit when
        the forward succeeded, abort when it did not. Whether the store holds every one of the
        blocks now (it may have taken fewer: full, or evicting). A failure is counted and logged;
        `ensure_stored` tries again."""
        try:
            if self._inline_error is not None:
                raise self._inline_error
            for f in self._futures:
                f.result()
            if self._commit is not None:  # every layer went: complete blocks, stored
                result = self._commit.result()
            elif not ok:
                raise RuntimeError("the forward failed")
            else:
                result = self._c._publisher.submit(self._writer.commit).result()
            return result.held == self._ids.numel()
        except Exception as exc:  # noqa: BLE001 - counted and logged; the blocks are put again later
            if ok:
                self._c._error("publish_layerwise", exc)
            try:
                self._c._publisher.submit(self._writer.abort).result()
            except Exception as abort_exc:  # noqa: BLE001
                self._c._error("abort", abort_exc)
            return False


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
        layout,
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
        store_layout=None,
        security=None,
    ):
        self.kv, self.layout, self.fingerprint = kv, layout, fingerprint
        self._pool_bytes = None  # pool_bytes(), made on first use
        self.store_layout = store_layout or layout
        self.security = security  # servekit.SecurityConfig of the store channels (None: open)
        self.packs = self.store_layout.fingerprint_id != layout.fingerprint_id
        self.store_address, self.store_node, self.device_node = (
            store_address,
            store_node,
            device_node,
        )
        self.worker, self.timeout_s = worker or device_node or store_node, timeout_s
        self.device = DeviceTier() if device_node else None
        self._clients: dict[tuple[str, str], StoreClient] = {}  # (address, transport) -> client
        self._clients_lock = threading.Lock()
        self._links: dict[str, Throughput] = {}  # node id -> measured throughput (CacheGen)
        # node id -> what raw fetches from it measured (the Load report, for the policy)
        self._fetch_links: dict[str, LinkModel] = {}
        self._fetch_links_lock = threading.Lock()
        # what one stored block moves over a link: encoded at the store layout's codec (int8 and
        # KIVI blocks are smaller than the pool's), header included
        sl = self.store_layout
        self.wire_block_bytes = make_header(
            sl.store_codec, sl.dtype, tuple(sl.block_shape), fingerprint
        ).total_len
        self._decode_rates: dict[int, float] = {}  # CacheGen level -> pool bytes decoded a second
        # CacheGen: the next chunk crosses the link on this thread while the last one decodes.
        # Both pools' tasks copy with torch ops: their threads free their OpenMP workers after each
        self._fetcher = ReleasingThreadPool(max_workers=1, thread_name_prefix=f"{worker}-fetch")
        self._index = Index(index_url) if index_url else None
        self._publisher = ReleasingThreadPool(max_workers=1, thread_name_prefix=f"{self.worker}-kv")
        self._init_metrics(registry or CollectorRegistry())
        self._local = self.client(store_address)  # fails fast when the host's store is away
        # The device tier as an index node of its own (registered, heartbeats, its changes, its
        # whole listing again after the index lost them), published from a thread of its own.
        self._index_publisher: IndexPublisher | None = None
        if self.device is not None and self._index is not None:
            info = NodeInfo(
                device_node, "", socket.gethostname(), "", 0, 0, fingerprint, time.time()
            )
            self._index_publisher = IndexPublisher(
                self._index,
                info,
                lambda: (self.device.drain_events(), False),
                self.device.listing,
                heartbeat_s=index_ttl_s / 3,
                ttl_s=index_ttl_s,
                period_s=index_period_s,
                # counted here; the publisher logs the first failure of an outage
                on_error=lambda op, exc: self.m_errors.labels(
                    self.worker, f"index_{op}", _failure_kind(exc)
                ).inc(),
            )
            self._index_publisher.start()

    def pool_bytes(self):
        """The pool's bytes as a flat uint8 array (a view, made once), for copies that read
        blocks where they lie; only for a contiguous CPU pool."""
        if self._pool_bytes is None:
            self._pool_bytes = self.kv.reshape(-1).view(torch.uint8).numpy()
        return self._pool_bytes

    def _init_metrics(self, r: CollectorRegistry) -> None:
        self.m_blocks = Counter(
            "halfmoon_kv_loaded_blocks",
            "Blocks moved into the pool, by source tier",
            ["worker", "tier"],
            registry=r,
        )
        self.m_misses = Counter(
            "halfmoon_kv_missed_blocks",
            "Blocks asked for and not loaded (recomputed instead), by operation",
            ["worker", "op"],
            registry=r,
        )
        self.m_errors = Counter(
            "halfmoon_kv_errors",
            "Connector failures by operation and kind",
            ["worker", "op", "kind"],
            registry=r,
        )
        self.m_cachegen_bytes = Counter(
            "halfmoon_kv_cachegen_bytes",
            "Bytes of CacheGen chunks fetched (what crossed the link)",
            ["worker"],
            registry=r,
        ).labels(self.worker)
        self.m_cachegen_blocks = Counter(
            "halfmoon_kv_cachegen_blocks",
            "Blocks loaded from CacheGen chunks",
            ["worker"],
            registry=r,
        ).labels(self.worker)
        self.m_published = Counter(
            "halfmoon_kv_published_blocks",
            "Blocks written to the store",
            ["worker", "how"],
            registry=r,
        )

    def _error(self, op: str, exc: BaseException) -> None:
        kind = _failure_kind(exc)
        self.m_errors.labels(self.worker, op, kind).inc()
        log.warning("%s: kv %s failed (%s): %s: %s", self.worker, op, kind, type(exc).__name__, exc)

    def _miss(self, op: str, n: int) -> None:
        if n > 0:
            self.m_misses.labels(self.worker, op).inc(n)

    # ---- clients ----

    def client(self, address: str, transport: str = "auto") -> StoreClient:
        """The client of the store node at `address` over `transport` (StoreClient's: "auto" =
        shm on this host; one per address and transport, made on first use)."""
        with self._clients_lock:
            c = self._clients.get((address, transport))
            if c is None:
                # Outside inference mode: the client maps its shm slab as a tensor later writes
                # update, which inference tensors would forbid.
                with torch.inference_mode(False):
                    c = self._clients[(address, transport)] = StoreClient(
                        address,
                        transport,
                        timeout_s=self.timeout_s,
                        security=self.security,
                        # a bulk port that would not open: blocks go over gRPC, counted
                        on_fallback=lambda why: self.m_errors.labels(
                            self.worker, "bulk_connect", "fallback"
                        ).inc(),
                    )
            return c

    def _node_client(self, node: str, transport: str = "auto") -> StoreClient | None:
        """The client of the store node an index id names; None (counted) when unknown."""
        if node == self.store_node:
            return (
                self._local if transport == "auto" else self.client(self.store_address, transport)
            )
        try:
            info = self._index.nodes().get(node) if self._index is not None else None
            if info is None or not info.address:
                raise KeyError(f"store node {node!r} is not in the index")
            return self.client(info.address, transport)
        except Exception as exc:  # noqa: BLE001 - the prefix is recomputed instead
            self._error("resolve_node", exc)
            return None

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
        table: list[int] = []
        pinned: list[bytes] = []
        counts = dict.fromkeys(TIERS, 0)
        fetched, fetch_ms = 0, 0.0
        t0 = time.perf_counter()
        try:
            if self.device is not None and cap:
                table.extend(self.device.match(keys[:cap]))
                pinned = list(keys[: len(table)])
                counts["device"] = len(table)
                self.m_blocks.labels(self.worker, "device").inc(len(table))
            if len(table) < cap:
                for tier in self._load_run(
                    self._local, keys[len(table) : cap], table, allocate, free, "load_local"
                ):
                    counts["ssd" if tier == "ssd" else "dram"] += 1
            want = min(cap, fetch_blocks)
            if (
                fetch_from
                and fetch_from not in (self.store_node, self.device_node)
                and len(table) < want
            ):
                remote = self._node_client(fetch_from)
                if remote is None:
                    self._miss("load_remote", want - len(table))
                else:
                    link: list[float] = []
                    got = self._load_run(
                        remote, keys[len(table) : want], table, allocate, free, "load_remote", link
                    )
                    counts["remote"] += len(got)
                    if got:
                        fetched = len(got) * self.wire_block_bytes
                        fetch_ms = sum(link)
                        self._measured(fetch_from, link[0], fetched, link[1])
        except BaseException:
            self.drop(table, pinned, free)
            raise
        for tier in ("dram", "ssd", "remote"):
            if counts[tier]:
                self.m_blocks.labels(self.worker, tier).inc(counts[tier])
        took = (time.perf_counter() - t0) * 1000.0
        return PrefixLoad(table, pinned, counts, took, fetched, fetch_ms)

    def _load_run(self, client, keys, table, allocate, free, op, times=None) -> list[str]:
        """Append to `table` pool blocks holding the longest held run of `keys` at `client`;
        the tiers they came from. `times`, when given, gets the lookup's and the transfer's ms."""
        if not keys:
            return []
        t0 = time.perf_counter()
        try:
            found = client.lookup(list(keys))
        except Exception as exc:  # noqa: BLE001 - a lookup that fails is a miss
            self._error(op, exc)
            return []
        n = found.num_blocks
        if n == 0:
            return []
        ids = allocate(n)
        t1 = time.perf_counter()
        got = self._get_into(client, list(keys[:n]), ids, op)
        if times is not None:
            times[:] = [(t1 - t0) * 1000.0, (time.perf_counter() - t1) * 1000.0]
        free(ids[got:])
        table.extend(ids[:got])
        return list(found.tiers[:got])

    def _measured(self, node: str, lookup_ms: float, nbytes: int, transfer_ms: float) -> None:
        with self._fetch_links_lock:
            self._fetch_links.setdefault(node, LinkModel()).add(lookup_ms, nbytes, transfer_ms)

    def links(self) -> dict[str, LinkSpeed]:
        """Store node id -> the link to it as this worker's fetches measured it."""
        with self._fetch_links_lock:
            return {node: m.speed() for node, m in self._fetch_links.items()}

    def _get_into(self, client: StoreClient, keys: list[bytes], ids: list[int], op: str) -> int:
        """Copy the leading held blocks of `keys` into pool blocks `ids`; how many. Where the
        pool holds blocks as they are stored (a CPU pool of the store layout), the client
        copies each straight into its pool block: no staging tensor to allocate and fault in,
        and no second copy (a 960-token pull of SmolLM2 in bf16 is 60 blocks, 22 MB)."""
        if self._pool_takes_stored():
            got = self._transfer(client, keys, self.kv, op, rows=ids)
        else:
            staging, got = self._get_staged(client, keys, op)
            self._write_staged(staging[:got], ids[:got])
        self._miss(op, len(keys) - got)
        return got

    def _transfer(self, client: StoreClient, keys, out: torch.Tensor, op: str, rows=None) -> int:
        """client.get_into(keys, out, rows); a failed transfer is counted and logged (0 blocks:
        a miss)."""
        try:
            return client.get_into(keys, out, rows=rows)
        except Exception as exc:  # noqa: BLE001 - a failed transfer is a miss
            self._error(op, exc)
            return 0

    def _pool_takes_stored(self) -> bool:
        """Whether stored blocks are this pool's blocks byte for byte, in host memory."""
        return (
            not self.packs
            and self.kv.device.type == "cpu"
            and self.kv.is_contiguous()
            and tuple(self.kv.shape[1:]) == tuple(self.store_layout.block_shape)
            and self.kv.dtype == self.store_layout.dtype
        )

    def _get_staged(
        self, client: StoreClient, keys: list[bytes], op: str
    ) -> tuple[torch.Tensor, int]:
        """The leading held blocks of `keys` in host memory, as stored (checked by the client: a
        block that fails its checks ends the run): (staging [len(keys), *store block], how many
        of its leading blocks hold them). A failed transfer is counted and logged (0 blocks)."""
        staging = torch.empty(
            (len(keys), *self.store_layout.block_shape),
            dtype=self.store_layout.dtype,
            pin_memory=self.kv.is_cuda,
        )
        return staging, self._transfer(client, keys, staging, op)

    def _write_staged(self, staged: torch.Tensor, ids: list[int]) -> None:
        """Stored blocks from `_get_staged` (unpacked when the store layout packs) into pool
        blocks `ids`."""
        if not ids:
            return
        idx = torch.tensor(ids, dtype=torch.long, device=self.kv.device)
        blocks = staged.to(self.kv.device, non_blocking=True)
        if self.packs:
            blocks = self.store_layout.unpack(blocks, self.kv.dtype)
        self.kv[idx] = blocks

    def pull(self, address: str, keys: Sequence[bytes], ids: Sequence[int]) -> int:
        """Decode side: the leading blocks of `keys` held at the store node at `address` into
        pool blocks `ids`; how many (the rest is the caller's to recompute)."""
        if not keys:
            return 0
        try:
            client = self.client(address or self.store_address)
        except Exception as exc:  # noqa: BLE001 - unreachable store: everything is a miss
            self._error("pull", exc)
            self._miss("pull", len(keys))
            return 0
        got = self._get_into(client, list(keys), list(ids), "pull")
        self.m_blocks.labels(self.worker, "pull").inc(got)
        return got

    # ---- the tail, carried inline in full precision ----

    def encode_tail(self, block_ids: Sequence[int], tokens: int) -> bytes:
        """The first `tokens` token slots across full-precision pool blocks `block_ids`, as one
        block in the block format (checksummed): `[L, 2, tokens, heads, head_dim]`, or
        `[L, tokens, C]` for an MLA latent cache."""
        blocks = self.kv[torch.tensor(list(block_ids), dtype=torch.long, device=self.kv.device)]
        if blocks.dim() == 4:  # MLA latent blocks [n, L, bs, C]
            n, layers, bs, width = blocks.shape
            tail = blocks.permute(1, 0, 2, 3).reshape(layers, n * bs, width)[:, :tokens]
        else:
            n, layers, two, bs, heads, dim = blocks.shape
            tail = blocks.permute(1, 2, 0, 3, 4, 5).reshape(layers, two, n * bs, heads, dim)
            tail = tail[:, :, :tokens]
        return encode_block(tail.contiguous().to("cpu"), self.fingerprint)

    def decode_tail(self, data: bytes, tokens: int, shape: tuple[int, ...]) -> torch.Tensor | None:
        """An inline tail `[L, 2, tokens, heads, head_dim]` or `[L, tokens, C]` (`shape`: a
        full-precision block's);
        None (counted and logged) when it is corrupt, of another model or of the wrong shape."""
        try:
            tail = decode_block(data, model_fingerprint=self.fingerprint)
            axis = _token_axis(shape)
            if tuple(tail.shape) != (*shape[:axis], tokens, *shape[axis + 1 :]):
                raise BlockCorrupt(f"tail block is {list(tail.shape)}, expected {tokens} tokens")
        except Exception as exc:  # noqa: BLE001 - recomputed by the caller
            self._error("tail", exc)
            return None
        return tail

    def load_tail(self, data: bytes, tokens: int, block_ids: Sequence[int]) -> bool:
        """Write an inline tail into the first `tokens` slots across full-precision pool blocks
        `block_ids`; False (counted) when it cannot be used."""
        tail = self.decode_tail(data, tokens, self.layout.block_shape)
        if tail is None:
            return False
        write_tokens(self.kv, list(block_ids), tail.to(self.kv.device, self.kv.dtype))
        return True

    # ---- publishing ----

    def open_layerwise(
        self, keys: Sequence[bytes], ids: Sequence[int], parent: bytes | None
    ) -> LayerPublisher | None:
        """A publisher for new full blocks `keys` held in pool blocks `ids`, written layer by
        layer as they are computed; None (counted) when the store cannot take them now."""
        if not keys:
            return None
        try:
            writer = self._local.open_put(
                list(keys),
                self.store_layout.block_shape,
                self.store_layout.dtype,
                self.fingerprint,
                self.store_layout.store_codec,
                parent=parent,
            )
        except Exception as exc:  # noqa: BLE001 - compute anyway; ensure_stored tries again
            self._error("open_layerwise", exc)
            return None
        self.m_published.labels(self.worker, "layerwise").inc(len(keys))
        idx = torch.tensor(list(ids), dtype=torch.long, device=self.kv.device)
        return LayerPublisher(self, writer, idx)

    def ensure_stored(self, keys: Sequence[bytes], ids: Sequence[int]) -> int:
        """Every block of `keys` (in pool blocks `ids`) in this host's store, so that a decode
        worker can pull them all; how many the store holds afterwards."""
        if not keys:
            return 0
        try:
            held = self._local.lookup(list(keys)).num_blocks
        except Exception as exc:  # noqa: BLE001
            self._error("ensure_stored", exc)
            return 0
        if held == len(keys):
            return held
        parent = keys[held - 1] if held else None
        return held + self.put(keys[held:], ids[held : len(keys)], parent, "ensure_stored")

    def put_blocks(
        self, keys: Sequence[bytes], blocks: torch.Tensor, parent: bytes | None, op: str = "put"
    ) -> int:
        """Write blocks already in the store layout (`[n, *store_layout.block_shape]`) under
        `keys` to this host's store; how many it took."""
        try:
            n = self._local.put(
                list(keys),
                blocks.to("cpu"),
                self.fingerprint,
                self.store_layout.store_codec,
                parent=parent,
            )
        except Exception as exc:  # noqa: BLE001 - a decode worker recomputes what it cannot pull
            self._error(op, exc)
            return 0
        self.m_published.labels(self.worker, op).inc(len(keys))
        return n

    def put(
        self, keys: Sequence[bytes], ids: Sequence[int], parent: bytes | None, op: str = "put"
    ) -> int:
        """Write pool blocks `ids` under `keys` to this host's store; how many it took."""
        if not keys:
            return 0
        idx = torch.tensor(list(ids), dtype=torch.long, device=self.kv.device)
        blocks = self.kv[idx]
        if self.packs:
            blocks = self.store_layout.pack(blocks)
        return self.put_blocks(keys, blocks, parent, op)

    # ---- CacheGen chunks (kvstore/cachegen_stream.py) ----

    def publish_chunks(
        self, keys: Sequence[bytes], ids: Sequence[int], levels: Sequence[int], chunk_blocks: int
    ) -> Future | None:
        """Encode every whole chunk of the run `keys` (from block 0; pool blocks `ids`, full
        precision) that this host's store lacks at any of `levels`, and put it there. The chunks
        are copied out of the pool now and encoded in the background: the Future gives the
        records written (None: nothing to do). Failures are counted and logged; the raw blocks
        serve the prefix anyway."""
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
            self._error("publish_chunks", exc)
            return None
        chunks = sorted({c for cs in todo.values() for c in cs})
        if not chunks:
            return None
        copies = {}
        for c in chunks:
            idx = torch.tensor(
                list(ids[c * chunk_blocks : (c + 1) * chunk_blocks]),
                dtype=torch.long,
                device=self.kv.device,
            )
            copies[c] = self.kv[idx].float().cpu()
        return self._publisher.submit(self._put_chunks, list(keys), todo, copies, chunk_blocks)

    def _put_chunks(self, keys, todo, copies, chunk_blocks) -> int:
        written = 0
        for level, cs in todo.items():
            for c in cs:
                try:
                    payload = encode_chunk(copies[c], level)
                    written += self._local.put(
                        [chunk_key(keys[(c + 1) * chunk_blocks - 1], level)],
                        payload[None],
                        self.fingerprint,
                        codec=f"cachegen{level}",
                    )
                except Exception as exc:  # noqa: BLE001 - the raw blocks still serve the prefix
                    self._error("publish_chunks", exc)
        self.m_published.labels(self.worker, "cachegen").inc(written)
        return written

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
        (kvstore/cachegen_stream.py): a CacheGen level, or the chunk's blocks as stored
        (RAW_LEVEL, lossless, when plan.raw), from the measured link throughput, the measured
        decode (or copy) time of each option and the remaining budget. The link carries chunks
        one after another up to PREFETCH_CHUNKS ahead of the one this thread decodes or copies;
        chunks enter the pool in order. Stops at the first chunk that is not held, fails its
        checks, or is better recomputed."""
        c_blocks = plan.chunk_blocks
        start = len(table)  # blocks loaded already (the first chunk may hold some)
        first, last = start // c_blocks, want // c_blocks  # chunks [first, last)
        levels, t0 = [], time.perf_counter()
        moved = coded_bytes = coded_blocks = 0
        decode_s = wait_s = 0.0
        # Over gRPC even on this host: every chunk crosses the link the rule measures (a record
        # always does, StoreClient.get_record), so raw blocks must too, not the shm slab.
        client = self._node_client(fetch_from, "grpc") if last > first else None
        if client is None:
            return ChunkFetch(levels, 0, 0, 0.0)
        sizes = self._option_sizes(client, keys, start, first, last, plan)
        link = self._links.setdefault(fetch_from, Throughput(plan.prior_bytes_per_s))
        chunk_bytes = c_blocks * self.layout.block_bytes
        on_link: deque[_OnLink] = deque()  # chunks queued on the link, in chunk order

        def options(c: int) -> dict[int, OptionCost]:
            """Chunk c's options (those the node holds) and what each takes on each stage."""
            bw = max(link.bytes_per_s, 1.0)
            return {
                option: OptionCost(sz[c - first] / bw, self._decode_s(option, chunk_bytes))
                for option, sz in sizes.items()
                if c - first < len(sz)
            }

        def queue(c: int, busy_s: float) -> bool:
            """Choose chunk c's option and queue its transfer (this thread busy for `busy_s` more
            seconds first); False: recompute from here."""
            link_free, decode_free = self._queues_free(on_link, busy_s)
            here = options(c)
            after = options(c + 1) if c + 1 < last else {}
            costs = chunk_costs(here, after, link_free, decode_free)
            remaining = plan.deadline - time.perf_counter() - decode_free
            choice = choose_level(
                costs.alone, remaining, last - c, plan.recompute_s_per_chunk, costs.paired
            )
            log.debug(
                "%s: chunk %d -> %d (%.1f ms, budget %.1f ms; link %.3g MB/s, %d queued)",
                self.worker,
                c,
                choice.level,
                choice.predicted_s * 1e3,
                choice.budget_s * 1e3,
                link.bytes_per_s / 1e6,
                len(on_link),
            )
            if choice.level == 0:
                return False
            if choice.level == RAW_LEVEL:
                ks = list(keys[max(start, c * c_blocks) : (c + 1) * c_blocks])
                nbytes = sizes[RAW_LEVEL][c - first]
                fut = self._fetcher.submit(self._timed_raw, client, ks, nbytes, link)
            else:
                ks = [chunk_key(keys[(c + 1) * c_blocks - 1], choice.level)]
                fut = self._fetcher.submit(self._timed_get, client, ks[0], link)
            on_link.append(_OnLink(c, choice.level, here[choice.level], ks, fut))
            return True

        next_c = first  # the next chunk to choose an option for

        def fill(busy_s: float) -> None:
            """Queue chunks until the link has work for the `busy_s` seconds this thread is busy
            landing a chunk (so it never idles while this thread cannot choose), and at least
            one; at most PREFETCH_CHUNKS. Choosing later, once the chunks before have arrived,
            chooses with their throughput measured."""
            nonlocal next_c
            while next_c < last and len(on_link) < PREFETCH_CHUNKS:
                if on_link and self._queues_free(on_link, busy_s)[0] >= busy_s:
                    return
                next_c = next_c + 1 if queue(next_c, busy_s) else last  # last: queue no more

        try:
            fill(0.0)
            while on_link:
                q = on_link.popleft()
                t = time.perf_counter()
                got = q.future.result()
                t1 = time.perf_counter()
                wait_s += t1 - t
                if q.option == RAW_LEVEL:
                    staging, n = got
                    if n < len(q.keys):
                        why = f"{n} of its {len(q.keys)} blocks arrived intact"
                        log.warning(STOPPED, self.worker, q.chunk, fetch_from, why)
                        break
                    fill(q.cost.decode_s)  # the link carries what follows while this one lands
                    ids = allocate(n)
                    self._write_staged(staging, ids)
                    moved += sizes[RAW_LEVEL][q.chunk - first]
                    landed_bytes = n * self.layout.block_bytes
                else:
                    if got is None:
                        why = f"its level {q.option} record is not held or failed its checks"
                        log.warning(STOPPED, self.worker, q.chunk, fetch_from, why)
                        break
                    fill(q.cost.decode_s)  # the link carries what follows while this decodes
                    try:
                        blocks = self._decode_chunk(got, c_blocks)
                    except Exception as exc:  # noqa: BLE001 - corrupt or foreign: a miss, never wrong KV
                        self._error("fetch_chunks", exc)
                        break
                    skip = len(table) - q.chunk * c_blocks  # blocks of this chunk loaded already
                    ids = allocate(c_blocks - skip)
                    idx = torch.tensor(ids, dtype=torch.long, device=self.kv.device)
                    self.kv[idx] = blocks[skip:].to(self.kv.device, self.kv.dtype)
                    moved += len(got)
                    coded_bytes += len(got)
                    coded_blocks += len(ids)
                    landed_bytes = chunk_bytes  # the whole chunk decoded
                took = time.perf_counter() - t1
                self._decoded(q.option, took, landed_bytes)
                decode_s += took
                table.extend(ids)
                levels.append(q.option)
        finally:
            for q in on_link:  # transfers queued for chunks that will not be used
                if not q.future.cancel():
                    q.future.result()  # the _timed_* count their failures and never raise
        added = len(table) - start
        self._miss("fetch_chunks", want - len(table))
        if added:
            self.m_blocks.labels(self.worker, "remote").inc(added)
            self.m_cachegen_bytes.inc(coded_bytes)
            self.m_cachegen_blocks.inc(coded_blocks)
        ms = (time.perf_counter() - t0) * 1000.0
        return ChunkFetch(levels, added, moved, ms, decode_s * 1000.0, wait_s * 1000.0)

    def _option_sizes(
        self,
        client: StoreClient,
        keys: Sequence[bytes],
        start: int,
        first: int,
        last: int,
        plan: ChunkPlan,
    ) -> dict[int, list[int]]:
        """Option -> the bytes of chunks first, first+1, ... (the leading run the node holds, up
        to `last`) at it: plan.levels (their records), and RAW_LEVEL when plan.raw (the chunk's
        blocks from block `start` on: those loaded already are not fetched again)."""
        c_blocks = plan.chunk_blocks
        sizes: dict[int, list[int]] = {}
        for level in plan.levels:
            try:
                found = client.lookup(chunk_keys(list(keys[: last * c_blocks]), c_blocks, level))
            except Exception as exc:  # noqa: BLE001 - that level is unavailable
                self._error("fetch_chunks", exc)
                continue
            sizes[level] = list(found.sizes[first:])
        if plan.raw:
            try:
                found = client.lookup(list(keys[start : last * c_blocks]))
            except Exception as exc:  # noqa: BLE001 - the raw blocks are unavailable
                self._error("fetch_chunks", exc)
                return sizes
            raw = sizes[RAW_LEVEL] = []
            for c in range(first, last):
                lo, hi = max(start, c * c_blocks) - start, (c + 1) * c_blocks - start
                if hi > found.num_blocks:
                    break
                raw.append(sum(found.sizes[lo:hi]))
        return sizes

    @staticmethod
    def _queues_free(on_link: deque, busy_s: float) -> tuple[float, float]:
        """When the link and this thread (busy `busy_s` more seconds first) are predicted free,
        seconds from now, of the chunks queued on the link: each arrives after those before it
        (one that arrived: now; the one crossing is counted whole, a little late) and lands after
        the one before it."""
        link_free, decode_free = 0.0, busy_s
        for q in on_link:
            if q.future.done():
                decode_free += q.cost.decode_s
            else:
                link_free, decode_free = pipeline_done(link_free, decode_free, q.cost)
        return link_free, decode_free

    def _timed_raw(
        self, client: StoreClient, keys: list[bytes], nbytes: int, link: Throughput
    ) -> tuple[torch.Tensor, int]:
        """A raw chunk's blocks (`nbytes` on the wire) over the link into host memory, checked,
        the throughput measured when all arrived: (staging, how many leading blocks arrived)."""
        t = time.perf_counter()
        staging, got = self._get_staged(client, keys, "fetch_chunks")
        if got == len(keys):
            link.add(nbytes, time.perf_counter() - t)
        return staging, got

    def _timed_get(self, client: StoreClient, key: bytes, link: Throughput) -> bytes | None:
        """One chunk record over the link, its throughput measured; None (counted) on failure."""
        t = time.perf_counter()
        try:
            record = client.get_record(key, self.fingerprint)
        except Exception as exc:  # noqa: BLE001 - a failed transfer is a miss
            self._error("fetch_chunks", exc)
            record = None
        link.add(len(record) if record else 0, time.perf_counter() - t)
        return record

    def _decode_chunk(self, record: bytes, c_blocks: int) -> torch.Tensor:
        """A checked chunk record decoded into pool blocks [C, L, 2, bs, H, D]."""
        h = parse_header(record)
        blocks = tokens_to_blocks(
            decode_chunk_record(record, h, self.kv.dtype), self.layout.block_size
        )
        if blocks.shape[0] != c_blocks or tuple(blocks.shape[1:]) != tuple(self.kv.shape[1:]):
            raise BlockCorrupt(f"chunk decodes to {list(blocks.shape)}")
        return blocks

    def _decode_s(self, option: int, chunk_bytes: int) -> float:
        """Predicted seconds to decode one chunk at a level, or to copy its raw blocks into the
        pool (RAW_LEVEL): measured here, else a prior."""
        prior = COPY_PRIOR_BYTES_PER_S if option == RAW_LEVEL else DECODE_PRIOR_BYTES_PER_S
        return chunk_bytes / self._decode_rates.get(option, prior)

    def _decoded(self, option: int, seconds: float, pool_bytes: int) -> None:
        """Record the time one chunk took to land (decode or copy): pool bytes per second,
        smoothed, per option."""
        if seconds > 0:
            rate = pool_bytes / seconds
            old = self._decode_rates.get(option)
            self._decode_rates[option] = rate if old is None else 0.7 * rate + 0.3 * old

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
        n = len(keys)
        rest = list(table[n:])
        fresh_keys, fresh_ids = list(keys[len(pinned) : n]), list(table[len(pinned) : n])
        if self.device is not None:
            self.device.release(pinned)
            rest += self.device.insert(fresh_keys, fresh_ids)
        else:
            rest += fresh_ids
        free(rest)

    def drop(
        self, table: list[int], pinned: Sequence[bytes], free: Callable[[list[int]], None]
    ) -> None:
        """Give back what a request held without keeping anything: pins released, the blocks
        it owns (after the pinned ones) freed."""
        if self.device is not None:
            self.device.release(pinned)
        free(list(table[len(pinned) :]))

    def evict_device(self, n: int) -> list[int]:
        """Up to n unpinned device-tier blocks, least recently used first (now the caller's)."""
        return self.device.evict(n) if self.device is not None else []

    def device_blocks(self) -> int:
        return len(self.device) if self.device is not None else 0

    # ---- lifecycle ----

    def close(self) -> None:
        if self._index_publisher is not None:
            self._index_publisher.stop()
        self._publisher.shutdown(wait=True)
        self._fetcher.shutdown(wait=True)
        if self._index is not None:
            if self.device is not None:
                try:
                    self._index.unregister(self.device_node)
                except Exception as exc:  # noqa: BLE001
                    self._error("index_unregister", exc)
            self._index.close()
        with self._clients_lock:
            for c in self._clients.values():
                c.close()
            self._clients.clear()
