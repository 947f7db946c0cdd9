"""The store's bulk port (kvstore/bulk.py): what other hosts' clients use for block bytes. Every
store test that takes a `transport` runs over it too (tests/test_kvstore.py); here: what only it
has, its access control, bad input on the raw socket, a writer that leaves, and the fallback."""

from __future__ import annotations

import socket
import struct
import time

import pytest
import torch

from kvstore import BulkChannel, BulkError, StoreUnavailable, block_keys
from kvstore.bulk import (
    COMMIT,
    DATA,
    DONE,
    GET,
    HEADERS,
    HELLO,
    OK,
    PUT_OPEN,
    SLOTS,
    PutOpen,
    decode_headers,
    decode_slots,
    encode_commit,
    encode_data,
    encode_keys,
    encode_open,
    expect,
    recv_frame,
    send_frame,
)
from kvstore.client import StoreClient, encode_block
from kvstore.node import StoreConfig, StoreNode
from servekit import SecurityConfig, make_certs

FP = "bulk-test"
SHAPE = (3, 2, 4, 2, 8)
BLOCK = len(encode_block(torch.zeros(SHAPE), FP))


def blocks(n: int, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, *SHAPE), generator=g).to(dtype)


def chain(n: int, start: int = 0) -> list[bytes]:
    return block_keys(list(range(start, start + 4 * n)), 4, FP)


@pytest.fixture
def node():
    n = StoreNode(StoreConfig(node_id="bulk", dram_bytes=64 * BLOCK, model_fingerprint=FP))
    n.start()
    yield n
    n.stop()


def raw_connection(node, token: str = "") -> socket.socket:
    """A plain socket to the node's bulk port after HELLO (as BulkChannel opens one)."""
    sock = socket.create_connection(("127.0.0.1", node.bulk_port), timeout=10)
    send_frame(sock, HELLO, token.encode())
    return sock


def held_and_pending(node) -> tuple[int, int, int]:
    s = node.store.stats()
    return sum(t.blocks for t in s.tiers), s.pending_blocks, s.leases


def wait_for(cond, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)
    return cond()


def test_the_bulk_port_carries_blocks_and_the_grpc_port_sees_the_same_store(node):
    with StoreClient(node.address, transport="tcp") as tcp, StoreClient(
        node.address, transport="grpc"
    ) as rpc:
        assert tcp.transport == "tcp" and tcp.info.bulk_port == node.bulk_port
        keys, x = chain(6), blocks(6, dtype=torch.bfloat16)
        assert tcp.put(keys[:4], x[:4], FP) == 4
        # a put whose first blocks are held sends only the rest
        before = node.metrics.transfer_bytes.labels("bulk", "put", "tcp")._value.get()
        assert tcp.put(keys, x, FP) == 6
        sent = node.metrics.transfer_bytes.labels("bulk", "put", "tcp")._value.get() - before
        assert sent == 2 * x[0].numel() * 2  # two payloads, nothing of the four held
        out = torch.zeros_like(x)
        assert rpc.get_into(keys, out) == 6 and torch.equal(out, x)
        out.zero_()
        assert tcp.get_into(keys + chain(1, start=900), torch.zeros(7, *SHAPE, dtype=x.dtype)) == 6
        assert tcp.get_into(keys, out) == 6 and torch.equal(out, x)
        # a codec's blocks are decoded on arrival, as over gRPC
        k8 = chain(3, start=300)
        assert tcp.put(k8, blocks(3, seed=4), FP, codec="int8") == 3
        via_tcp, via_rpc = torch.zeros(3, *SHAPE), torch.zeros(3, *SHAPE)
        assert tcp.get_into(k8, via_tcp) == 3 and rpc.get_into(k8, via_rpc) == 3
        assert torch.equal(via_tcp, via_rpc)
        assert (via_tcp - blocks(3, seed=4)).abs().max() < 0.05


