"""The global index against a real Redis (the embedded one): longest prefixes for every node in
one call, node liveness by heartbeat TTL, and store nodes publishing what they hold."""

from __future__ import annotations

import threading
import time

import pytest
import redis
import torch

from kvstore import EmbeddedRedis, Index, LookupResult, NodeInfo, block_keys
from kvstore.client import StoreClient, encode_block
from kvstore.node import StoreConfig, StoreNode

FP = "idx-model"
SHAPE = (2, 2, 4, 1, 8)
BLOCK = len(encode_block(torch.zeros(SHAPE), FP))


@pytest.fixture(scope="module")
def redis_server():
    server = EmbeddedRedis()
    yield server
    server.stop()


@pytest.fixture
def index(redis_server):
    idx = Index(redis_server.url)
    idx.r.flushdb()
    yield idx
    idx.close()


def info(node_id: str) -> NodeInfo:
    return NodeInfo(node_id, f"127.0.0.1:{len(node_id)}", "h", "", 0, 0, FP, time.time())


def test_embedded_redis_is_real_and_stops():
    server = EmbeddedRedis()
    r = redis.Redis.from_url(server.url)
    assert r.ping() and r.set("a", "1") and r.get("a") == b"1"
    r.close()
    server.stop()
    with pytest.raises(redis.exceptions.ConnectionError):
        redis.Redis.from_url(server.url, socket_connect_timeout=1).ping()


def test_embedded_redis_restarted_from_a_thread_outlives_it():
    """The server's parent-death signal follows the thread that forked it: a restart from a
    thread that then ends (a fault injector's) must not take the server down with it."""
    server = EmbeddedRedis()
    try:
        t = threading.Thread(target=server.restart)
        t.start()
        t.join()
        time.sleep(0.5)  # the signal, were it sent, lands at once
        r = redis.Redis.from_url(server.url, socket_connect_timeout=2)
        assert r.ping() and server.proc.poll() is None
        r.close()
    finally:
        server.stop()


def test_longest_prefix_for_every_node(index):
    keys = block_keys(list(range(40)), 8, FP)  # 5 blocks
    for n in ("a", "b", "c"):
        index.register(info(n), ttl_s=30)
    index.publish("a", [(k, "dram") for k in keys[:3]])
    index.publish("b", [(keys[0], "ssd"), (keys[1], "dram"), (keys[3], "dram")])  # a hole at 2
    index.publish("c", [(k, "ssd") for k in keys[1:]])  # no first block
    got = index.longest_prefix(keys)
    assert got == {"a": LookupResult(3, ["dram"] * 3), "b": LookupResult(2, ["ssd", "dram"])}
    assert index.longest_prefix(keys[1:])["c"] == LookupResult(4, ["ssd"] * 4)
    assert index.longest_prefix([b"z" * 16]) == {} and index.longest_prefix([]) == {}
    index.publish("a", [(keys[1], None)])  # evicted at a: its prefix shrinks
    assert index.longest_prefix(keys)["a"] == LookupResult(1, ["dram"])
    index.publish("a", [(keys[0], "ssd")])  # demoted: the tier changes
    assert index.longest_prefix(keys)["a"].tiers == ["ssd"]


def test_one_round_trip(index):
    keys = block_keys(list(range(800)), 8, FP)  # 100 blocks
    index.register(info("a"), ttl_s=30)
    index.publish("a", [(k, "dram") for k in keys])
    index.longest_prefix(keys[:1])  # loads the script
    sent = []
    real = index.r.execute_command

    def counting(*args, **kw):
        sent.append(args[0])
        return real(*args, **kw)

    index.r.execute_command = counting
    assert index.longest_prefix(keys)["a"].num_blocks == 100
    assert sent == ["EVALSHA"]  # one round trip, however many keys


def test_lapsed_heartbeat_hides_and_sweeps_a_node(index):
    keys = block_keys(list(range(16)), 8, FP)
    index.register(info("live"), ttl_s=30)
    index.register(info("dying"), ttl_s=0.3)
    for n in ("live", "dying"):
        index.publish(n, [(k, "dram") for k in keys])
    assert set(index.longest_prefix(keys)) == {"live", "dying"} and set(index.nodes()) == {
        "live",
        "dying",
    }
    assert index.nodes()["dying"] == info("dying")._replace(
        started_at=index.nodes()["dying"].started_at
    )
    time.sleep(0.5)
    assert set(index.longest_prefix(keys)) == {"live"} and set(index.nodes()) == {"live"}
    assert index.heartbeat("live", 30) and not index.heartbeat("dying", 30)
    assert index.sweep() == ["dying"]
    assert index.holders(keys[0]) == {"live": "dram"}


