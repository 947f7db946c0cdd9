"""CacheGen in serving: a prefill worker stores each whole chunk of a prompt at every level beside
its blocks; a prefill worker on another "host" streams that prefix chunk by chunk, each at the
option CacheGen's rule picks (a level, or the chunk's stored blocks, RAW_LEVEL) from the measured
throughput of a paced link and the TTFT budget, and recomputes when no option can make it."""

from __future__ import annotations

import random
import threading
import time
from typing import NamedTuple

import grpc
import pytest
import torch
from prometheus_client import CollectorRegistry
from serving_cluster import Cluster

from kernels import FullKVLayout
from kvstore import block_keys
from kvstore.client import (
    CACHEGEN_LEVELS,
    RAW_LEVEL,
    ChunkPlan,
    KVConnector,
    StoreClient,
    chunk_keys,
    parse_header,
)
from kvstore.client.cachegen_stream import encode_chunk
from kvstore.node import StoreConfig, StoreNode
from model import load_model
from protos import halfmoon_pb2 as pb
from protos import halfmoon_pb2_grpc as pb_grpc

BS, CHUNK = 16, 2  # chunks of 2 blocks: 32 tokens


@pytest.fixture(scope="module")
def lm():
    return load_model("tiny-random")


def rand_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 259) for _ in range(n)]


@pytest.fixture(scope="module")
def cluster(lm):
    with Cluster(
        lm,
        num_prefill=2,
        hosts=2,
        prefill={
            "device_cache": False,
            "cachegen_levels": list(CACHEGEN_LEVELS),
            "cachegen_fetch": True,
            "cachegen_chunk_blocks": CHUNK,
        },
    ) as c:
        yield c


def prefill(c: Cluster, worker: int, ids: list[int], **extra) -> pb.PrefillReply:
    with grpc.insecure_channel(c.prefills[worker].address) as channel:
        req = pb.PrefillRequest(token_ids=ids, sampling=pb.SamplingParams(max_tokens=1), **extra)
        return pb_grpc.PrefillWorkerStub(channel).Prefill(req, timeout=120)


def publish(c: Cluster, ids: list[int], n_blocks: int) -> None:
    """Prefill `ids` on host 0 and wait until its chunks are stored at every level."""
    assert prefill(c, 0, ids).computed_tokens == len(ids)
    keys = block_keys(ids, BS, c.prefills[0].fingerprint)[:n_blocks]
    deadline = time.monotonic() + 60
    for level in CACHEGEN_LEVELS:
        want = chunk_keys(keys, CHUNK, level)
        while len(c.stores[0].store.lookup(want)) < len(want):
            assert time.monotonic() < deadline, f"level {level} chunks never stored"
            time.sleep(0.05)


def test_chunks_at_every_level_and_the_highest_without_a_deadline(cluster):
    c, rng = cluster, random.Random(1)
    ids = rand_ids(rng, 8 * BS + 5)
    publish(c, ids, 8)
    sizes = {
        lv: sum(
            c.stores[0].store.lookup_sizes(
                chunk_keys(block_keys(ids, BS, c.prefills[0].fingerprint)[:8], CHUNK, lv)
            )[i][1]
            for i in range(4)
        )
        for lv in CACHEGEN_LEVELS
    }
    assert [sizes[lv] for lv in CACHEGEN_LEVELS] == sorted(sizes.values())  # level 1 smallest
    raw = 8 * c.prefills[0].runner.pool.block_bytes
    assert sizes[max(CACHEGEN_LEVELS)] < raw / 2
    r = prefill(c, 1, ids, fetch_from=c.stores[0].cfg.node_id, fetch_blocks=8)
    # no deadline: every chunk at the top option, its stored blocks (lossless), the prefix loaded,
    # 5 tokens computed
    assert list(r.cachegen_levels) == [RAW_LEVEL] * 4
    assert r.cached_remote_tokens == 8 * BS and r.computed_tokens == 5
    raw_keys = block_keys(ids, BS, c.prefills[0].fingerprint)[:8]
    assert r.fetched_bytes == sum(size for _, size in c.stores[0].store.lookup_sizes(raw_keys))


