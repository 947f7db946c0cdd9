"""Store nodes and readers in separate processes: blocks move between two nodes over gRPC and
shared memory, and a lease held by a reader that is killed expires."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest
import torch

from kvstore import StoreFull, block_keys
from kvstore.client import StoreClient, encode_block
from kvstore.node import StoreConfig, StoreNode
from protos import kvstore_pb2 as pb

FP = "proc-model"
SHAPE = (3, 2, 8, 2, 16)
BLOCK = len(encode_block(torch.zeros(SHAPE), FP))


def _serve(cfg: dict, conn) -> None:
    """A store node in its own process, driven over a pipe."""
    node = StoreNode(StoreConfig(**cfg))
    conn.send((node.start(), node.slab.path))
    with StoreClient(node.address, transport="shm") as own:
        while True:
            cmd = conn.recv()
            if cmd[0] == "pull":  # fetch from another node over gRPC, keep it here over shm
                _, src, keys = cmd
                with StoreClient(src, transport="grpc") as remote:
                    out = torch.empty(len(keys), *SHAPE)
                    k = remote.get_into(keys, out)
                conn.send((k, own.put(keys[:k], out[:k], FP)))
            else:
                break
    node.stop()
    conn.send("stopped")


def _lease_and_hang(address: str, keys: list[bytes], conn) -> None:
    c = StoreClient(address, transport="shm")
    reply = c.stub.Lease(pb.KVLeaseRequest(mode=pb.KVLeaseRequest.READ, keys=keys))
    conn.send((reply.lease_id, len(reply.slots)))
    time.sleep(600)


def _start(target, *args):
    ctx = mp.get_context("spawn")  # torch and gRPC do not survive fork
    parent, child = ctx.Pipe()
    p = ctx.Process(target=target, args=(*args, child), daemon=True)
    p.start()
    return p, parent


def test_two_nodes_in_processes_exchange_blocks():
    procs = []
    try:
        (pa, ca), (pb_, cb) = [
            _start(_serve, dict(node_id=n, dram_bytes=16 * BLOCK, model_fingerprint=FP))
            for n in ("a", "b")
        ]
        procs = [pa, pb_]
        (addr_a, shm_a), (addr_b, shm_b) = ca.recv(), cb.recv()
        assert shm_a != shm_b and os.path.exists(shm_a) and os.path.exists(shm_b)
        keys = block_keys(list(range(8 * 6)), 8, FP)
        x = torch.randn(6, *SHAPE)
        with StoreClient(addr_a) as a:
            assert a.transport == "shm"
            assert a.put(keys[:4], x[:4], FP) == 4  # written by this process straight into a's slab
        cb.send(("pull", addr_a, keys))
        assert cb.recv() == (4, 4)  # b pulled the 4 held blocks from a over gRPC and keeps them
        for transport in ("grpc", "shm"):
            with StoreClient(addr_b, transport=transport) as b:
                out = torch.zeros(6, *SHAPE)
                assert b.get_into(keys, out) == 4 and torch.equal(out[:4], x[:4])
                assert b.lookup(keys).tiers == ["dram"] * 4
        for conn in (ca, cb):
            conn.send(("stop",))
            assert conn.recv() == "stopped"
        assert not os.path.exists(shm_a) and not os.path.exists(
            shm_b
        )  # the owners unlinked their slabs
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def test_killed_readers_lease_expires():
    node = StoreNode(
        StoreConfig(node_id="l", dram_bytes=2 * BLOCK, model_fingerprint=FP, lease_s=1.0)
    )
    reader = None
    try:
        address = node.start()
        keys = block_keys(list(range(16)), 8, FP)
        with StoreClient(address) as c:
            c.put(keys, torch.randn(2, *SHAPE), FP)
            reader, conn = _start(_lease_and_hang, address, keys)
            lease_id, n = conn.recv()
            assert lease_id and n == 2 and c.stats().leases == 1
            os.kill(reader.pid, signal.SIGKILL)
            reader.join(timeout=10)
            other = block_keys(list(range(100, 116)), 8, FP)
            with pytest.raises(StoreFull):  # the dead reader's lease still pins both blocks
                c.put(other[:1], torch.randn(1, *SHAPE), FP)
            deadline = time.monotonic() + 10
            while c.stats().leases and time.monotonic() < deadline:
                time.sleep(0.1)
            assert c.stats().leases == 0
            assert c.put(other, torch.randn(2, *SHAPE), FP) == 2
    finally:
        if reader is not None and reader.is_alive():
            reader.kill()
        node.stop()


_BARE_NODE = """
import json, sys
from kvstore.node import StoreConfig, StoreNode
cfg = StoreConfig(node_id="bare", dram_bytes=int(sys.argv[1]), model_fingerprint=sys.argv[2])
node = StoreNode(cfg)
print(node.start(), flush=True)
sys.stdin.readline()  # the test's puts and gets run meanwhile
print(json.dumps(sorted(m for m in ("torch", "model") if m in sys.modules)), flush=True)
node.stop()
"""


@pytest.mark.parametrize("transport", ["grpc", "tcp", "shm"])
def test_a_store_node_serves_blocks_without_importing_torch(transport):
    # A node stores and checks bytes and holds no tensors: torch would cost its process ~170 MB.
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-c", _BARE_NODE, str(16 * BLOCK), FP],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        address = proc.stdout.readline().strip()
        assert address, "the node did not start"
        keys = block_keys(list(range(8 * 4)), 8, FP)
        blocks = torch.randn(len(keys), *SHAPE)
        with StoreClient(address, transport=transport) as c:
            assert c.put(keys, blocks, FP) == len(keys)
            out = torch.empty_like(blocks)
            assert c.get_into(keys, out) == len(keys)
        assert torch.equal(out, blocks)
        loaded = proc.communicate("\n", timeout=60)[0].strip()
        assert loaded == "[]", f"the store node imported {loaded}"
    finally:
        proc.kill()
        proc.wait()
