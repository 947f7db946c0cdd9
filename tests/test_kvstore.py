"""The store node and its client: tiers, eviction, leases, corruption, durability, bad input."""

from __future__ import annotations

import os
import threading
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

import kernels
from kvstore import LookupResult, StoreFull, block_keys
from kvstore.block_header import table_offsets
from kvstore.client import StoreClient, decode_block, encode_block, parse_header
from kvstore.node import StoreConfig, StoreNode
from kvstore.slab import SlabAllocator
from protos import kvstore_pb2 as pb
from protos import kvstore_pb2_grpc as pb_grpc

FP = "test-model"
SHAPE = (2, 2, 4, 2, 8)  # [layers, K/V, tokens, kv heads, head dim]
BLOCK = len(encode_block(torch.zeros(SHAPE), FP))


def blocks(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, *SHAPE), generator=g)


def chain(n: int, start: int = 0) -> list[bytes]:
    return block_keys(list(range(start, start + 4 * n)), 4, FP)


@pytest.fixture
def make_node(tmp_path):
    nodes = []

    def make(dram_blocks=8, ssd_blocks=0, **kw):
        cfg = StoreConfig(
            node_id=f"n{len(nodes)}",
            dram_bytes=dram_blocks * BLOCK,
            ssd_dir=str(tmp_path / f"ssd{len(nodes)}") if ssd_blocks else "",
            ssd_bytes=ssd_blocks * BLOCK,
            model_fingerprint=FP,
            **kw,
        )
        node = StoreNode(cfg)
        node.start()
        nodes.append(node)
        return node

    yield make
    for node in nodes:
        node.stop()


@pytest.fixture(params=["shm", "tcp", "grpc"])
def transport(request):
    return request.param


def test_put_get_round_trip(make_node, transport):
    node = make_node()
    with StoreClient(node.address, transport=transport) as c:
        assert c.transport == transport
        keys, x = chain(5), blocks(5)
        assert c.put(keys, x, FP) == 5
        assert c.lookup(keys) == LookupResult(5, ["dram"] * 5, (BLOCK,) * 5)
        out = torch.zeros(6, *SHAPE)
        assert c.get_into(keys + chain(1, start=999), out) == 5
        assert torch.equal(out[:5], x) and not out[5].any()
        # a held prefix is not rewritten; the put still reports it held
        assert c.put(keys[:2], blocks(2, seed=7), FP) == 2
        c.get_into(keys[:2], out)
        assert torch.equal(out[:2], x[:2])
        s = c.stats()
        assert s.hits == 7 and s.misses == 1 and s.leases == 0 and s.pending_blocks == 0


def test_layerwise_writer_visible_only_after_commit(make_node, transport):
    node = make_node()
    with StoreClient(node.address, transport=transport) as c:
        keys, x = chain(3), blocks(3, seed=1)
        w = c.open_put(keys, SHAPE, torch.float32, FP)
        for layer in range(SHAPE[0]):
            assert c.lookup(keys).num_blocks == 0
            w.write_layer(layer, x[:, layer])
        assert c.lookup(keys).num_blocks == 0
        assert w.commit().held == 3
        out = torch.empty(3, *SHAPE)
        assert c.get_into(keys, out) == 3 and torch.equal(out, x)

        keys2 = chain(2, start=100)
        w = c.open_put(keys2, SHAPE, torch.float32, FP)
        w.write_layer(0, blocks(2)[:, 0])
        w.abort()
        with pytest.raises(ValueError, match="never written"):
            c.open_put(keys2, SHAPE, torch.float32, FP).commit()
        s = c.stats()
        assert c.lookup(keys2).num_blocks == 0 and s.tiers[0].blocks == 3
    import time

    deadline = time.monotonic() + 5
    while node.store.stats().pending_blocks and time.monotonic() < deadline:
        time.sleep(0.02)  # a cancelled gRPC stream is noticed by the server a moment later
    assert node.store.stats().pending_blocks == 0 and node.store.stats().leases == 0


def test_leaf_first_lru_eviction(make_node):
    node = make_node(dram_blocks=4)
    with StoreClient(node.address) as c:
        a = chain(3)  # a0 <- a1 <- a2: only a2 is a leaf
        c.put(a, blocks(3), FP)
        b = chain(1, start=500)  # an unrelated leaf, newer than a2
        c.put(b, blocks(1), FP)
        c.put(
            chain(1, start=900), blocks(1), FP
        )  # needs one slot: the LRU leaf a2 goes, not the older a0
        assert c.lookup(a).num_blocks == 2 and c.lookup(b).num_blocks == 1
        out = torch.empty(1, *SHAPE)
        c.get_into(b, out)  # b is now the most recent
        c.put(chain(1, start=1300), blocks(1), FP)  # a1 is the leaf now, older than b
        assert c.lookup(a).num_blocks == 1 and c.lookup(b).num_blocks == 1
        s = c.stats()
        assert s.tiers[0].evictions == 2 and s.tiers[0].used_bytes <= s.tiers[0].capacity_bytes