def test_a_thin_link_drops_the_level_and_an_impossible_budget_recomputes(cluster):
    c, rng = cluster, random.Random(2)
    n_blocks = 16  # 8 chunks
    ids = rand_ids(rng, n_blocks * BS + 3)
    publish(c, ids, n_blocks)
    keys = block_keys(ids, BS, c.prefills[0].fingerprint)[:n_blocks]
    top = max(CACHEGEN_LEVELS)
    top_chunk = c.stores[0].store.lookup_sizes(chunk_keys(keys, CHUNK, top))[0][1]
    # A link on which a top-level chunk takes ~40 ms (a raw one over twice that), and a budget of
    # ~70 ms per chunk: once the link is measured, the chunks go at the top level; then the link
    # thins 2.5x mid-transfer, a top-level chunk no longer fits its share of what is left, and
    # the rule steps down to a smaller level.
    gbps = top_chunk * 8 / 0.040 / 1e9
    budget_ms = 8 * 70.0
    c.stores[0].set_link_gbps(gbps)
    drop = threading.Timer(0.15, c.stores[0].set_link_gbps, args=(gbps / 2.5,))
    try:
        drop.start()
        t0 = time.perf_counter()
        r = prefill(
            c,
            1,
            ids,
            fetch_from=c.stores[0].cfg.node_id,
            fetch_blocks=n_blocks,
            deadline_ms=budget_ms,
        )
        took_ms = (time.perf_counter() - t0) * 1000.0
    finally:
        drop.cancel()
        c.stores[0].set_link_gbps(0)
    levels = list(r.cachegen_levels)
    # the first chunk goes raw: the link is known only by what crossed it before (the unpaced
    # fetch above, or the 1 Gbit/s prior), where the stored blocks fit; measured, it is too thin
    # for them, and the rule steps down to coded levels
    assert levels and levels[0] == RAW_LEVEL and RAW_LEVEL not in levels[1:]
    assert min(levels) < top  # it stepped down further once the link thinned
    assert r.cached_remote_tokens == len(levels) * CHUNK * BS
    assert r.computed_tokens == len(ids) - r.cached_remote_tokens
    assert took_ms < budget_ms * 1.25  # the deadline held (with slack for this shared machine)

    # A budget no level can meet, on a link where recomputing is faster: nothing is fetched. The
    # rule knows a link only by what crossed it, so one chunk of another prompt goes first (fresh
    # prompts: host 1's store holds every prompt it prefilled).
    warm_ids, ids = rand_ids(rng, 2 * CHUNK * BS + 3), rand_ids(rng, n_blocks * BS + 3)
    publish(c, warm_ids, 2 * CHUNK)
    publish(c, ids, n_blocks)
    node = c.stores[0].cfg.node_id
    c.stores[0].set_link_gbps(gbps / 20)
    try:
        warm = prefill(c, 1, warm_ids, fetch_from=node, fetch_blocks=CHUNK)
        assert len(warm.cachegen_levels) == 1
        r = prefill(c, 1, ids, fetch_from=node, fetch_blocks=n_blocks, deadline_ms=1.0)
    finally:
        c.stores[0].set_link_gbps(0)
    assert list(r.cachegen_levels) == [] and r.fetched_bytes == 0
    assert r.cached_remote_tokens == 0 and r.computed_tokens == len(ids)