def test_a_block_that_fails_its_checksum_in_flight_is_a_miss_and_the_client_goes_on(node):
    with StoreClient(node.address, transport="tcp") as c:
        keys, x = chain(4), blocks(4)
        c.put(keys, x, FP)
        lease_id, refs = node.store.acquire(keys[2:3], ttl=5)
        node.store.release(lease_id)
        off = refs[0].offset + refs[0].length - 5
        node.slab.view[off] ^= 0x40  # the last layer of block 2
        out = torch.zeros(4, *SHAPE)
        assert c.get_into(keys, out) == 2 and torch.equal(out[:2], x[:2])
        c.stats()  # waits for the release that reports it
        assert c.lookup(keys).num_blocks == 2
        # the connection that left bytes unread was closed; the next call opens another
        assert c.put(keys, x, FP) == 4 and c.get_into(keys, out) == 4 and torch.equal(out, x)


def test_bad_input_on_the_raw_socket_is_refused_by_name_and_the_node_keeps_serving(node):
    keys, x = chain(2), blocks(2)
    # a call before HELLO
    with socket.create_connection(("127.0.0.1", node.bulk_port), timeout=10) as s:
        send_frame(s, GET, encode_keys(keys))
        with pytest.raises(BulkError) as e:
            expect(s, OK)
        assert e.value.code == "UNAUTHENTICATED" and "HELLO" in e.value.message
    # a frame longer than any key list
    with raw_connection(node) as s:
        expect(s, OK)
        s.sendall(struct.pack("<IB", 1 << 30, GET))
        with pytest.raises(BulkError) as e:
            expect(s, HEADERS)
        assert e.value.code == "INVALID_ARGUMENT" and "frame" in e.value.message
    # keys of the wrong length
    with raw_connection(node) as s:
        expect(s, OK)
        send_frame(s, GET, b"x" * 17)
        with pytest.raises(BulkError, match="16 bytes each"):
            expect(s, HEADERS)
    # a put's data outside its blocks: refused before a byte lands, nothing reserved stays
    with raw_connection(node) as s:
        expect(s, OK)
        send_frame(s, PUT_OPEN, encode_open(PutOpen(FP, b"", [BLOCK] * 2, keys)))
        assert decode_slots(expect(s, SLOTS)) == [0, 1]
        send_frame(s, DATA, encode_data([(1, BLOCK - 4, 8)]), [b"\0" * 8])
        with pytest.raises(BulkError, match="outside the blocks"):
            expect(s, DONE)
    # a wrong fingerprint, and a put of no blocks
    for fp, ks in (("other-model", keys), (FP, [])):
        with raw_connection(node) as s:
            expect(s, OK)
            send_frame(s, PUT_OPEN, encode_open(PutOpen(fp, b"", [BLOCK] * len(ks), ks)))
            with pytest.raises(BulkError) as e:
                expect(s, SLOTS)
            assert e.value.code == "INVALID_ARGUMENT"
    # blocks whose bytes do not match their headers' checksums: refused, nothing stored
    good = [bytes(encode_block(x[i], FP)) for i in range(2)]
    with raw_connection(node) as s:
        expect(s, OK)
        send_frame(s, PUT_OPEN, encode_open(PutOpen(FP, b"", [BLOCK] * 2, keys)))
        expect(s, SLOTS)
        tampered = bytearray(good[1])
        tampered[-1] ^= 1
        send_frame(s, DATA, encode_data([(0, 0, BLOCK), (1, 0, BLOCK)]), [good[0], tampered])
        send_frame(s, COMMIT, encode_commit([good[0][:64], good[1][:64]]))
        with pytest.raises(BulkError) as e:
            expect(s, DONE)
        assert e.value.code == "INVALID_ARGUMENT" and "refused" in e.value.message
    assert held_and_pending(node) == (0, 0, 0)
    # and the node serves the next client as if nothing happened
    with StoreClient(node.address, transport="tcp") as c:
        assert c.put(keys, x, FP) == 2
        out = torch.zeros(2, *SHAPE)
        assert c.get_into(keys, out) == 2 and torch.equal(out, x)