def test_demotion_and_promotion(make_node):
    node = make_node(dram_blocks=2, ssd_blocks=3)
    with StoreClient(node.address) as c:
        k = [chain(1, start=100 * i) for i in range(4)]
        x = blocks(4, seed=5)
        for i in range(4):
            c.put(k[i], x[i : i + 1], FP)
        tiers = [c.lookup(k[i]).tiers for i in range(4)]
        assert tiers == [["ssd"], ["ssd"], ["dram"], ["dram"]]
        out = torch.empty(1, *SHAPE)
        assert c.get_into(k[0], out) == 1 and torch.equal(out[0], x[0])  # an ssd hit ...
        assert c.lookup(k[0]).tiers == ["dram"] and c.lookup(k[2]).tiers == ["ssd"]  # ... promoted
        s = c.stats()
        assert s.promotions == 1 and s.demotions == 3 and s.tiers[1].hits == 1
        for t in s.tiers:
            assert t.used_bytes <= t.capacity_bytes
        for _ in range(3):  # more blocks than both tiers hold: the ssd drops its LRU leaves
            c.put(chain(1, start=7000 + _), blocks(1), FP)
        s = c.stats()
        assert s.tiers[0].blocks == 2 and s.tiers[1].blocks == 3 and s.tiers[1].evictions >= 1


def test_leased_blocks_are_not_evicted_and_full_put_is_refused(make_node, transport):
    node = make_node(dram_blocks=3)
    with StoreClient(node.address, transport=transport) as c:
        keys = chain(3)
        c.put(keys, blocks(3), FP)
        lease_id, refs = node.store.acquire(keys[:2], ttl=60)
        before = c.stats()
        with pytest.raises(StoreFull):  # 2 new blocks, only 1 evictable: nothing may be stored
            c.put(chain(2, start=400), blocks(2), FP)
        after = c.stats()
        assert after.tiers == before.tiers and after.pending_blocks == 0
        assert c.lookup(chain(2, start=400)).num_blocks == 0 and c.lookup(keys).num_blocks == 3
        assert (
            c.put(chain(1, start=400), blocks(1), FP) == 1
        )  # one fits by evicting the unleased leaf
        assert c.lookup(keys).num_blocks == 2
        node.store.release(lease_id)
        assert c.put(chain(3, start=800), blocks(3), FP) == 3


def test_lease_expires(make_node):
    node = make_node(dram_blocks=2, lease_s=0.4)
    with StoreClient(node.address) as c:
        c.put(chain(2), blocks(2), FP)
        reply = c.stub.Lease(pb.KVLeaseRequest(mode=pb.KVLeaseRequest.READ, keys=chain(2)))
        assert reply.lease_id and len(reply.slots) == 2
        with pytest.raises(StoreFull):
            c.put(chain(1, start=50), blocks(1), FP)
        import time

        deadline = time.monotonic() + 5
        while c.stats().leases and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c.stats().leases == 0
        assert c.put(chain(1, start=50), blocks(1), FP) == 1
        assert not c.stub.Release(pb.KVReleaseRequest(lease_id=reply.lease_id)).released


def test_corrupt_block_is_a_miss_and_dropped(make_node, transport):
    node = make_node()
    with StoreClient(node.address, transport=transport) as c:
        keys, x = chain(4), blocks(4)
        c.put(keys, x, FP)
        ((_, off, size),) = [(k, o, s) for k, o, s in _slots(node, keys[2:3])]
        h = parse_header(node.slab.view[off : off + size])
        node.slab.view[off + h.layer_offset(1) + 3] ^= 0xFF  # flip bits in layer 1 of block 2
        out = torch.zeros(4, *SHAPE)
        assert c.get_into(keys, out) == 2
        assert torch.equal(
            out[:2], x[:2]
        )  # out[2:] is scratch: layers may land there before a later one fails
        c.stats()  # waits for the release that reports the corruption
        assert c.lookup(keys).num_blocks == 2  # dropped: the next put rewrites it
        assert c.put(keys, x, FP) == 4 and c.get_into(keys, out) == 4 and torch.equal(out, x)


