"""The KV connector between a worker's pool and the store, and the workers' device choice."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest
import torch
from prometheus_client import CollectorRegistry
from serving_cluster import Cluster, wait_for

from decode_node import DecodeConfig
from kvstore import EmbeddedRedis, Index, block_keys
from kvstore.client import KVConnector
from kvstore.node import StoreConfig, StoreNode
from model import KVPool, kv_fingerprint, load_model
from prefill_node import PrefillConfig
from protos import halfmoon_pb2 as pb
from servekit.worker import resolve_device

BS = 16


@pytest.fixture(scope="module")
def lm():
    return load_model("tiny-random")


@pytest.fixture(scope="module")
def redis():
    server = EmbeddedRedis()
    yield server
    server.stop()


def metric(registry: CollectorRegistry, name: str, **labels) -> float:
    return registry.get_sample_value(name, labels) or 0.0


def _pool(lm, n=16):
    pool = KVPool(lm.config, n, BS, torch.float32)
    pool.kv.copy_(torch.randn_like(pool.kv))
    return pool


def test_device_choice_is_checked_and_auto_is_cpu_here():
    for cls in (PrefillConfig, DecodeConfig):
        with pytest.raises(ValueError, match="device"):
            cls(device="gpu")
        assert cls(device="cuda:1").device == "cuda:1"  # a config check needs no GPU
    if not torch.cuda.is_available():
        assert resolve_device("auto") == torch.device("cpu")
        with pytest.raises(ValueError, match="no CUDA device"):
            resolve_device("cuda")


def test_workers_report_their_device(lm):
    with Cluster(lm, prefill={"device": "cpu"}, decode={"device": "auto"}) as c:
        want = "cuda:0" if torch.cuda.is_available() else "cpu"
        assert c.prefills[0].load().device == "cpu"
        assert c.decodes[0].load().device == want


def test_put_pull_round_trip_and_every_miss_counted(lm, redis, tmp_path):
    node = StoreNode(StoreConfig(node_id="s0", redis_url=redis.url, dram_bytes=8 << 20))
    address = node.start()
    src, dst = _pool(lm), KVPool(lm.config, 16, BS, torch.float32)
    fp = kv_fingerprint(lm.weights_id, src.layout)
    reg = CollectorRegistry()
    a = KVConnector(src.kv, src.layout, fp, address, store_node="s0", worker="a")
    b = KVConnector(dst.kv, dst.layout, fp, address, store_node="s0", worker="b", registry=reg)
    try:
        keys = block_keys(list(range(3, 3 + 4 * BS)), BS, fp)
        assert a.put(keys[:3], [5, 6, 7], None) == 3
        # three held, the fourth never stored: a miss, counted, and the first three arrive intact
        assert b.pull(address, keys, [0, 1, 2, 3]) == 3
        assert torch.equal(dst.kv[:3], src.kv[5:8])
        assert metric(reg, "halfmoon_kv_missed_blocks_total", worker="b", op="pull") == 1
        # an unreachable store: nothing pulled, counted as an error and a miss, no exception
        assert b.pull("127.0.0.1:1", keys[:2], [8, 9]) == 0
        assert metric(reg, "halfmoon_kv_missed_blocks_total", worker="b", op="pull") == 3
        errors = sum(
            metric(reg, "halfmoon_kv_errors_total", worker="b", op="pull", kind=k)
            for k in ("unavailable", "timeout", "error")
        )
        assert errors == 1
        # a corrupt inline tail is refused (counted), never written into the pool
        tail = a.encode_tail([5], 7)
        before = dst.kv[10].clone()
        bad = tail[:-1] + bytes([tail[-1] ^ 0xFF])
        assert not b.load_tail(bad, 7, [10])
        assert torch.equal(dst.kv[10], before)
        assert metric(reg, "halfmoon_kv_errors_total", worker="b", op="tail", kind="corrupt") == 1
        assert b.load_tail(tail, 7, [10]) and torch.equal(dst.kv[10, :, :, :7], src.kv[5, :, :, :7])
    finally:
        a.close()
        b.close()
        node.stop()


def test_layerwise_publishing_copies_a_cpu_pool_in_place(lm, redis):
    node = StoreNode(StoreConfig(node_id="s5", redis_url=redis.url, dram_bytes=8 << 20))
    address = node.start()
    src, dst = _pool(lm), KVPool(lm.config, 16, BS, torch.float32)
    fp = kv_fingerprint(lm.weights_id, src.layout)
    reg = CollectorRegistry()
    a = KVConnector(src.kv, src.layout, fp, address, store_node="s5", worker="a", registry=reg)
    b = KVConnector(dst.kv, dst.layout, fp, address, store_node="s5", worker="b")
    try:
        keys = block_keys(list(range(7, 7 + 3 * BS)), BS, fp)
        pub = a.open_layerwise(keys, [9, 2, 5], None)
        assert pub._pool_bytes is not None  # copied in this thread, straight from the pool
        for layer in range(lm.config.num_layers):
            pub.layer_done(layer)
        # the last layer sent the commit: the blocks are stored while the forward goes on
        wait_for(lambda: a._local.lookup(keys).num_blocks == 3, 10, "a commit before finish")
        assert not pub._futures and pub.finish(True)
        assert b.pull(address, keys, [0, 1, 2]) == 3
        assert torch.equal(dst.kv[:3], src.kv[[9, 2, 5]])
        # a forward that failed: the blocks are aborted, never visible
        others = block_keys(list(range(90, 90 + BS)), BS, fp)
        pub = a.open_layerwise(others, [3], None)
        pub.layer_done(0)
        assert not pub.finish(False)
        assert a.ensure_stored(others[:0], []) == 0 and b.pull(address, others, [4]) == 0
        # a copy that fails (here: the lease let go under it) is counted, and the put aborted
        pub = a.open_layerwise(others, [3], None)
        pub._writer.abort()
        for layer in range(lm.config.num_layers):
            pub.layer_done(layer)
        assert not pub.finish(True)
        errors = metric(reg, "halfmoon_kv_errors_total", worker="a", op="publish_layerwise",
                        kind="error")  # fmt: skip
        assert errors == 1 and b.pull(address, others, [4]) == 0
    finally:
        a.close()
        b.close()
        node.stop()


def test_a_remote_node_unknown_to_the_index_is_a_counted_miss(lm, redis):
    node = StoreNode(StoreConfig(node_id="s1", redis_url=redis.url, dram_bytes=8 << 20))
    address = node.start()
    pool = _pool(lm)
    fp = kv_fingerprint(lm.weights_id, pool.layout)
    reg = CollectorRegistry()
    c = KVConnector(
        pool.kv,
        pool.layout,
        fp,
        address,
        store_node="s1",
        index_url=redis.url,
        worker="w",
        registry=reg,
    )
    try:
        keys = block_keys(list(range(3, 3 + 3 * BS)), BS, fp)
        got = c.load_prefix(keys, 3, "no-such-node", 3, pool.allocate, pool.free)
        assert got.table == [] and sum(got.counts.values()) == 0
        assert pool.num_free == pool.num_blocks  # nothing taken, nothing leaked
        assert metric(reg, "halfmoon_kv_missed_blocks_total", worker="w", op="load_remote") == 3
        assert (
            metric(reg, "halfmoon_kv_errors_total", worker="w", op="resolve_node", kind="error")
            == 1
        )
    finally:
        c.close()
        node.stop()


def test_device_tier_is_visible_to_routing(lm):
    rng = random.Random(3)
    prompt = [rng.randrange(3, 259) for _ in range(4 * BS + 5)]
    with Cluster(lm) as c:
        w = c.prefills[0]
        c.generate(token_ids=prompt, max_tokens=2)
        keys = block_keys(prompt, BS, w.fingerprint)
        index = Index(c.redis.url)
        try:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                found = index.longest_prefix(keys)
                if found.get("prefill-0") and found["prefill-0"].num_blocks == 4:
                    break
                time.sleep(0.05)
            assert found["prefill-0"].num_blocks == 4 and set(found["prefill-0"].tiers) == {
                "device"
            }
            assert w.load().device_node == "prefill-0"
            # ClearCache empties the pool's tier, and the index hears of it.
            c.stub.ClearCache(pb.ClearCacheRequest(), timeout=10)
            deadline = time.monotonic() + 10
            while "prefill-0" in index.longest_prefix(keys) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert "prefill-0" not in index.longest_prefix(keys)
        finally:
            index.close()


def test_a_prompt_whose_publish_the_store_confirmed_is_answered_without_a_lookup(lm):
    """A cold prompt's blocks go to the store layer by layer, and its commit says the store holds
    them all: the answer needs no store lookup first (ensure_stored, a round trip before the
    first token). A prompt reusing a cached prefix, or whose publish did not happen, is still
    checked (and filled) before its answer, and every one's blocks end up in the store."""
    rng = random.Random(5)
    cold = [rng.randrange(3, 259) for _ in range(3 * BS + 5)]
    reused = cold[: 2 * BS] + [rng.randrange(3, 259) for _ in range(2 * BS + 3)]
    unpublished = [rng.randrange(3, 259) for _ in range(2 * BS + 1)]
    with Cluster(lm, prefill={"layerwise": True}) as c:
        runner = c.prefills[0].runner
        kv = runner.kv
        checked = []
        ensure_stored = kv.ensure_stored
        kv.ensure_stored = lambda keys, ids: checked.append(len(keys)) or ensure_stored(keys, ids)
        c.generate(token_ids=cold, max_tokens=4)
        assert checked == []
        c.generate(token_ids=reused, max_tokens=2)
        assert checked == [4]  # the prefix came from the device tier: checked
        open_layerwise = kv.open_layerwise
        kv.open_layerwise = lambda *a: None  # the store could not take a layer-wise put now
        try:
            c.generate(token_ids=unpublished, max_tokens=2)
        finally:
            kv.open_layerwise = open_layerwise
        assert checked == [4, 2]
        fp = c.prefills[0].fingerprint
        for prompt in (cold, reused, unpublished):
            keys = block_keys(prompt, BS, fp)
            assert kv._local.lookup(keys).num_blocks == len(keys)