def test_a_writer_that_leaves_mid_put_stores_nothing_and_frees_its_room(node):
    keys, x = chain(3), blocks(3)
    with StoreClient(node.address, transport="tcp") as c:
        w = c.open_put(keys, SHAPE, torch.float32, FP)
        w.write_layer(0, x[:, 0])
        assert held_and_pending(node)[1] == 3
        w.abort()  # closes its connection: the node lets the reservation go
        assert wait_for(lambda: held_and_pending(node) == (0, 0, 0))
        assert c.put(keys, x, FP) == 3
    # a raw writer that hangs up between DATA frames
    with raw_connection(node) as s:
        expect(s, OK)
        ks = chain(2, start=500)
        send_frame(s, PUT_OPEN, encode_open(PutOpen(FP, b"", [BLOCK] * 2, ks)))
        expect(s, SLOTS)
        send_frame(s, DATA, encode_data([(0, 0, 100)]), [b"\1" * 100])
    assert wait_for(lambda: held_and_pending(node) == (3, 0, 0))


def test_the_cluster_token_and_mutual_tls_guard_the_bulk_port(tmp_path):
    certs = make_certs(tmp_path / "certs")
    sec = SecurityConfig(
        tls_cert=certs.cert, tls_key=certs.key, tls_ca=certs.ca, mutual_tls=True,
        cluster_token="node-secret",
    )  # fmt: skip
    n = StoreNode(StoreConfig(node_id="tls", dram_bytes=16 * BLOCK, security=sec))
    n.start()
    try:
        with StoreClient(n.address, transport="tcp", security=sec) as c:
            keys, x = chain(2), blocks(2)
            assert c.transport == "tcp" and c.put(keys, x, FP) == 2
            out = torch.zeros(2, *SHAPE)
            assert c.get_into(keys, out) == 2 and torch.equal(out, x)
        # plaintext: no TLS handshake, no bytes served
        with socket.create_connection(("127.0.0.1", n.bulk_port), timeout=10) as s:
            try:  # the node resets the connection: at a send or at the read
                send_frame(s, HELLO, b"node-secret")
                send_frame(s, GET, encode_keys(keys))
                assert recv_frame(s) is None
            except ConnectionError:
                pass
        # TLS without a client certificate: refused in the handshake
        no_cert = SecurityConfig(tls_ca=certs.ca, cluster_token="node-secret")
        with pytest.raises(OSError):
            chan = BulkChannel("127.0.0.1", n.bulk_port, no_cert, timeout_s=5)
            chan.open()
        # the certificate but the wrong token
        wrong = SecurityConfig(
            tls_cert=certs.cert, tls_key=certs.key, tls_ca=certs.ca, cluster_token="guess"
        )
        with pytest.raises(BulkError) as e:
            BulkChannel("127.0.0.1", n.bulk_port, wrong, timeout_s=5).open()
        assert e.value.code == "UNAUTHENTICATED"
        with BulkChannel("127.0.0.1", n.bulk_port, sec, timeout_s=5).connection() as s:
            send_frame(s, GET, encode_keys(keys))
            headers, lengths = decode_headers(expect(s, HEADERS))
            assert len(headers) == 2 and lengths == [BLOCK - len(headers[0])] * 2
    finally:
        n.stop()