def test_corrupt_header_ends_the_prefix_and_a_later_run_still_copies(make_node, transport):
    """A block whose header fails its own checksum (a flipped byte of its layer checksum table)
    ends the prefix, on every transport: the shm path checks a run of headers in one C call, so
    a bad header in the middle of the run must stop it there, and the blocks before it land."""
    node = make_node()
    with StoreClient(node.address, transport=transport) as c:
        keys, x = chain(5), blocks(5)
        c.put(keys, x, FP)
        ((_, off, size),) = _slots(node, keys[3:4])
        h = parse_header(node.slab.view[off : off + size])
        table, _ = table_offsets(node.slab.view[off : off + size], h)
        node.slab.view[off + table + 2] ^= 0x04
        out = torch.zeros(5, *SHAPE)
        assert c.get_into(keys, out) == 3
        assert torch.equal(out[:3], x[:3])
        c.stats()  # waits for the release that reports the corruption
        assert c.lookup(keys).num_blocks == 3


def test_shm_path_without_the_c_kernels_copies_checks_and_seals_the_same(make_node, monkeypatch):
    """Where the C copy kernels are not built, the shared-memory put seals each header and the
    get checks each block in Python: the same blocks round trip, and a corrupt layer still ends
    the prefix."""
    monkeypatch.setattr(kernels, "copy_hashed_available", lambda: False)
    node = make_node()
    with StoreClient(node.address, transport="shm") as c:
        keys, x = chain(4), blocks(4)
        assert c.put(keys, x, FP) == 4
        out = torch.zeros(4, *SHAPE)
        assert c.get_into(keys, out) == 4 and torch.equal(out, x)
        ((_, off, size),) = _slots(node, keys[1:2])
        h = parse_header(node.slab.view[off : off + size])
        node.slab.view[off + h.layer_offset(0) + 1] ^= 0x20
        assert c.get_into(keys, torch.zeros(4, *SHAPE)) == 1


def _slots(node, keys):
    """(key, slab offset, size) of held dram blocks, read through a lease."""
    lease_id, refs = node.store.acquire(keys, ttl=5)
    node.store.release(lease_id)
    return [(r.key, r.offset, r.length) for r in refs]


def test_corrupt_ssd_block_is_a_miss(make_node):
    node = make_node(dram_blocks=1, ssd_blocks=2)
    with StoreClient(node.address) as c:
        keys, x = chain(2), blocks(2)
        c.put(keys[:1], x[:1], FP)
        c.put(keys[1:], x[1:], FP, parent=keys[0])  # one put must fit in dram
        assert c.lookup(keys).tiers == ["ssd", "dram"]
        data = bytearray(node.ssd.get(keys[0]))
        data[-1] ^= 1
        node.ssd.put(keys[0], bytes(data), None)
        out = torch.zeros(2, *SHAPE)
        assert c.get_into(keys, out) == 0 and not out.any()
        assert c.lookup(keys).num_blocks == 0 and node.ssd.get(keys[0]) is None


def test_ssd_never_orphans_a_chain(make_node):
    node = make_node(dram_blocks=2, ssd_blocks=3)
    with StoreClient(node.address) as c:
        keys, x = chain(6), blocks(6)
        for i in range(6):  # one put must fit in dram
            c.put(keys[i : i + 1], x[i : i + 1], FP, parent=keys[i - 1] if i else None)
        # dram keeps the root (it has children) and demotes leaves; when the ssd holds only
        # parents, the demoted leaf (block 4) is dropped rather than a parent
        assert [c.lookup(keys[i : i + 1]).tiers for i in range(6)] == [
            ["dram"],
            ["ssd"],
            ["ssd"],
            ["ssd"],
            [],
            ["dram"],
        ]
        assert c.lookup(keys).tiers == ["dram", "ssd", "ssd", "ssd"]
        s = c.stats()
        assert s.demotions == 3 and s.tiers[0].evictions == 4 and s.tiers[1].evictions == 0


def test_ssd_survives_restart(tmp_path):
    cfg = StoreConfig(
        node_id="durable",
        dram_bytes=2 * BLOCK,
        ssd_dir=str(tmp_path / "ssd"),
        ssd_bytes=6 * BLOCK,
        model_fingerprint=FP,
    )
    keys, x = chain(6), blocks(6, seed=9)
    node = StoreNode(cfg)
    try:
        with StoreClient(node.start()) as c:
            for i in range(6):
                c.put(keys[i : i + 1], x[i : i + 1], FP, parent=keys[i - 1] if i else None)
            assert c.lookup(keys).tiers == ["dram"] + ["ssd"] * 4 + ["dram"]
    finally:
        node.stop()  # a graceful stop copies dram blocks into free ssd space
    node = StoreNode(cfg)
    try:
        with StoreClient(node.start()) as c:
            assert c.lookup(keys).tiers == ["ssd"] * 6
            out = torch.empty(6, *SHAPE)
            assert c.get_into(keys, out) == 6 and torch.equal(out, x)
            assert (
                c.lookup(keys).tiers == ["dram"] * 2 + ["ssd"] * 4
            )  # promoted while dram had room
            assert c.stats().promotions == 2
    finally:
        node.stop()


