"""The store's batched data path: packed lease replies, whole-block puts hashed once (by their
writer), releases sent in the background, and the gRPC reader's per-layer checks (pieces split,
missing, corrupt, repeated)."""

from __future__ import annotations

import grpc
import pytest
import torch

from kvstore import block_keys
from kvstore.client import StoreClient, encode_block, parse_header
from kvstore.node import StoreConfig, StoreNode
from kvstore.wire import Part, get_chunk
from protos import kvstore_pb2 as pb

FP = "test-model"
SHAPE = (3, 2, 4, 2, 8)  # [layers, K/V, tokens, kv heads, head dim]
BLOCK = len(encode_block(torch.zeros(SHAPE), FP))


def blocks(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, *SHAPE), generator=g)


def chain(n: int, start: int = 0) -> list[bytes]:
    return block_keys(list(range(start, start + 4 * n)), 4, FP)


@pytest.fixture
def node():
    n = StoreNode(StoreConfig(node_id="dp", dram_bytes=16 * BLOCK, model_fingerprint=FP))
    n.start()
    yield n
    n.stop()


def test_packed_lease_replies_match_per_block_slots(node):
    with StoreClient(node.address, transport="shm") as c:
        keys = chain(4)
        c.put(keys, blocks(4), FP)
        read = pb.KVLeaseRequest(mode=pb.KVLeaseRequest.READ, keys=keys + chain(1, start=99))
        per_block = c.stub.Lease(read)
        slots = per_block.slots
        packed = c.stub.Lease(pb.KVLeaseRequest(packed=True, **_fields(read)))
        assert not packed.slots and list(packed.indices) == [s.index for s in slots]
        assert list(packed.offsets) == [s.offset for s in slots]
        assert list(packed.lengths) == [s.length for s in slots] == [BLOCK] * 4
        assert list(packed.tiers) == ["dram"] * 4
        write = pb.KVLeaseRequest(
            mode=pb.KVLeaseRequest.WRITE,
            keys=keys[:2] + chain(2, start=50),  # two held, two new
            sizes=[BLOCK] * 4,
            model_fingerprint=FP,
            packed=True,
        )
        w = c.stub.Lease(write)
        assert not w.slots and list(w.indices) == [2, 3] and list(w.lengths) == [BLOCK] * 2
        assert len(set(w.offsets)) == 2
        for lease in (per_block, packed, w):
            c.stub.Release(pb.KVReleaseRequest(lease_id=lease.lease_id))
        s = c.stats()
        assert s.leases == 0 and s.pending_blocks == 0


def _fields(req: pb.KVLeaseRequest) -> dict:
    return {f.name: v for f, v in req.ListFields()}


def _write_lease(c: StoreClient, keys: list[bytes]) -> tuple[int, list[int]]:
    reply = c.stub.Lease(
        pb.KVLeaseRequest(
            mode=pb.KVLeaseRequest.WRITE,
            keys=keys,
            sizes=[BLOCK] * len(keys),
            model_fingerprint=FP,
            packed=True,
        )
    )
    return reply.lease_id, list(reply.offsets)


def _write(c: StoreClient, offs: list[int], x: torch.Tensor) -> None:
    for off, b in zip(offs, x):
        c.slab.view[off : off + BLOCK] = encode_block(b, FP)


def test_writer_hashed_commit_checks_headers_and_readers_check_payloads(node):
    with StoreClient(node.address, transport="shm") as c:
        keys, x = chain(2), blocks(2)
        lease, offs = _write_lease(c, keys)
        _write(c, offs, x)
        c.slab.view[offs[1] + 7] ^= 1  # in block 1's header
        with pytest.raises(grpc.RpcError) as e:
            c.stub.Commit(pb.KVCommitRequest(lease_id=lease, writer_hashed=True))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "header" in e.value.details() and c.lookup(keys).num_blocks == 0

        # a payload corrupted after its writer hashed it: published, and a miss to every reader
        lease, offs = _write_lease(c, keys)
        _write(c, offs, x)
        h = parse_header(c.slab.view[offs[1] : offs[1] + BLOCK])
        c.slab.view[offs[1] + h.layer_offset(2) + 5] ^= 1
        assert c.stub.Commit(pb.KVCommitRequest(lease_id=lease, writer_hashed=True)).stored == 2
        out = torch.zeros(2, *SHAPE)
        assert c.get_into(keys, out) == 1 and torch.equal(out[:1], x[:1])
        c.stats()  # the release that reports the corruption has been answered
        assert c.lookup(keys).num_blocks == 1  # dropped: the next put rewrites it

        # without the flag the node hashes every payload, as before
        lease, offs = _write_lease(c, keys[1:])
        _write(c, offs, x[1:])
        c.slab.view[offs[0] + h.layer_offset(2) + 5] ^= 1
        with pytest.raises(grpc.RpcError) as e:
            c.stub.Commit(pb.KVCommitRequest(lease_id=lease))
        assert "checksum mismatch in layer 2" in e.value.details()
        s = c.stats()
        assert s.pending_blocks == 0 and s.leases == 0 and c.lookup(keys).num_blocks == 1