def test_auto_takes_the_bulk_port_off_host_and_falls_back_to_grpc_counted(tmp_path):
    # a node without a dram slab offers no shared memory: "auto" chooses as on another host
    n = StoreNode(
        StoreConfig(node_id="far", dram_bytes=0, ssd_dir=str(tmp_path / "ssd"), ssd_bytes=1 << 20)
    )
    n.start()
    try:
        falls = []
        with StoreClient(n.address, on_fallback=falls.append) as c:
            assert c.transport == "tcp" and not falls
        n.bulk.stop()  # the port is still advertised, but nobody answers it
        with StoreClient(n.address, on_fallback=falls.append) as c:
            assert c.transport == "grpc" and len(falls) == 1 and "did not open" in falls[0]
            assert c.lookup(chain(1)).num_blocks == 0  # and it serves over gRPC
        with pytest.raises(StoreUnavailable, match="bulk port"):
            StoreClient(n.address, transport="tcp")
    finally:
        n.stop()
    off = StoreNode(StoreConfig(node_id="nobulk", dram_bytes=8 * BLOCK, bulk_port=-1))
    off.start()
    try:
        with StoreClient(off.address, transport="grpc") as c:
            assert c.info.bulk_port == 0
        with pytest.raises(StoreUnavailable, match="no bulk port"):
            StoreClient(off.address, transport="tcp")
    finally:
        off.stop()


def test_a_call_that_finds_every_bulk_connection_taken_goes_over_grpc_counted():
    n = StoreNode(
        StoreConfig(node_id="two", dram_bytes=16 * BLOCK, model_fingerprint=FP, bulk_connections=2)
    )
    n.start()
    falls = []
    try:
        with StoreClient(n.address, transport="tcp", on_fallback=falls.append) as c:
            keys, x = chain(3), blocks(3)
            assert c.put(keys, x, FP) == 3 and not falls  # on the client's pooled connection
            other = BulkChannel("127.0.0.1", n.bulk_port, None)
            other.open()  # the node's second and last connection
            w = c.open_put(chain(2, start=50), SHAPE, torch.float32, FP)  # takes the pooled one
            out = torch.zeros(3, *SHAPE)
            before = n.metrics.transfer_bytes.labels("two", "get", "grpc")._value.get()
            assert c.get_into(keys, out) == 3 and torch.equal(out, x)  # no third: over gRPC
            assert len(falls) == 1 and "get" in falls[0] and "RESOURCE_EXHAUSTED" in falls[0]
            assert n.metrics.transfer_bytes.labels("two", "get", "grpc")._value.get() > before
            for layer in range(SHAPE[0]):
                w.write_layer(layer, blocks(2, seed=5)[:, layer])
            assert w.commit().held == 2  # and the bulk put it had goes on
            other.close()
    finally:
        n.stop()


def test_busy_bulk_port_refuses_at_once(tmp_path):
    n = StoreNode(StoreConfig(node_id="busy", dram_bytes=8 * BLOCK, bulk_connections=1))
    n.start()
    try:
        first = BulkChannel("127.0.0.1", n.bulk_port, None)
        first.open()  # holds the only connection
        with pytest.raises(BulkError) as e:
            BulkChannel("127.0.0.1", n.bulk_port, None).open()
        assert e.value.code == "RESOURCE_EXHAUSTED"
        assert n.metrics.busy_refusals.labels("busy")._value.get() == 1
        first.close()
    finally:
        n.stop()


def test_the_bulk_port_is_paced_to_link_gbps_as_the_grpc_stream_is():
    n = StoreNode(
        StoreConfig(node_id="paced", dram_bytes=8 << 20, link_gbps=0.4, chunk_bytes=1 << 16)
    )
    n.start()
    try:
        shape = (8, 2, 16, 16, 64)  # 2 MiB of bf16
        x = torch.randn(1, *shape).to(torch.bfloat16)
        key = block_keys(list(range(4)), 4, FP)[:1]
        wire_s = x.numel() * 2 * 8 / 0.4e9  # 42 ms at 0.4 Gbit/s
        with StoreClient(n.address, transport="tcp") as c:
            assert c.put(key, x, FP) == 1
            out = torch.empty_like(x)
            t0 = time.perf_counter()
            assert c.get_into(key, out) == 1 and torch.equal(out, x)
            assert time.perf_counter() - t0 >= 0.9 * wire_s
            n.set_link_gbps(0)
            t0 = time.perf_counter()
            assert c.get_into(key, out) == 1
            assert time.perf_counter() - t0 < 0.9 * wire_s  # unlimited: loopback speed
    finally:
        n.stop()