def test_ssd_blocks_found_after_a_crash(tmp_path):
    cfg = StoreConfig(
        node_id="crashy",
        dram_bytes=BLOCK,
        ssd_dir=str(tmp_path / "ssd"),
        ssd_bytes=4 * BLOCK,
        model_fingerprint=FP,
    )
    keys, x = chain(3), blocks(3, seed=2)
    node = StoreNode(cfg)
    with StoreClient(node.start()) as c:
        for i in range(3):
            c.put(keys[i : i + 1], x[i : i + 1], FP, parent=keys[i - 1] if i else None)
    node.server.stop(0)  # no graceful stop: nothing persisted beyond what was demoted
    node.ssd.env.close()
    node.ssd = None
    node._close_tiers()
    node = StoreNode(cfg)
    try:
        with StoreClient(node.start()) as c:
            assert c.lookup(keys).tiers == ["ssd", "ssd"]
            out = torch.empty(3, *SHAPE)
            assert c.get_into(keys, out) == 2 and torch.equal(out[:2], x[:2])
    finally:
        node.stop()


def test_large_blocks_are_chunked():
    shape = (3, 2, 16, 4, 256)  # 3 layers of 128 KiB: each split over messages of 64 KiB
    big = len(encode_block(torch.zeros(shape), FP))
    node = StoreNode(
        StoreConfig(
            node_id="big",
            dram_bytes=4 * big,
            chunk_bytes=64 << 10,
            max_message_bytes=256 << 10,
            model_fingerprint=FP,
        )
    )
    try:
        with StoreClient(node.start(), transport="grpc") as c:
            keys = chain(2)
            x = torch.randn(2, *shape)
            assert c.put(keys, x, FP) == 2
            out = torch.empty_like(x)
            assert c.get_into(keys, out) == 2 and torch.equal(out, x)
    finally:
        node.stop()


@pytest.mark.parametrize("codec", ["int8", "kivi4", "kivi2"])
def test_lossy_codecs_through_the_store(make_node, transport, codec):
    node = make_node()
    with StoreClient(node.address, transport=transport) as c:
        keys, x = chain(2), blocks(2, seed=4)
        c.put(keys, x, FP, codec=codec)
        out = torch.empty_like(x)
        assert c.get_into(keys, out) == 2
        want = torch.stack([decode_block(encode_block(x[i], FP, codec)) for i in range(2)])
        assert torch.equal(out, want)  # exactly what the codec gives, whichever path carried it
        assert not torch.equal(out, x)


# ---------------------------------------------------------------------- bad input


def test_unknown_keys_are_misses(make_node, transport):
    node = make_node()
    with StoreClient(node.address, transport=transport) as c:
        assert c.lookup([b"x" * 16, b"short"]) == LookupResult(0, [])
        assert c.get_into([b"nope" * 4], torch.empty(1, *SHAPE)) == 0
        assert c.lookup([]) == LookupResult(0, [])


def _raw_put(stub, keys, payloads, fingerprint=FP, headers=None, commit=True):
    def stream():
        yield pb.KVPutChunk(
            open=pb.KVPutOpen(
                keys=keys, sizes=[len(p) for p in payloads], model_fingerprint=fingerprint
            )
        )
        for i, p in enumerate(payloads):
            yield pb.KVPutChunk(
                data=pb.KVPutData(parts=[pb.KVBlockPart(block=i, offset=0, data=p)])
            )
        if commit:
            yield pb.KVPutChunk(
                commit=pb.KVPutCommit(headers=headers if headers is not None else [b""] * len(keys))
            )

    return stub.Put(stream(), timeout=10)


def _assert_nothing_stored(node, keys):
    s = node.store.stats()
    assert s.pending_blocks == 0 and s.leases == 0
    assert node.store.lookup(keys) == []