def test_load_walks_device_then_the_hosts_store(lm, redis):
    node = StoreNode(StoreConfig(node_id="s2", redis_url=redis.url, dram_bytes=8 << 20))
    address = node.start()
    pool = _pool(lm)
    fp = kv_fingerprint(lm.weights_id, pool.layout)
    c = KVConnector(pool.kv, pool.layout, fp, address, store_node="s2", device_node="w2")
    try:
        keys = block_keys(list(range(3, 3 + 4 * BS)), BS, fp)
        src = pool.allocate(4)
        assert c.put(keys, src, None) == 4
        c.keep(keys[:2], src, [], pool.free)  # the first two stay resident in the pool
        assert pool.num_free == pool.num_blocks - 2
        got = c.load_prefix(keys, 4, "", 0, pool.allocate, pool.free)
        assert got.counts == {"device": 2, "dram": 2, "ssd": 0, "remote": 0}
        assert got.table[:2] == src[:2] and got.pinned == keys[:2]
        held = torch.stack([pool.kv[i] for i in got.table])
        c.drop(got.table, got.pinned, pool.free)
        assert pool.num_free == pool.num_blocks - 2  # pins released, pulled blocks freed
        # the same bytes as the source blocks, whichever tier they came from
        assert torch.equal(held[:2], pool.kv[src[:2]])
    finally:
        c.close()
        node.stop()


def test_clear_cache_gives_the_stores_the_callers_deadline_not_a_load_polls(lm):
    """ClearCache is an administrative call: its store and worker clears get what is left of
    the caller's deadline, not a load poll's (2 s). A store's Clear waits up to 2 s for its
    index to hear of it, so with the index slow (its Redis stopped here) the clear raced the
    load poll's deadline and failed UNAVAILABLE, as the demo's replay once did."""
    with Cluster(lm) as c:
        c.generate(token_ids=list(range(3, 40)), max_tokens=2)
        os.kill(c.redis.proc.pid, signal.SIGSTOP)
        try:
            reply = c.stub.ClearCache(pb.ClearCacheRequest(), timeout=20)
        finally:
            os.kill(c.redis.proc.pid, signal.SIGCONT)
        assert reply.store_blocks >= 2