def test_the_per_chunk_rule():
    from kvstore.client import choose_level
    from kvstore.client.cachegen_stream import OptionCost, chunk_costs

    costs = {1: 0.02, 2: 0.04, 3: 0.08, 4: 0.2}
    # 1 s for 10 chunks: 0.1 s each, level 3 is the highest that fits
    assert choose_level(costs, 1.0, 10, recompute_s=1.0).level == 3
    assert choose_level(costs, float("inf"), 10, recompute_s=1.0).level == 4  # no deadline
    assert choose_level(costs, 0.25, 10, recompute_s=1.0).level == 1  # 25 ms each
    # nothing fits: the cheapest level if it beats recomputing the chunk, else recompute
    assert choose_level(costs, 0.0, 10, recompute_s=1.0).level == 1
    assert choose_level(costs, -5.0, 3, recompute_s=0.01).level == 0
    assert choose_level({}, 1.0, 1, recompute_s=1.0).level == 0  # the node holds no level

    # The stored blocks as the top option: chosen whenever they fit.
    assert choose_level({**costs, RAW_LEVEL: 0.09}, 1.0, 10, recompute_s=1.0).level == RAW_LEVEL
    assert choose_level({**costs, RAW_LEVEL: 0.3}, 1.0, 10, recompute_s=1.0).level == 3
    # The two-stage pipeline: raw 0.19 s on the link, a coded chunk 0.04 s on it and 0.3 s to
    # decode. Alone, raw is cheaper; paired with the next chunk, coded first lets the next chunk
    # cross the link while it decodes, so when nothing fits the coded chunk goes first...
    opts = {RAW_LEVEL: OptionCost(0.19, 0.01), 1: OptionCost(0.04, 0.3)}
    c = chunk_costs(opts, opts, 0.0, 0.0)
    assert c.alone[RAW_LEVEL] < c.alone[1] and c.paired[1] < c.paired[RAW_LEVEL]
    assert choose_level(c.alone, 0.2, 4, 1.0, c.paired).level == 1
    # ... and a raw chunk behind it costs only its copy: it fits
    c = chunk_costs(opts, opts, 0.04, 0.34)
    assert c.alone[RAW_LEVEL] == pytest.approx(0.01)
    assert choose_level(c.alone, 0.2, 4, 1.0, c.paired).level == RAW_LEVEL
    # the last chunk has no next one: paired is alone
    assert chunk_costs(opts, {}, 0.0, 0.0).paired == chunk_costs(opts, {}, 0.0, 0.0).alone


# ---- KVConnector.fetch_chunks against one real store node over gRPC, its link paced ----

LAYERS, HEADS, DIM, C_BLOCKS, N_CHUNKS = 4, 2, 64, 4, 6
FP = "test-cachegen-raw"


class Far(NamedTuple):
    """A store node holding a prefix's raw fp16 blocks and its chunks at every level."""

    node: StoreNode
    keys: list[bytes]  # the prefix's block keys
    blocks: torch.Tensor  # the blocks stored under them [n, *block_shape], fp16
    raw_chunk_bytes: int  # what one chunk's stored blocks move over the link
    top_chunk_bytes: int  # what one chunk's record at the top level moves


@pytest.fixture(scope="module")
def far():
    layout = FullKVLayout(LAYERS, HEADS, DIM, BS, torch.float16)
    n = C_BLOCKS * N_CHUNKS
    gen = torch.Generator().manual_seed(0)
    # smooth along tokens, as KV is (what CacheGen's deltas rely on)
    blocks = torch.randn(n, *layout.block_shape, generator=gen).cumsum(2).mul(0.2).half()
    node = StoreNode(StoreConfig(node_id="far", dram_bytes=64 << 20))
    node.start()
    keys = block_keys(list(range(3, 3 + n * BS)), BS, FP)
    with StoreClient(node.address, transport="grpc") as client:
        assert client.put(keys, blocks, FP) == n
        for level in CACHEGEN_LEVELS:
            for i, ck in enumerate(chunk_keys(keys, C_BLOCKS, level)):
                payload = encode_chunk(blocks[i * C_BLOCKS : (i + 1) * C_BLOCKS].float(), level)
                client.put([ck], payload[None], FP, codec=f"cachegen{level}")
        raw = sum(client.lookup(keys[:C_BLOCKS]).sizes)
        top = client.lookup(chunk_keys(keys, C_BLOCKS, max(CACHEGEN_LEVELS))).sizes[0]
    try:
        yield Far(node, keys, blocks, raw, top)
    finally:
        node.stop()