def test_malformed_block_refused(make_node):
    node = make_node()
    stub = pb_grpc.KVStoreStub(grpc.insecure_channel(node.address))
    keys = chain(2)
    good = encode_block(blocks(1)[0], FP)
    bad = bytearray(good)
    bad[-5] ^= 1
    for payloads in ([good, bytes(bad)], [good, b"\0" * len(good)], [good, b"garbage"]):
        with pytest.raises(grpc.RpcError) as e:
            _raw_put(stub, keys, payloads)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        _assert_nothing_stored(node, keys)
    with pytest.raises(grpc.RpcError) as e:
        _raw_put(stub, keys, [good, good], commit=False)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "commit" in e.value.details()
    _assert_nothing_stored(node, keys)
    with pytest.raises(grpc.RpcError) as e:
        _raw_put(stub, [b"k" * 3], [good])
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "key" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:  # data outside the block
        stub.Put(
            iter(
                [
                    pb.KVPutChunk(
                        open=pb.KVPutOpen(keys=keys[:1], sizes=[len(good)], model_fingerprint=FP)
                    ),
                    pb.KVPutChunk(
                        data=pb.KVPutData(
                            parts=[pb.KVBlockPart(block=0, offset=len(good), data=b"x")]
                        )
                    ),
                ]
            )
        )
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    _assert_nothing_stored(node, keys)
    # the server keeps serving
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(node.address))
    assert (
        health.Check(health_pb2.HealthCheckRequest(service="halfmoon.KVStore")).status
        == health_pb2.HealthCheckResponse.SERVING
    )
    assert (
        _raw_put(stub, keys, [good, good], headers=[good[: parse_header(good).header_len]] * 2).held
        == 2
    )


def test_corrupted_shm_write_refused(make_node):
    node = make_node()
    with StoreClient(node.address, transport="shm") as c:
        keys = chain(2)
        w = c.open_put(keys, SHAPE, torch.float32, FP)
        for layer in range(SHAPE[0]):
            w.write_layer(layer, blocks(2)[:, layer])
        off = w.slots[1][1]
        c.slab.view[off + parse_header(encode_block(torch.zeros(SHAPE), FP)).header_len] ^= (
            1  # after its checksum
        )
        with pytest.raises(ValueError, match="checksum"):
            w.commit()
        _assert_nothing_stored(node, keys)


def test_a_commit_checks_every_header_of_a_run_not_only_the_first(make_node):
    """A writer that hashed its layers as it copied them (write_whole) has the node check only
    the headers at commit, in one pass over the run (block_header.check_headers): a header
    changed after the copy anywhere in the run (a checksum table entry, the fingerprint) refuses
    the put, naming the block, and leaves nothing stored; an untouched run is stored."""
    node = make_node()
    x = blocks(3)
    other = encode_block(x[2], "test-mode1")  # same length as FP: the same header length
    for where in ("table", "fingerprint"):
        with StoreClient(node.address, transport="shm") as c:
            keys = chain(3)
            w = c.open_put(keys, SHAPE, torch.float32, FP)
            w.write_whole(x)
            off, seal = dict(w.slots), w._seal_headers

            def seal_then_tamper(where=where, off=off, seal=seal):  # after the writer's seal
                seal()
                if where == "table":
                    fixed_len, _ = table_offsets(c.slab.view[off[1] :], parse_header(other))
                    c.slab.view[off[1] + fixed_len + 3] ^= 1
                else:
                    head = parse_header(other).header_len
                    c.slab.view[off[2] : off[2] + head] = other[:head]

            w._seal_headers = seal_then_tamper
            why = "block 1: header checksum" if where == "table" else "block 2: model fingerprint"
            with pytest.raises(ValueError, match=why):
                w.commit()
            _assert_nothing_stored(node, keys)
    with StoreClient(node.address, transport="shm") as c:
        assert c.put(chain(3), x, FP) == 3
        out = torch.empty_like(x)
        assert c.get_into(chain(3), out) == 3 and torch.equal(out, x)


def test_get_into_rows_lands_each_block_in_its_row_and_nothing_else(make_node, transport):
    """get_into(rows=...): key i's block in out[rows[i]] (a pool and the blocks a worker took
    from it; over shared memory copied there directly, elsewhere staged); other rows untouched;
    a block that fails its checks ends the run; bad rows are refused before anything moves."""
    node = make_node()
    x = blocks(3)
    with StoreClient(node.address, transport=transport) as c:
        assert c.put(chain(3), x, FP) == 3
        pool = torch.full((8, *SHAPE), 7.0)
        assert c.get_into(chain(3), pool, rows=[5, 0, 3]) == 3
        assert torch.equal(pool[5], x[0]) and torch.equal(pool[0], x[1])
        assert torch.equal(pool[3], x[2])
        assert bool((pool[[1, 2, 4, 6, 7]] == 7.0).all())
        for rows, why in (([1, 2], "2 rows"), ([1, 8, 2], "outside"), ([1, 1, 2], "repeat")):
            with pytest.raises(ValueError, match=why):
                c.get_into(chain(3), pool, rows=rows)
        if transport == "shm":  # a layer of block 1 corrupted in the slab: the run ends there
            lease, refs = node.store.acquire(chain(3)[1:2], ttl=5)
            node.store.release(lease)
            header = parse_header(node.slab.view[refs[0].offset : refs[0].offset + BLOCK])
            node.slab.view[refs[0].offset + header.layer_offset(1) + 5] ^= 0xFF
            pool.fill_(7.0)
            assert c.get_into(chain(3), pool, rows=[6, 2, 4]) == 1
            assert torch.equal(pool[6], x[0]) and bool((pool[4] == 7.0).all())


