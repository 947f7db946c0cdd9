"""The store's tiers against a plain model of the policy: random puts, gets, leases and releases
never exceed a capacity, never lose or alter a leased block, and evict in leaf-first LRU order."""

from __future__ import annotations

import os
import tempfile

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstore.client import encode_block
from kvstore.node.ssd import SsdTier
from kvstore.node.store import BlockStore
from kvstore.slab import ShmSlab
from kvstore.types import StoreFull

DRAM_BLOCKS, SSD_BLOCKS = 4, 3
CHAINS, LENGTH = 3, 4


def key_of(chain: int, pos: int) -> bytes:
    return bytes([chain, pos]) * 8


_BLOCKS = {}


def block_of(key: bytes) -> bytes:
    if key not in _BLOCKS:
        x = torch.full((1, 2, 1, 1, 8), float(key[0] * 16 + key[1]))
        _BLOCKS[key] = encode_block(x, "fp")
    return _BLOCKS[key]


BLOCK_SIZE = len(block_of(key_of(0, 0)))


class Model:
    """The eviction policy written as plainly as possible, in blocks rather than bytes."""

    def __init__(self):
        self.tier: dict[bytes, str] = {}
        self.parent: dict[bytes, bytes | None] = {}
        self.order = {"dram": [], "ssd": []}  # oldest first
        self.leases: dict[bytes, int] = {}

    def children(self, k):
        return sum(1 for p in self.parent.values() if p == k)

    def victim(self, t):
        free = [k for k in self.order[t] if not self.leases.get(k)]
        leaves = [k for k in free if self.children(k) == 0]
        if t == "ssd":  # ssd drops leaves only (else the demoted block is dropped instead)
            return (leaves or [None])[0]
        return (leaves or free or [None])[0]

    def drop(self, k):
        self.order[self.tier.pop(k)].remove(k)
        del self.parent[k]

    def room_ssd(self):
        while len(self.order["ssd"]) >= SSD_BLOCKS:
            v = self.victim("ssd")
            if v is None:
                return False
            self.drop(v)
        return True

    def demote(self, k):
        if self.room_ssd():
            self.order["dram"].remove(k)
            self.order["ssd"].append(k)
            self.tier[k] = "ssd"
        else:
            self.drop(k)

    def room_dram(self, extra=0):
        while len(self.order["dram"]) + extra >= DRAM_BLOCKS:
            v = self.victim("dram")
            if v is None:
                return False
            self.demote(v)
        return True

    def evictable_dram(self):
        return sum(1 for k in self.order["dram"] if not self.leases.get(k))

    def put(self, keys, parents):
        todo = []
        for k, p in zip(keys, parents):
            if k not in self.tier and k not in [t for t, _ in todo]:
                todo.append((k, p))
        if len(todo) > DRAM_BLOCKS - len(self.order["dram"]) + self.evictable_dram():
            raise StoreFull
        for i in range(len(todo)):
            assert self.room_dram(extra=i)
        for k, p in todo:
            self.tier[k] = "dram"
            self.order["dram"].append(k)
            self.parent[k] = p

    def acquire(self, keys):
        tiers = []
        for k in keys:
            if k not in self.tier:
                break
            self.leases[k] = self.leases.get(k, 0) + 1
            if (
                self.tier[k] == "ssd"
                and DRAM_BLOCKS - len(self.order["dram"]) + self.evictable_dram() >= 1
            ):
                self.order["ssd"].remove(k)
                del self.tier[k]
                assert self.room_dram()
                self.tier[k] = "dram"
                self.order["dram"].append(k)
                tiers.append("ssd")  # where it was found
            else:
                t = self.tier[k]
                self.order[t].remove(k)
                self.order[t].append(k)
                tiers.append(t)
        return tiers

    def release(self, keys):
        for k in keys:
            self.leases[k] -= 1

    def lookup(self, keys):
        out = []
        for k in keys:
            if k not in self.tier:
                break
            out.append(self.tier[k])
        return out


class StoreMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.dir = tempfile.TemporaryDirectory()
        self.slab = ShmSlab(
            os.path.join("/dev/shm", f"halfmoon-test-{os.getpid()}-{id(self)}"),
            DRAM_BLOCKS * BLOCK_SIZE,
            create=True,
        )
        self.ssd = SsdTier(self.dir.name, SSD_BLOCKS * BLOCK_SIZE)
        self.store = BlockStore("t", self.slab, self.ssd)
        self.model = Model()
        self.held: list[tuple[int, list[bytes]]] = []

    def teardown(self):
        self.ssd.close()
        self.slab.close()
        self.dir.cleanup()

    @rule(
        chain=st.integers(0, CHAINS - 1), start=st.integers(0, LENGTH - 1), n=st.integers(1, LENGTH)
    )
    def put(self, chain, start, n):
        keys = [key_of(chain, p) for p in range(start, min(LENGTH, start + n))]
        parents = [key_of(chain, p - 1) if p else None for p in range(start, start + len(keys))]
        try:
            self.model.put(keys, parents)
            expect_full = False
        except StoreFull:
            expect_full = True
        before = self.store.stats()
        try:
            self.store.put(keys, [block_of(k) for k in keys], parents)
            assert not expect_full, "store took a put the model refused"
        except StoreFull:
            assert expect_full, "store refused a put the model took"
            after = self.store.stats()
            assert after.tiers == before.tiers and after.pending_blocks == 0

    @rule(chain=st.integers(0, CHAINS - 1), n=st.integers(1, LENGTH), keep=st.booleans())
    def get(self, chain, n, keep):
        if keep and len(self.held) >= 2:
            keep = False
        keys = [key_of(chain, p) for p in range(n)]
        want = self.model.acquire(keys)
        lease_id, refs = self.store.acquire(keys, ttl=1e9)
        assert [r.tier for r in refs] == want
        for r in refs:
            assert bytes(self.store.read(r)) == block_of(r.key)
        got = [r.key for r in refs]
        if keep and got:
            self.held.append((lease_id, got))
        else:
            if lease_id:
                self.store.release(lease_id)
            self.model.release(got)

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 1))
    def release(self, i):
        lease_id, keys = self.held.pop(i % len(self.held))
        assert self.store.release(lease_id)
        self.model.release(keys)

    @invariant()
    def same_contents(self):
        for c in range(CHAINS):
            keys = [key_of(c, p) for p in range(LENGTH)]
            assert self.store.lookup(keys) == self.model.lookup(keys)
        held = self.store.holds()
        assert held == self.model.tier

    @invariant()
    def within_capacity(self):
        s = self.store.stats()
        dram, ssd = s.tiers
        assert dram.used_bytes <= dram.capacity_bytes and ssd.used_bytes <= ssd.capacity_bytes
        assert self.store.alloc.used <= self.slab.size

    @invariant()
    def leased_blocks_stay(self):
        for _, keys in self.held:
            assert all(k in self.model.tier for k in keys)
            for k in keys:
                assert k in self.store.holds()


StoreMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestStoreAgainstModel = StoreMachine.TestCase
