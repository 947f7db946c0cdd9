"""Where a store node's blocks lie, a dram slab range or the ssd tier, and the moves between them:
demotion (dram -> ssd, to make room), promotion (ssd -> dram, on a hit) and drops, each counted
and queued for the global index. Leases and the read and write paths are the store's
(kvstore/node/store.py); every call here is made with the store's lock held."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from kvstore.block_header import BlockCorrupt, check_bytes
from kvstore.node.changes import ChangeQueue
from kvstore.node.entry import DRAM, PENDING, SSD, Entry
from kvstore.node.eviction import LruOrder
from kvstore.node.ssd import SsdTier
from kvstore.slab import ShmSlab, SlabAllocator
from kvstore.types import StoreStats, TierStats

log = logging.getLogger(__name__)


def _per_tier() -> dict[str, int]:
    return {DRAM: 0, SSD: 0}


@dataclass(slots=True)
class Counters:
    """What a node's blocks went through since it started (read at scrape time)."""

    hits: dict[str, int] = field(default_factory=_per_tier)  # blocks read, by the tier found in
    evictions: dict[str, int] = field(default_factory=_per_tier)  # left a tier for lack of room
    corrupt: dict[str, int] = field(default_factory=_per_tier)  # found corrupt and dropped
    misses: int = 0  # blocks asked for past the held prefix
    promotions: int = 0  # ssd -> dram moves
    demotions: int = 0  # dram -> ssd moves


