"""Streaming a prefix's CacheGen chunks from another node (kvstore/client/cachegen_stream.py):
chunk by chunk, each at the option CacheGen's rule picks for the link as measured and the budget
left (a coded level, or the chunk's blocks as stored), the next chunks crossing the link while
this thread lands one in the pool."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from typing import NamedTuple

import torch

from kvstore.block_header import BlockCorrupt
from kvstore.client.block_format import parse_header
from kvstore.client.cachegen_stream import (
    RAW_LEVEL,
    OptionCost,
    Throughput,
    choose_level,
    chunk_costs,
    chunk_key,
    chunk_keys,
    decode_chunk_record,
    pipeline_done,
    tokens_to_blocks,
)
from kvstore.client.connector_clients import StoreClients
from kvstore.client.connector_metrics import ConnectorMetrics, log
from kvstore.client.connector_pool import PoolIO
from kvstore.client.store_client import StoreClient

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


def _queues_free(on_link: deque[_OnLink], busy_s: float) -> tuple[float, float]:
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


class LandingRates:
    """How fast each option's chunks land in the pool (decoded, or copied: RAW_LEVEL), as
    measured on this worker, with a prior until they are."""

    def __init__(self) -> None:
        self._rates: dict[int, float] = {}  # option -> pool bytes landed a second, smoothed

    def decode_s(self, option: int, chunk_bytes: int) -> float:
        """Predicted seconds to decode one chunk at a level, or to copy its raw blocks into the
        pool (RAW_LEVEL): measured here, else a prior."""
        prior = COPY_PRIOR_BYTES_PER_S if option == RAW_LEVEL else DECODE_PRIOR_BYTES_PER_S
        return chunk_bytes / self._rates.get(option, prior)

    def decoded(self, option: int, seconds: float, pool_bytes: int) -> None:
        """Record the time one chunk took to land (decode or copy): pool bytes per second,
        smoothed, per option."""
        if seconds > 0:
            rate = pool_bytes / seconds
            old = self._rates.get(option)
            self._rates[option] = rate if old is None else 0.7 * rate + 0.3 * old


class ChunkFetcher:
    """Fetches chunks into `pool` from the nodes `clients` reach; their transfers run on
    `fetcher` (one thread: the link carries one chunk at a time, in order)."""

    def __init__(
        self, pool: PoolIO, clients: StoreClients, fetcher: Executor, metrics: ConnectorMetrics
    ) -> None:
        self._pool, self._clients = pool, clients
        self._fetcher, self._metrics = fetcher, metrics
        self._links: dict[str, Throughput] = {}  # node id -> measured throughput
        self._rates = LandingRates()

    def fetch_chunks(
        self,
        fetch_from: str,
        keys: Sequence[bytes],
        table: list[int],
        want: int,
        allocate: Callable[[int], list[int]],
        plan: ChunkPlan,
    ) -> ChunkFetch:
        """See KVConnector.fetch_chunks."""
        c_blocks = plan.chunk_blocks
        start = len(table)  # blocks loaded already (the first chunk may hold some)
        first, last = start // c_blocks, want // c_blocks  # chunks [first, last)
        levels: list[int] = []
        t0 = time.perf_counter()
        moved = coded_bytes = coded_blocks = 0
        decode_s = wait_s = 0.0
        # Over gRPC even on this host: every chunk crosses the link the rule measures (a record
        # always does, StoreClient.get_record), so raw blocks must too, not the shm slab.
        client = self._clients.for_node(fetch_from, "grpc") if last > first else None
        if client is None:
            return ChunkFetch(levels, 0, 0, 0.0)
        sizes = self._option_sizes(client, keys, start, first, last, plan)
        link = self._links.setdefault(fetch_from, Throughput(plan.prior_bytes_per_s))
        chunk_bytes = c_blocks * self._pool.layout.block_bytes
        on_link: deque[_OnLink] = deque()  # chunks queued on the link, in chunk order

        def options(c: int) -> dict[int, OptionCost]:
            """Chunk c's options (those the node holds) and what each takes on each stage."""
            bw = max(link.bytes_per_s, 1.0)
            return {
                option: OptionCost(sz[c - first] / bw, self._rates.decode_s(option, chunk_bytes))
                for option, sz in sizes.items()
                if c - first < len(sz)
            }

        def queue(c: int, busy_s: float) -> bool:
            """Choose chunk c's option and queue its transfer (this thread busy for `busy_s` more
            seconds first); False: recompute from here."""
            link_free, decode_free = _queues_free(on_link, busy_s)
            here = options(c)
            after = options(c + 1) if c + 1 < last else {}
            costs = chunk_costs(here, after, link_free, decode_free)
            remaining = plan.deadline - time.perf_counter() - decode_free
            choice = choose_level(
                costs.alone, remaining, last - c, plan.recompute_s_per_chunk, costs.paired
            )
            log.debug(
                "%s: chunk %d -> %d (%.1f ms, budget %.1f ms; link %.3g MB/s, %d queued)",
                self._metrics.worker,
                c,
                choice.level,
                choice.predicted_s * 1e3,
                choice.budget_s * 1e3,
                link.bytes_per_s / 1e6,
                len(on_link),
            )
            if choice.level == 0:
                return False
            fut: Future  # of a raw chunk's blocks, or of a coded chunk's record
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
                if on_link and _queues_free(on_link, busy_s)[0] >= busy_s:
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
                        log.warning(STOPPED, self._metrics.worker, q.chunk, fetch_from, why)
                        break
                    fill(q.cost.decode_s)  # the link carries what follows while this one lands
                    ids = allocate(n)
                    self._pool.write_staged(staging, ids)
                    moved += sizes[RAW_LEVEL][q.chunk - first]
                    landed_bytes = n * self._pool.layout.block_bytes
                else:
                    if got is None:
                        why = f"its level {q.option} record is not held or failed its checks"
                        log.warning(STOPPED, self._metrics.worker, q.chunk, fetch_from, why)
                        break
                    fill(q.cost.decode_s)  # the link carries what follows while this decodes
                    try:
                        blocks = self._decode_chunk(got, c_blocks)
                    except Exception as exc:  # noqa: BLE001 - corrupt or foreign: a miss, never wrong KV
                        self._metrics.error("fetch_chunks", exc)
                        break
                    skip = len(table) - q.chunk * c_blocks  # blocks of this chunk loaded already
                    ids = allocate(c_blocks - skip)
                    idx = torch.tensor(ids, dtype=torch.long, device=self._pool.kv.device)
                    self._pool.kv[idx] = blocks[skip:].to(self._pool.kv.device, self._pool.kv.dtype)
                    moved += len(got)
                    coded_bytes += len(got)
                    coded_blocks += len(ids)
                    landed_bytes = chunk_bytes  # the whole chunk decoded
                took = time.perf_counter() - t1
                self._rates.decoded(q.option, took, landed_bytes)
                decode_s += took
                table.extend(ids)
                levels.append(q.option)
        finally:
            for q in on_link:  # transfers queued for chunks that will not be used
                if not q.future.cancel():
                    q.future.result()  # the _timed_* count their failures and never raise
        added = len(table) - start
        self._metrics.miss("fetch_chunks", want - len(table))
        if added:
            self._metrics.loaded("remote", added)
            self._metrics.m_cachegen_bytes.inc(coded_bytes)
            self._metrics.m_cachegen_blocks.inc(coded_blocks)
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
                self._metrics.error("fetch_chunks", exc)
                continue
            sizes[level] = list(found.sizes[first:])
        if plan.raw:
            try:
                found = client.lookup(list(keys[start : last * c_blocks]))
            except Exception as exc:  # noqa: BLE001 - the raw blocks are unavailable
                self._metrics.error("fetch_chunks", exc)
                return sizes
            raw = sizes[RAW_LEVEL] = []
            for c in range(first, last):
                lo, hi = max(start, c * c_blocks) - start, (c + 1) * c_blocks - start
                if hi > found.num_blocks:
                    break
                raw.append(sum(found.sizes[lo:hi]))
        return sizes

    def _timed_raw(
        self, client: StoreClient, keys: list[bytes], nbytes: int, link: Throughput
    ) -> tuple[torch.Tensor, int]:
        """A raw chunk's blocks (`nbytes` on the wire) over the link into host memory, checked,
        the throughput measured when all arrived: (staging, how many leading blocks arrived)."""
        t = time.perf_counter()
        staging, got = self._pool.get_staged(client, keys, "fetch_chunks")
        if got == len(keys):
            link.add(nbytes, time.perf_counter() - t)
        return staging, got

    def _timed_get(self, client: StoreClient, key: bytes, link: Throughput) -> bytes | None:
        """One chunk record over the link, its throughput measured; None (counted) on failure."""
        t = time.perf_counter()
        try:
            record = client.get_record(key, self._pool.fingerprint)
        except Exception as exc:  # noqa: BLE001 - a failed transfer is a miss
            self._metrics.error("fetch_chunks", exc)
            record = None
        link.add(len(record) if record else 0, time.perf_counter() - t)
        return record

    def _decode_chunk(self, record: bytes, c_blocks: int) -> torch.Tensor:
        """A checked chunk record decoded into pool blocks [C, L, 2, bs, H, D]."""
        h = parse_header(record)
        blocks = tokens_to_blocks(
            decode_chunk_record(record, h, self._pool.kv.dtype), self._pool.layout.block_size
        )
        if blocks.shape[0] != c_blocks or tuple(blocks.shape[1:]) != tuple(self._pool.kv.shape[1:]):
            raise BlockCorrupt(f"chunk decodes to {list(blocks.shape)}")
        return blocks