def fetch_from_far(far: Far, budget_s: float, gbps: float) -> tuple:
    """A fresh pool and connector fetching the whole prefix from `far` with `budget_s` over a
    link paced to `gbps`: (what fetch_chunks did, the table, the pool, the metrics, seconds)."""
    layout = FullKVLayout(LAYERS, HEADS, DIM, BS, torch.float16)
    pool = torch.zeros(len(far.keys) + 2, *layout.block_shape, dtype=torch.float16)
    reg = CollectorRegistry()
    conn = KVConnector(pool, layout, FP, far.node.address, store_node="far", registry=reg)
    free = list(range(pool.shape[0]))
    table: list[int] = []
    far.node.set_link_gbps(gbps)
    try:
        t0 = time.perf_counter()
        plan = ChunkPlan(
            levels=tuple(CACHEGEN_LEVELS),
            chunk_blocks=C_BLOCKS,
            deadline=t0 + budget_s,
            recompute_s_per_chunk=10.0,
            prior_bytes_per_s=(gbps or 10.0) * 1e9 / 8,
        )
        got = conn.fetch_chunks(
            "far", far.keys, table, len(far.keys), lambda k: [free.pop(0) for _ in range(k)], plan
        )
        took = time.perf_counter() - t0
    finally:
        far.node.set_link_gbps(0)
        conn.close()
    return got, table, pool, reg, took


def missed(reg: CollectorRegistry) -> float:
    labels = {"worker": "far", "op": "fetch_chunks"}
    return reg.get_sample_value("halfmoon_kv_missed_blocks_total", labels) or 0.0


def test_a_fast_link_and_a_generous_budget_fetch_every_chunk_raw(far):
    got, table, pool, reg, _ = fetch_from_far(far, budget_s=5.0, gbps=2.0)
    assert got.levels == [RAW_LEVEL] * N_CHUNKS
    assert got.blocks == len(far.keys) and len(table) == len(far.keys)
    assert torch.equal(pool[table], far.blocks)  # exactly the stored KV: lossless
    assert got.bytes == N_CHUNKS * far.raw_chunk_bytes
    assert missed(reg) == 0


def test_a_slow_link_and_a_tight_budget_choose_coded_levels_and_hold_it(far):
    # a link on which a raw chunk takes ~60 ms and a top-level one ~35 ms; a budget of 45 ms a
    # chunk: no raw chunk fits, coded ones do
    gbps = far.raw_chunk_bytes * 8 / 0.060 / 1e9
    assert far.top_chunk_bytes < far.raw_chunk_bytes * 0.6
    budget_s = N_CHUNKS * 0.045
    got, table, pool, reg, took = fetch_from_far(far, budget_s, gbps)
    # coded chunks; a raw one only where the slack the coded ones left allows (the last)
    assert len(got.levels) == N_CHUNKS and len(table) == len(far.keys)
    assert RAW_LEVEL not in got.levels[:-1]
    assert got.bytes < N_CHUNKS * far.raw_chunk_bytes * 0.7
    assert took < budget_s * 1.25  # the budget held (with slack for this shared machine)
    # lossy but close: the coded chunks decode near the stored KV
    err = (pool[table].float() - far.blocks.float()).abs().mean() / far.blocks.float().abs().mean()
    assert err < 0.2


def test_a_corrupt_raw_block_is_a_miss_and_the_fetch_stops_before_its_chunk(far):
    bad = 2 * C_BLOCKS + 1  # a block of chunk 2
    lease_id, refs = far.node.store.acquire(far.keys[bad : bad + 1], ttl=5)
    far.node.store.release(lease_id)
    ((off, size),) = [(r.offset, r.length) for r in refs]
    h = parse_header(far.node.slab.view[off : off + size])
    far.node.slab.view[off + h.layer_offset(1) + 3] ^= 0xFF  # flip bits in layer 1 of the block
    try:
        got, table, pool, reg, _ = fetch_from_far(far, budget_s=5.0, gbps=2.0)
    finally:
        with StoreClient(far.node.address, transport="grpc") as client:  # put it back
            client.put(far.keys, far.blocks, FP)
    assert got.levels == [RAW_LEVEL] * 2  # chunks 0 and 1; chunk 2 failed its checks
    assert len(table) == got.blocks == 2 * C_BLOCKS
    assert torch.equal(pool[table], far.blocks[: 2 * C_BLOCKS])
    assert missed(reg) == len(far.keys) - 2 * C_BLOCKS