class Tiers:
    """The blocks of one node by key, across its slab (`slab`, None without a dram tier) and its
    ssd tier (`ssd`, None without one). Changes go to `changes` for the index."""

    def __init__(
        self, node_id: str, slab: ShmSlab | None, ssd: SsdTier | None, changes: ChangeQueue
    ):
        self.node_id, self.slab, self.ssd, self.changes = node_id, slab, ssd, changes
        self.alloc = SlabAllocator(slab.size if slab else 0)
        self.ssd_capacity = ssd.capacity if ssd else 0
        self.ssd_used = 0
        self.dram_used = 0
        self.entries: dict[bytes, Entry] = {}  # every block, pending ones included
        self.lru = LruOrder()
        self.counts = Counters()
        if ssd:
            self._load_ssd()

    # A node without a dram tier has an empty allocator, so it reserves, holds and promotes
    # nothing into a slab; one without an ssd tier demotes nothing and holds nothing on ssd.

    @property
    def view(self) -> memoryview:
        """The slab's bytes."""
        if self.slab is None:
            raise RuntimeError(f"store node {self.node_id} has no dram tier")
        return self.slab.view

    @property
    def array(self) -> np.ndarray:
        """The slab's bytes as a flat uint8 array."""
        if self.slab is None:
            raise RuntimeError(f"store node {self.node_id} has no dram tier")
        return self.slab.array

    @property
    def disk(self) -> SsdTier:
        if self.ssd is None:
            raise RuntimeError(f"store node {self.node_id} has no ssd tier")
        return self.ssd

    def held(self, key: bytes) -> Entry | None:
        """A held block's record; None when the key is not held (or only reserved)."""
        e = self.entries.get(key)
        return None if e is None or e.tier == PENDING else e

    # ------------------------------------------------------------------ reservations

    def reserve(self, key: bytes, parent: bytes | None, size: int, offset: int) -> Entry:
        """A writer's pending block at a slab range it was given; pinned by its write lease."""
        e = Entry(key, parent, PENDING, size, offset, leases=1)
        self.entries[key] = e
        return e

    def unreserve(self, entries: list[Entry]) -> None:
        """Abort pending blocks: their ranges are freed, their keys forgotten."""
        for e in entries:
            self.alloc.free(e.offset, e.size)
            del self.entries[e.key]

    def commit(self, e: Entry) -> None:
        """A pending block, its bytes checked, becomes a held dram block."""
        e.tier, e.leases = DRAM, 0
        self.dram_used += e.size
        self.lru.add(e)
        self.lru.add_child(e.parent)
        self.changes.push(e.key, DRAM)

    # ------------------------------------------------------------------ moves

    def alloc_dram(self, size: int) -> int | None:
        """A slab range of `size` bytes, demoting (or dropping) unleased blocks as it must."""
        while True:
            off = self.alloc.alloc(size)
            if off is not None:
                return off
            victim = self.lru.victim(DRAM)
            if victim is None:
                return None
            self.counts.evictions[DRAM] += 1
            self._demote(victim)

    def _make_room_ssd(self, size: int) -> bool:
        if size > self.ssd_capacity:
            return False
        while self.ssd_used + size > self.ssd_capacity:
            # Dropping a parent would orphan its children: when the ssd holds no evictable leaf,
            # the block being demoted is dropped instead.
            victim = self.lru.victim(SSD, leaves_only=True)
            if victim is None:
                return False
            self.counts.evictions[SSD] += 1
            self.drop(victim)
        return True

    def _demote(self, e: Entry) -> None:
        if not (self.ssd and self._make_room_ssd(e.size)):
            self.drop(e)
            return
        data = bytes(self.view[e.offset : e.offset + e.size])
        self.alloc.free(e.offset, e.size)
        self.dram_used -= e.size
        self.lru.remove(e)
        self.ssd.put(e.key, data, e.parent)
        self.ssd_used += e.size
        e.tier, e.offset = SSD, -1
        self.lru.add(e)
        self.counts.demotions += 1
        self.changes.push(e.key, SSD)

    def promote(self, e: Entry, data: bytes) -> bool:
        """Move a leased ssd block into dram; False (it stays on ssd) when dram cannot take it."""
        need = SlabAllocator.rounded(e.size) - (self.alloc.size - self.alloc.used)
        if not self.lru.dram_can_free(need):
            return False
        # Leave ssd first, so that blocks demoted to make room can use its space.
        self.lru.remove(e)
        self.ssd_used -= e.size
        self.disk.delete(e.key)
        off = self.alloc_dram(e.size)
        if off is None:  # fragmentation: back to ssd
            self.lru.add(e)
            self.ssd_used += e.size
            self.disk.put(e.key, data, e.parent)
            return False
        self.view[off : off + e.size] = data
        e.tier, e.offset = DRAM, off
        self.dram_used += e.size
        self.lru.add(e)
        self.counts.promotions += 1
        self.changes.push(e.key, DRAM)
        return True

    def read_ssd(self, e: Entry) -> tuple[bytes | None, str]:
        """(its checked bytes, "") or (None, why it is corrupt; "" when it is simply gone)."""
        data = self.disk.get(e.key)
        if data is None:
            return None, ""
        if len(data) != e.size:
            return None, f"{len(data)} bytes on ssd, {e.size} recorded"
        try:
            check_bytes(data)
        except BlockCorrupt as exc:
            return None, str(exc)
        return data, ""

    def corrupt_found(self, e: Entry, why: str) -> None:
        """Count and log a block that failed its checks (it is dropped: a miss, recomputed)."""
        self.counts.corrupt[e.tier] += 1
        key = e.key.hex()[:12]
        log.warning("%s: block %s in %s is corrupt (%s): dropped", self.node_id, key, e.tier, why)

    def drop(self, e: Entry) -> None:
        """Remove a block from this node entirely."""
        self.lru.remove(e)
        if e.tier == DRAM:
            self.alloc.free(e.offset, e.size)
            self.dram_used -= e.size
        else:
            self.ssd_used -= e.size
            self.disk.delete(e.key)
        del self.entries[e.key]
        self.lru.remove_child(e.parent)
        self.changes.push(e.key, None)

    def doom(self, e: Entry) -> None:
        """Drop `e` as soon as no lease holds it: now, if none does."""
        e.doomed = True
        if not e.leases:
            self.drop(e)

    def unpin(self, entries: list[Entry]) -> None:
        """A read lease lets go of `entries`; one doomed meanwhile (corrupt, cleared) and now
        held by no lease is dropped."""
        for e in entries:
            e.leases -= 1
            if e.leases == 0 and e.doomed and self.entries.get(e.key) is e:
                self.drop(e)

    def clear(self) -> tuple[int, int]:
        """Drop every held block; a leased one is doomed, to go when its last lease ends.
        (dropped, deferred)."""
        dropped = deferred = 0
        for tier in (DRAM, SSD):
            for e in list(self.lru.blocks(tier)):
                if e.leases:
                    e.doomed = True
                    deferred += 1
                else:
                    self.drop(e)
                    dropped += 1
        return dropped, deferred

    def persist(self) -> int:
        """Copy dram blocks into free ssd space (most recent first, evicting nothing); how many."""
        if not self.ssd:
            return 0
        n = 0
        for e in reversed(list(self.lru.blocks(DRAM))):
            if self.ssd_used + e.size > self.ssd_capacity:
                continue
            self.ssd.put(e.key, bytes(self.view[e.offset : e.offset + e.size]), e.parent)
            self.ssd_used += e.size
            n += 1
        self.ssd.sync()
        return n

    # ------------------------------------------------------------------ state

    def stats(self, leases: int) -> StoreStats:
        """Each tier's use and the counters (dram first; ssd only where the node has one), with
        the number of `leases` the store holds."""
        c = self.counts
        tiers = [
            TierStats(
                DRAM,
                self.dram_used,
                self.alloc.size,
                self.lru.count(DRAM),
                c.hits[DRAM],
                c.evictions[DRAM],
            )
        ]
        if self.ssd:
            tiers.append(
                TierStats(
                    SSD,
                    self.ssd_used,
                    self.ssd_capacity,
                    self.lru.count(SSD),
                    c.hits[SSD],
                    c.evictions[SSD],
                )
            )
        pending = sum(1 for e in self.entries.values() if e.tier == PENDING)
        hits = sum(c.hits.values())
        return StoreStats(
            self.node_id, tiers, hits, c.misses, c.promotions, c.demotions, leases, pending
        )

    def _load_ssd(self) -> None:
        """Find the blocks a previous run left on ssd (oldest first is unknown: scan order)."""
        for key, size, parent in self.disk.scan():
            if self.ssd_used + size > self.ssd_capacity:  # capacity shrank since: drop the rest
                self.disk.delete(key)
                continue
            e = Entry(key, parent, SSD, size)
            self.entries[key] = e
            self.lru.add(e)
            self.ssd_used += size
            self.lru.add_child(parent)
            self.changes.push(key, SSD)