def test_store_nodes_publish_to_the_index(index, redis_server, tmp_path):
    cfgs = [
        StoreConfig(
            node_id=f"s{i}",
            dram_bytes=2 * BLOCK,
            ssd_dir=str(tmp_path / f"s{i}"),
            ssd_bytes=4 * BLOCK,
            redis_url=redis_server.url,
            model_fingerprint=FP,
            heartbeat_s=0.2,
        )
        for i in range(2)
    ]
    nodes = [StoreNode(c) for c in cfgs]
    try:
        for n in nodes:
            n.start()
        assert set(index.nodes()) == {"s0", "s1"}
        assert index.nodes()["s0"].address == nodes[0].address
        keys = block_keys(list(range(12)), 4, FP)
        x = torch.randn(3, *SHAPE)
        with StoreClient(nodes[0].address) as c0, StoreClient(nodes[1].address) as c1:
            c0.put(keys[:2], x[:2], FP)
            c1.put(keys[:1], x[:1], FP)
            for n in nodes:  # publication is asynchronous: wait for it
                assert n.flush()
            assert index.longest_prefix(keys) == {
                "s0": LookupResult(2, ["dram", "dram"]),
                "s1": LookupResult(1, ["dram"]),
            }
            c0.put(keys[2:], x[2:], FP, parent=keys[1])  # demotes block 1 at s0
            assert nodes[0].flush()
            assert index.longest_prefix(keys)["s0"] == LookupResult(3, ["dram", "ssd", "dram"])
        time.sleep(1.0)  # several heartbeats: the nodes stay live
        assert set(index.longest_prefix(keys)) == {"s0", "s1"}
        nodes[1].stop()
        assert set(index.longest_prefix(keys)) == {"s0"} and index.holders(keys[0]) == {
            "s0": "dram"
        }
        nodes[0].stop()
        # restarted, s0 finds its ssd blocks (and what the graceful stop copied there)
        # and publishes them
        nodes[0] = StoreNode(cfgs[0])
        nodes[0].start()
        assert index.longest_prefix(keys)["s0"] == LookupResult(3, ["ssd"] * 3)
    finally:
        for n in nodes:
            n.stop()


def test_index_embedded_constructor():
    idx = Index.embedded()
    try:
        idx.register(info("x"), 10)
        assert set(idx.nodes()) == {"x"}
    finally:
        idx.close()


def test_index_from_env(redis_server, monkeypatch):
    monkeypatch.setenv("REDIS_URL", redis_server.url)
    idx = Index.from_env()
    try:
        assert idx.url == redis_server.url and idx._embedded is None
    finally:
        idx.close()
    monkeypatch.delenv("REDIS_URL")
    idx = Index.from_env()
    try:
        assert idx._embedded is not None and idx.r.ping()
    finally:
        idx.close()


def test_clear_drops_every_tier_and_the_index_entries(index, redis_server, tmp_path):
    cfg = StoreConfig(
        node_id="c0",
        dram_bytes=2 * BLOCK,
        ssd_dir=str(tmp_path / "c0"),
        ssd_bytes=4 * BLOCK,
        redis_url=redis_server.url,
        model_fingerprint=FP,
        heartbeat_s=0.2,
    )
    node = StoreNode(cfg)
    node.start()
    try:
        keys = block_keys(list(range(16)), 4, FP)
        x = torch.randn(4, *SHAPE)
        with StoreClient(node.address) as c:
            c.put(keys[:2], x[:2], FP)
            c.put(
                keys[2:], x[2:], FP, parent=keys[1]
            )  # the dram tier holds 2: the rest is demoted to ssd
            assert (
                sorted(set(c.lookup(keys).tiers)) == ["dram", "ssd"]
                and c.lookup(keys).num_blocks == 4
            )
            lease_id, _ = node.store.acquire(keys[:1], ttl=60)  # a reader holds block 0
            assert c.clear() == 3
            assert (
                index.longest_prefix(keys)["c0"].num_blocks == 1
            )  # the leased block stays while read
            assert all(t.blocks == 0 for t in c.stats().tiers if t.tier == "ssd")
            node.store.release(lease_id)
            node.flush()
            assert c.lookup(keys).num_blocks == 0 and "c0" not in index.longest_prefix(keys)
            assert sum(t.used_bytes for t in c.stats().tiers) == 0
            assert c.put(keys[:2], x[:2], FP) == 2  # a cleared node keeps serving
            out = torch.zeros(2, *SHAPE)
            assert c.get_into(keys[:2], out) == 2 and torch.equal(out, x[:2])
    finally:
        node.stop()