def test_whole_put_is_hashed_once_and_layerwise_put_twice(node):
    with StoreClient(node.address, transport="shm") as c:
        keys, x = chain(3), blocks(3)
        w = c.open_put(keys, SHAPE, torch.float32, FP)
        assert w.can_write_whole(x)
        w.write_whole(x)
        assert w.hashed_in_copy
        assert w.commit().held == 3
        w = c.open_put(chain(2, start=40), SHAPE, torch.float32, FP)
        w.write_whole(x[:2])
        w.write_layer(1, x[:2, 1])  # the caller ran between a layer and the commit
        assert not w.hashed_in_copy
        assert w.commit().held == 2
        out = torch.empty(3, *SHAPE)
        assert c.get_into(keys, out) == 3 and torch.equal(out, x)


def test_layers_copied_from_a_pool_are_hashed_in_the_copy(node):
    with StoreClient(node.address, transport="shm") as c:
        pool = blocks(5, seed=4)  # a worker's pool; keys 0..2 live in its blocks 4, 1, 3
        flat = pool.reshape(-1).view(torch.uint8).numpy()
        block_bytes, layer_bytes = pool.stride(0) * 4, pool.stride(1) * 4
        keys = chain(3, start=60)
        w = c.open_put(keys, SHAPE, torch.float32, FP)
        assert w.can_copy_layers(pool) and not w.can_copy_layers(pool.to(torch.float16))
        for layer in reversed(range(SHAPE[0])):  # in any order
            assert not w.hashed_in_copy
            w.copy_layer(layer, flat, [b * block_bytes + layer * layer_bytes for b in (4, 1, 3)])
        assert w.hashed_in_copy  # every layer hashed as it was copied: the node skips its pass
        assert w.commit().stored == 3
        out = torch.empty(3, *SHAPE)
        assert c.get_into(keys, out) == 3 and torch.equal(out, pool[[4, 1, 3]])
        # a layer written the other way after copies: the node hashes the payloads again
        w = c.open_put(chain(1, start=90), SHAPE, torch.float32, FP)
        for layer in range(SHAPE[0]):
            w.copy_layer(layer, flat, [layer * layer_bytes])
        w.write_layer(0, pool[:1, 0])
        assert not w.hashed_in_copy and w.commit().stored == 1
        # a committed writer takes no more layers
        with pytest.raises(RuntimeError, match="already committed"):
            w.copy_layer(0, flat, [0])


def test_close_sends_the_queued_releases(node):
    with StoreClient(node.address, transport="shm") as c:
        keys, x = chain(3), blocks(3)
        c.put(keys, x, FP)
        out = torch.empty(3, *SHAPE)
        for _ in range(4):
            assert c.get_into(keys, out) == 3
    # closed: every get's lease is back without waiting on any timeout
    assert node.store.stats().leases == 0
    assert node.store.stats().tiers[0].hits == 12


def _stream(x: torch.Tensor, pieces: list[tuple[int, int, int, int]]):
    """A Get stream's payload messages for blocks x: one message per (block, layer, start, end)
    piece of that layer's bytes; the headers of x."""
    encoded = [encode_block(b, FP) for b in x]
    headers = [parse_header(e) for e in encoded]
    msgs = []
    for b, layer, lo, hi in pieces:
        at = headers[b].layer_offset(layer)
        msgs.append(get_chunk([Part(b, layer, at + lo, memoryview(encoded[b])[at + lo : at + hi])]))
    return msgs, headers


def _all_pieces(n: int, split: int) -> list[tuple[int, int, int, int]]:
    lb = parse_header(encode_block(torch.zeros(SHAPE), FP)).layer_bytes
    return [
        (b, layer, lo, min(lb, lo + split))
        for layer in range(SHAPE[0])
        for b in range(n)
        for lo in range(0, lb, split)
    ]


def test_grpc_reader_joins_split_layers_in_any_order():
    x = blocks(3, seed=3)
    pieces = _all_pieces(3, split=100)
    msgs, headers = _stream(x, pieces[::-1])  # every layer in pieces, last piece first
    out = torch.zeros(3, *SHAPE)
    assert StoreClient._receive_layers(iter(msgs), headers, out) == (3, [])
    assert torch.equal(out, x)


def test_grpc_reader_ends_the_prefix_at_a_missing_or_corrupt_layer():
    x = blocks(3, seed=4)
    pieces = _all_pieces(3, split=64)
    missing = [p for p in pieces if p[:3] != (1, 2, 64)]  # one piece of block 1's layer 2
    msgs, headers = _stream(x, missing)
    out = torch.zeros(3, *SHAPE)
    k, corrupt = StoreClient._receive_layers(iter(msgs), headers, out)
    assert (k, corrupt) == (1, []) and torch.equal(out[:1], x[:1])

    msgs, headers = _stream(x, pieces)
    bad = bytearray(msgs[-1])
    bad[-1] ^= 1  # the last piece: block 2's last layer
    k, corrupt = StoreClient._receive_layers(iter(msgs[:-1] + [bytes(bad)]), headers, out)
    assert (k, corrupt) == (2, [2]) and torch.equal(out[:2], x[:2])


def test_grpc_reader_never_rewrites_a_checked_layer():
    x, other = blocks(2, seed=5), blocks(2, seed=6)
    msgs, headers = _stream(x, _all_pieces(2, split=10**6))
    again, _ = _stream(other, [(0, 1, 0, 64)])  # block 0 layer 1 again, other bytes
    out = torch.zeros(2, *SHAPE)
    assert StoreClient._receive_layers(iter(msgs + again), headers, out) == (2, [])
    assert torch.equal(out, x)