def test_check_headers_takes_blocks_of_other_layouts_alone():
    """Blocks in one run need not share a layout: one of another shape (another length) is
    parsed on its own and passes; a cut one fails, named."""
    import numpy as np

    from kvstore.block_header import check_headers

    encoded = [
        encode_block(torch.zeros(SHAPE), FP),
        encode_block(torch.zeros((1, 2, 4, 2, 8)), FP),
        encode_block(torch.ones(SHAPE), FP),
    ]
    array = np.frombuffer(b"".join(encoded) + bytes(64), dtype=np.uint8)
    offsets = [0, len(encoded[0]), len(encoded[0]) + len(encoded[1])]
    sizes = [len(b) for b in encoded]
    check_headers(array, offsets, sizes, FP)
    with pytest.raises(ValueError, match="block 1: block is"):
        check_headers(array, offsets, [sizes[0], sizes[1] - 64, sizes[2]], FP)
    with pytest.raises(ValueError, match="block 0: model fingerprint"):
        check_headers(array, offsets, sizes, "another")


def test_wrong_fingerprint_refused(make_node, transport):
    node = make_node()
    with StoreClient(node.address, transport=transport) as c:
        with pytest.raises(ValueError, match="fingerprint"):
            c.put(chain(2), blocks(2), "another-model")
        _assert_nothing_stored(node, chain(2))
        assert c.put(chain(2), blocks(2), FP) == 2


def test_put_beyond_capacity(make_node, transport):
    node = make_node(dram_blocks=3)
    with StoreClient(node.address, transport=transport) as c:
        with pytest.raises(StoreFull):
            c.put(chain(4), blocks(4), FP)
        _assert_nothing_stored(node, chain(4))
        assert c.put(chain(3), blocks(3), FP) == 3


def test_writer_checks_its_input(make_node):
    node = make_node()
    with StoreClient(node.address) as c:
        w = c.open_put(chain(2), SHAPE, torch.float32, FP)
        with pytest.raises(ValueError):
            w.write_layer(0, torch.zeros(3, *SHAPE[1:]))
        with pytest.raises(ValueError):
            w.write_layer(SHAPE[0], torch.zeros(2, *SHAPE[1:]))
        with pytest.raises(ValueError):
            w.write_layer(0, torch.zeros(2, *SHAPE[1:], dtype=torch.float16))
        w.abort()
        with pytest.raises(ValueError):
            c.get_into(chain(3), torch.empty(2, *SHAPE))


def test_metrics_exported(make_node, free_port):
    import urllib.request

    node = make_node(metrics_port=free_port)
    with StoreClient(node.address) as c:
        c.put(chain(2), blocks(2), FP)
        c.get_into(chain(2), torch.empty(2, *SHAPE))
    text = (
        urllib.request.urlopen(f"http://127.0.0.1:{free_port}/metrics", timeout=5).read().decode()
    )
    assert 'halfmoon_store_blocks{node="n0",tier="dram"} 2.0' in text
    assert 'halfmoon_store_hits_total{node="n0",tier="dram"} 2.0' in text
    assert 'halfmoon_store_transfer_bytes_total{node="n0",op="put",path="shm"}' in text


def test_slab_allocator_coalesces():
    a = SlabAllocator(64 * 10)
    offs = [a.alloc(64) for _ in range(10)]
    assert offs == [64 * i for i in range(10)] and a.alloc(1) is None
    for i in (1, 2, 3, 7):
        a.free(offs[i], 64)
    assert a.largest_free() == 192 and a.alloc(192) == 64 and a.alloc(64) == 448
    a.free(0, 64)
    a.free(64, 192)
    assert a.largest_free() == 256 and a.used == 64 * 6


def test_stale_slabs_of_killed_nodes_are_removed(tmp_path):
    from kvstore.slab import ShmSlab, remove_stale

    live = ShmSlab.create(str(tmp_path), "live", 4096)
    dead = ShmSlab.create(str(tmp_path), "dead", 4096)
    dead.close()  # (a closed slab is unlinked by its owner: leave its file as a killed node does)
    dead = tmp_path / os.path.basename(dead.path)
    dead.write_bytes(b"\0" * 4096)
    other = tmp_path / "unrelated"
    other.write_bytes(b"x")
    # the workers' CPU turn lock: never mapped, held with flock by live workers
    turns = tmp_path / "halfmoon-cpus-0-1.lock"
    turns.write_bytes(b"")
    try:
        assert remove_stale(str(tmp_path), min_age_s=0) == [str(dead)]
        assert os.path.exists(live.path) and other.exists() and not dead.exists()
        assert turns.exists()
    finally:
        live.close()


