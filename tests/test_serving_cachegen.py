"""CacheGen in serving: a prefill worker stores each whole chunk of a prompt at every level beside
its blocks; a prefill worker on another "host" streams that prefix chunk by chunk, each at the
level CacheGen's rule picks from the measured throughput of a paced link and the TTFT budget, and
recomputes when no level can make it."""

from __future__ import annotations

import random
import threading
import time

import grpc
import pytest

from kvstore import CACHEGEN_LEVELS, block_keys, chunk_keys
from model import load_model
from protos import halfmoon_pb2 as pb
from protos import halfmoon_pb2_grpc as pb_grpc
from serving_cluster import Cluster

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
    # no deadline: every chunk at the highest level, the prefix loaded, 5 tokens computed
    assert list(r.cachegen_levels) == [max(CACHEGEN_LEVELS)] * 4
    assert r.cached_remote_tokens == 8 * BS and r.computed_tokens == 5
    assert r.fetched_bytes == sizes[max(CACHEGEN_LEVELS)]


def test_a_thin_link_drops_the_level_and_an_impossible_budget_recomputes(cluster):
    c, rng = cluster, random.Random(2)
    n_blocks = 16  # 8 chunks
    ids = rand_ids(rng, n_blocks * BS + 3)
    publish(c, ids, n_blocks)
    keys = block_keys(ids, BS, c.prefills[0].fingerprint)[:n_blocks]
    top = max(CACHEGEN_LEVELS)
    top_chunk = c.stores[0].store.lookup_sizes(chunk_keys(keys, CHUNK, top))[0][1]
    # A link on which a top-level chunk takes ~40 ms, and a budget of ~70 ms per chunk: the
    # first chunks go at the top level; then the link thins 2.5x mid-transfer, a top-level chunk
    # no longer fits its share of what is left, and the rule steps down to a smaller level.
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
    assert levels and levels[0] == top
    assert min(levels) < top  # it stepped down once the link thinned
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
    from kvstore import choose_level

    costs = {1: 0.02, 2: 0.04, 3: 0.08, 4: 0.2}
    # 1 s for 10 chunks: 0.1 s each, level 3 is the highest that fits
    assert choose_level(costs, 1.0, 10, recompute_s=1.0).level == 3
    assert choose_level(costs, float("inf"), 10, recompute_s=1.0).level == 4  # no deadline
    assert choose_level(costs, 0.25, 10, recompute_s=1.0).level == 1  # 25 ms each
    # nothing fits: the cheapest level if it beats recomputing the chunk, else recompute
    assert choose_level(costs, 0.0, 10, recompute_s=1.0).level == 1
    assert choose_level(costs, -5.0, 3, recompute_s=0.01).level == 0
    assert choose_level({}, 1.0, 1, recompute_s=1.0).level == 0  # the node holds no level