def test_client_follows_a_restarted_node(free_port):
    cfg = StoreConfig(node_id="again", port=free_port, dram_bytes=8 * BLOCK, model_fingerprint=FP)
    node = StoreNode(cfg)
    c = StoreClient(node.start(), transport="shm")
    try:
        keys, x = chain(2), blocks(2)
        c.put(keys, x, FP)
        old = c.slab.path
        node.stop()
        node = StoreNode(cfg)  # same address, a new slab
        node.start()
        out = torch.empty(2, *SHAPE)
        assert c.get_into(keys, out) == 0  # dram died with the node: a miss, not stale bytes
        assert c.put(keys, x, FP) == 2 and c.slab.path != old
        assert c.get_into(keys, out) == 2 and torch.equal(out, x)
    finally:
        c.close()
        node.stop()


def test_garbage_put_messages_refused(make_node):
    from kvstore.wire import raw_put

    node = make_node()
    put = raw_put(grpc.insecure_channel(node.address))
    good = encode_block(blocks(1)[0], FP)
    opening = pb.KVPutChunk(
        open=pb.KVPutOpen(keys=chain(1), sizes=[len(good)], model_fingerprint=FP)
    )
    for junk in (b"\x12\xff\xff\xff", b"\x12\x03\x0a\x01\x08", b"\xff" * 9):
        with pytest.raises(grpc.RpcError) as e:
            put(iter([opening, junk]), timeout=10)
        assert (
            e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "malformed" in e.value.details()
        )
        _assert_nothing_stored(node, chain(1))
    with StoreClient(node.address, transport="grpc") as c:  # and it keeps serving
        assert c.put(chain(1), blocks(1), FP) == 1


def test_standard_protobuf_clients_read_the_get_stream(make_node):
    node = make_node()
    keys, x = chain(2), blocks(2)
    with StoreClient(node.address) as c:
        c.put(keys, x, FP)
    stub = pb_grpc.KVStoreStub(grpc.insecure_channel(node.address))
    msgs = list(stub.Get(pb.KVGetRequest(keys=keys), timeout=10))
    encoded = [
        bytearray(h) + bytearray(parse_header(h).total_len - len(h)) for h in msgs[0].headers
    ]
    for m in msgs[1:]:
        for p in m.parts:
            encoded[p.block][p.offset : p.offset + len(p.data)] = p.data
    assert torch.equal(torch.stack([decode_block(bytes(b)) for b in encoded]), x)


def test_lookup_reports_sizes_and_get_record_returns_any_shape_whole(make_node):
    node = make_node(dram_blocks=8)
    keys = chain(3)
    with StoreClient(node.address, transport="grpc") as c:
        assert c.put(keys[:2], blocks(2), FP) == 2
        record = torch.arange(1000, dtype=torch.uint8).reshape(1, 1, 1000) % 251
        odd = block_keys(list(range(900, 904)), 4, FP)[0]
        assert c.put([odd], record, FP) == 1
        found = c.lookup(keys)
        assert found.num_blocks == 2 and list(found.sizes) == [BLOCK, BLOCK]
        got = c.get_record(odd, FP)
        assert got is not None and len(got) == c.lookup([odd]).sizes[0]
        assert torch.equal(decode_block(got), record[0])
        assert c.get_record(keys[2], FP) is None  # not held: a miss
        assert c.get_record(odd, "another-model") is None  # foreign fingerprint: a miss


def test_link_gbps_paces_gets_and_changes_mid_transfer():
    # A thin link on one machine: Get streams are paced to link_gbps, read per message, so a
    # change lands mid-transfer (what CacheGen's adaptive streaming reacts to).
    cfg = StoreConfig(
        node_id="paced", dram_bytes=16 << 20, model_fingerprint=FP, link_gbps=0.4,
        chunk_bytes=1 << 16,
    )  # fmt: skip
    with pytest.raises(ValueError, match="link_gbps"):
        StoreConfig(link_gbps=-1)
    node = StoreNode(cfg)
    node.start()
    try:
        with pytest.raises(ValueError, match="link_gbps"):
            node.set_link_gbps(-0.5)
        g = torch.Generator().manual_seed(3)
        record = torch.randint(0, 255, (1, 1, 2 << 20), dtype=torch.uint8, generator=g)
        key = block_keys(list(range(4)), 4, FP)[0]

        def timed_get(c) -> float:
            t0 = time.perf_counter()
            got = c.get_record(key, FP)
            assert got is not None and torch.equal(decode_block(got), record[0])
            return time.perf_counter() - t0

        with StoreClient(node.address, transport="grpc") as c:
            assert c.put([key], record, FP) == 1
            wire_s = (2 << 20) * 8 / 0.4e9  # 42 ms at 0.4 Gbit/s
            assert timed_get(c) >= 0.9 * wire_s
            node.set_link_gbps(0)
            assert timed_get(c) < 0.9 * wire_s  # unlimited: loopback speed
            node.set_link_gbps(0.4)
            threading.Timer(0.01, node.set_link_gbps, args=(0.04,)).start()
            # most of the 2 MiB now crosses at 0.04 Gbit/s: several times the 0.4 Gbit/s time
            assert timed_get(c) > 3 * wire_s
    finally:
        node.stop()


def test_a_burst_of_slow_gets_is_refused_early_and_control_calls_still_answer():
    # Each Get holds a server thread while it streams: two slots here, paced to a thin link so
    # they stay busy. The third Get is refused at once, and Stats and health answer meanwhile.
    cfg = StoreConfig(
        node_id="busy", dram_bytes=16 << 20, model_fingerprint=FP, link_gbps=0.004,
        chunk_bytes=1 << 16, grpc_workers=2,
    )  # fmt: skip
    node = StoreNode(cfg)
    node.start()
    try:
        record = torch.randint(0, 255, (1, 1, 1 << 20), dtype=torch.uint8)
        key = block_keys(list(range(4)), 4, FP)[0]
        with StoreClient(node.address, transport="grpc") as c:
            assert c.put([key], record, FP) == 1
        channel = grpc.insecure_channel(node.address)
        stub = pb_grpc.KVStoreStub(channel)
        request = pb.KVGetRequest(keys=[key])
        slow = [stub.Get(request) for _ in range(2)]  # ~2 s each at 4 Mbit/s
        readers = [threading.Thread(target=lambda s=s: list(s)) for s in slow]
        for t in readers:
            t.start()
        deadline = time.time() + 10
        while node.call_limit.in_flight < 2 and time.time() < deadline:
            time.sleep(0.01)
        assert node.call_limit.in_flight == 2
        t0 = time.perf_counter()
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Get(request, timeout=5))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "busy" in refused.value.details() and time.perf_counter() - t0 < 1.0
        t0 = time.perf_counter()
        stub.Stats(pb.KVStatsRequest(), timeout=2)
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        assert time.perf_counter() - t0 < 1.0
        node.set_link_gbps(0)  # let the slow ones finish: their slots come back
        for t in readers:
            t.join(timeout=30)
        assert node.call_limit.in_flight == 0
        assert node.metrics.busy_refusals.labels("busy")._value.get() == 1
        assert list(stub.Get(request, timeout=5))  # served again
        channel.close()
    finally:
        node.stop()


def test_an_ssd_read_does_not_hold_up_other_calls(make_node):
    # The store reads and checks ssd blocks outside its lock (the lease pins them): while one
    # reader waits on the disk, lookups and dram reads by others go on.
    node = make_node(dram_blocks=2, ssd_blocks=6)
    keys, x = chain(6), blocks(6, seed=4)
    with StoreClient(node.address, transport="grpc") as c:
        for i in range(6):
            c.put(keys[i : i + 1], x[i : i + 1], FP, parent=keys[i - 1] if i else None)
        assert c.lookup(keys).tiers == ["dram"] + ["ssd"] * 4 + ["dram"]
    ssd, real_get = node.store.ssd, node.store.ssd.get
    entered, go = threading.Event(), threading.Event()

    def slow_get(key):  # the real LMDB read, after a disk that takes its time
        entered.set()
        go.wait(10)
        return real_get(key)

    ssd.get = slow_get
    out = torch.empty(2, *SHAPE)
    got = []
    with StoreClient(node.address, transport="grpc") as slow, StoreClient(node.address) as fast:
        reader = threading.Thread(target=lambda: got.append(slow.get_into(keys[:2], out)))
        reader.start()
        try:
            assert entered.wait(10)
            t0 = time.perf_counter()
            assert fast.lookup(keys).tiers[0] == "dram"
            first = torch.empty(1, *SHAPE)
            assert fast.get_into(keys[:1], first) == 1 and torch.equal(first, x[:1])
            assert time.perf_counter() - t0 < 1.0  # not behind the stalled ssd read
        finally:
            go.set()
            reader.join(10)
    ssd.get = real_get
    assert got == [2] and torch.equal(out, x[:2])  # the dram block and the ssd one, both right
