"""BlockStore: one node's blocks across its dram slab and ssd tiers, with leaf-first LRU eviction,
demotion (dram -> ssd), promotion (ssd -> dram on a hit) and leases. No networking: the node's
gRPC service calls it. One lock guards all state; bulk copies into leased ranges happen outside
it."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from kvstore.block_header import (
    BlockCorrupt,
    BlockHeader,
    check_bytes,
    check_headers,
    read_header,
)
from kvstore.node.ssd import SsdTier
from kvstore.slab import ShmSlab, SlabAllocator
from kvstore.types import BlockRef, StoreFull, StoreStats, TierStats

log = logging.getLogger(__name__)

DRAM, SSD = "dram", "ssd"
_PENDING = "pending"
# Index changes queued at most (a few MB); past that the queue is dropped and the whole listing
# is published instead.
MAX_EVENTS = 1 << 16


class _Entry:
    __slots__ = ("key", "parent", "tier", "size", "offset", "leases", "doomed")

    def __init__(self, key: bytes, parent: bytes | None, tier: str, size: int, offset: int = -1):
        self.key, self.parent, self.tier, self.size, self.offset = key, parent, tier, size, offset
        self.leases = 0
        self.doomed = False  # reported corrupt while leased: dropped when the last lease goes


class _Lease:
    __slots__ = ("id", "write", "entries", "expires")

    def __init__(self, lease_id: int, write: bool, expires: float):
        self.id, self.write, self.expires = lease_id, write, expires
        self.entries: list[_Entry] = []


class BlockStore:
    """The tiers of one node. `events` collects (key, tier or None) changes for the global index,
    at most `max_events` of them: past that they are dropped and `take_events` says so (the index
    publisher then sends the whole listing instead)."""

    def __init__(
        self,
        node_id: str,
        slab: ShmSlab | None,
        ssd: SsdTier | None,
        fingerprint: str = "",
        clock: Callable[[], float] = time.monotonic,
        max_events: int = MAX_EVENTS,
    ):
        self.node_id, self.slab, self.ssd, self.fingerprint, self.clock = (
            node_id,
            slab,
            ssd,
            fingerprint,
            clock,
        )
        self.alloc = SlabAllocator(slab.size if slab else 0)
        self.ssd_capacity = ssd.capacity if ssd else 0
        self.ssd_used = 0
        self.dram_used = 0
        self._lock = threading.RLock()
        self._entries: dict[bytes, _Entry] = {}
        self._order = {DRAM: OrderedDict(), SSD: OrderedDict()}  # oldest first
        self._children: dict[bytes, int] = {}  # parent key -> cached children
        self._leases: dict[int, _Lease] = {}
        self._lease_ids = itertools.count(1)
        self.events: list[tuple[bytes, str | None]] = []
        self.max_events = max_events
        self._events_lost = False  # changes were dropped since the last take_events/listing
        self._hits = {DRAM: 0, SSD: 0}
        self._evictions = {DRAM: 0, SSD: 0}
        self.misses = self.promotions = self.demotions = 0
        self.corrupt = {DRAM: 0, SSD: 0}  # blocks found corrupt (and dropped), by tier
        if ssd:
            self._load_ssd()

    # ------------------------------------------------------------------ queries

    def lookup(self, keys: list[bytes]) -> list[str]:
        """Tiers of the leading held keys (no lease, no LRU touch)."""
        return [tier for tier, _ in self.lookup_sizes(keys)]

    def lookup_sizes(self, keys: list[bytes]) -> list[tuple[str, int]]:
        """(tier, encoded bytes) of the leading held keys (no lease, no LRU touch)."""
        with self._lock:
            found = []
            for key in keys:
                e = self._entries.get(key)
                if e is None or e.tier == _PENDING:
                    break
                found.append((e.tier, e.size))
            return found

    def count_held(self, keys: list[bytes]) -> int:
        with self._lock:
            return sum(
                1 for k in keys if (e := self._entries.get(k)) is not None and e.tier != _PENDING
            )

    def holds(self) -> dict[bytes, str]:
        with self._lock:
            return {k: e.tier for k, e in self._entries.items() if e.tier != _PENDING}

    def drain_events(self) -> list[tuple[bytes, str | None]]:
        return self.take_events()[0]

    def take_events(self) -> tuple[list[tuple[bytes, str | None]], bool]:
        """The changes since the last call, oldest first, and whether some were dropped (the
        queue overflowed): then only a full `listing` brings the index back in line."""
        with self._lock:
            ev, lost = self.events, self._events_lost
            self.events, self._events_lost = [], False
            return ev, lost

    def listing(self) -> dict[bytes, str]:
        """Every held block's tier; the changes queued so far are dropped, since this
        supersedes them (taken under the lock, so no change falls between the two)."""
        with self._lock:
            self.events, self._events_lost = [], False
            return self.holds()

    def stats(self) -> StoreStats:
        with self._lock:
            count = {DRAM: len(self._order[DRAM]), SSD: len(self._order[SSD])}
            tiers = [
                TierStats(
                    DRAM,
                    self.dram_used,
                    self.alloc.size,
                    count[DRAM],
                    self._hits[DRAM],
                    self._evictions[DRAM],
                )
            ]
            if self.ssd:
                tiers.append(
                    TierStats(
                        SSD,
                        self.ssd_used,
                        self.ssd_capacity,
                        count[SSD],
                        self._hits[SSD],
                        self._evictions[SSD],
                    )
                )
            pending = sum(1 for e in self._entries.values() if e.tier == _PENDING)
            return StoreStats(
                self.node_id,
                tiers,
                sum(self._hits.values()),
                self.misses,
                self.promotions,
                self.demotions,
                len(self._leases),
                pending,
            )

    # ------------------------------------------------------------------ reads

    def acquire(self, keys: list[bytes], ttl: float) -> tuple[int, list[BlockRef]]:
        """Lease the leading held keys for reading (promoting ssd hits); (lease id, their refs).
        Ssd blocks are read and checked outside the store's lock: the lease pins them meanwhile
        (nothing demotes, evicts or drops a leased block), so no other call waits on the disk or
        on a checksum."""
        with self._lock:
            lease = _Lease(next(self._lease_ids), False, self.clock() + ttl)
            for key in keys:
                e = self._entries.get(key)
                if e is None or e.tier == _PENDING or e.doomed:
                    break
                e.leases += 1
                lease.entries.append(e)
            on_ssd = [e for e in lease.entries if e.tier == SSD]
        read = {id(e): self._read_ssd(e) for e in on_ssd}
        with self._lock:
            refs: list[BlockRef] = []
            for i, e in enumerate(lease.entries):
                if self._entries.get(e.key) is not e:  # dropped to make room for an earlier one
                    self._unpin(lease.entries[i:])
                    del lease.entries[i:]
                    break
                found, data = e.tier, None
                if e.tier == SSD:  # (one another reader promoted meanwhile is in dram now)
                    # read outside the lock above, unless an earlier promotion demoted it
                    data, why = read[id(e)] if id(e) in read else self._read_ssd(e)
                    if data is None:  # gone or corrupt: a miss from here on
                        if why:
                            self._corrupt_found(e, why)
                        e.doomed = True  # dropped now, or when another reader lets it go
                        self._unpin(lease.entries[i:])
                        del lease.entries[i:]
                        break
                    # As in a walk that leases one block at a time: the call's later blocks may
                    # make room for this one (a prefix's head stays in dram before its tail).
                    later = lease.entries[i + 1 :]
                    for x in later:
                        x.leases -= 1
                    promoted = self._promote(e, data)
                    for x in later:
                        x.leases += 1
                    if promoted:
                        data = None
                self._hits[found] += 1
                self._touch(e)
                refs.append(BlockRef(e.key, found, e.offset if data is None else -1, e.size, data))
            self.misses += len(keys) - len(refs)
            if lease.entries:
                self._leases[lease.id] = lease
                return lease.id, refs
            return 0, refs

    def read(self, ref: BlockRef) -> memoryview | bytes:
        """The bytes of a leased block (a view into the slab, or the ssd copy)."""
        if ref.data is not None:
            return ref.data
        return self.slab.view[ref.offset : ref.offset + ref.length]

    def read_headed(self, refs: list[BlockRef]) -> list[tuple[memoryview | bytes, BlockHeader]]:
        """The bytes and parsed header of each leased block in turn, up to the first whose header
        does not parse (released as corrupt: it is dropped, and the prefix ends before it)."""
        out = []
        for ref in refs:
            view = self.read(ref)
            try:
                out.append((view, read_header(view)))
            except BlockCorrupt:
                self.release(0, [ref.key])
                break
        return out

    # ------------------------------------------------------------------ writes

    def reserve(
        self, keys: list[bytes], sizes: list[int], parents: list[bytes | None], ttl: float
    ) -> tuple[int, list[tuple[int, int]]]:
        """Reserve slab ranges for the keys not held yet; (lease id, [(index in keys, offset)]).
        Raises StoreFull (nothing reserved) when they cannot fit even after evicting all it may."""
        with self._lock:
            todo = [i for i, k in enumerate(keys) if k not in self._entries]
            seen: set[bytes] = set()
            todo = [i for i in todo if not (keys[i] in seen or seen.add(keys[i]))]
            rounded = [SlabAllocator.rounded(sizes[i]) for i in todo]
            need, free = sum(rounded), self.alloc.size - self.alloc.used
            if need > free:  # (the walk over every held block only when free space is short)
                evictable = sum(
                    SlabAllocator.rounded(e.size)
                    for e in self._order[DRAM].values()
                    if not e.leases
                )
                if need > free + evictable:
                    raise StoreFull(
                        f"put of {len(todo)} blocks needs {need} bytes; dram tier has "
                        f"{free} free and {evictable} evictable of {self.alloc.size}"
                    )
            if not todo:
                return 0, []
            lease = _Lease(next(self._lease_ids), True, self.clock() + ttl)
            out = []
            # One range for the whole batch where one is free (each block is freed on its own
            # later: the allocator frees any part of a range); else block by block, evicting.
            run = self.alloc.alloc(need) if len(todo) > 1 else None
            starts = itertools.accumulate(rounded[:-1], initial=run) if run is not None else None
            for i in todo:
                off = next(starts) if starts is not None else self._alloc_dram(sizes[i])
                if off is None:  # fragmentation: undo this reservation
                    for e in lease.entries:
                        self.alloc.free(e.offset, e.size)
                        del self._entries[e.key]
                    raise StoreFull(f"no contiguous {sizes[i]} bytes in the dram tier")
                e = _Entry(keys[i], parents[i], _PENDING, sizes[i], off)
                e.leases = 1
                self._entries[e.key] = e
                lease.entries.append(e)
                out.append((i, off))
            self._leases[lease.id] = lease
            return lease.id, out

    def pending(self, lease_id: int) -> list[tuple[bytes, int, int]]:
        """(key, offset, size) of a write lease's reserved blocks; KeyError if it is not a live
        write lease."""
        with self._lock:
            lease = self._leases[lease_id]
            if not lease.write:
                raise KeyError(lease_id)
            return [(e.key, e.offset, e.size) for e in lease.entries]

    def commit(self, lease_id: int, check: bool = True, payloads: bool = True) -> int:
        """Make a write lease's blocks visible after checking each (BlockCorrupt: nothing is
        stored). payloads=False checks headers, lengths and fingerprints but not the layers'
        checksums: for a writer that took them from the stored bytes as it copied them (every
        reader checks them again)."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None or not lease.write:
                raise KeyError(f"no open write lease {lease_id} (expired or never granted)")
        if check:  # hashing outside the lock: these ranges belong to the lease alone
            try:
                if payloads:  # last written first: the writer's latest may still be in cache
                    for e in reversed(lease.entries):
                        view = self.slab.view[e.offset : e.offset + e.size]
                        check_bytes(view, self.fingerprint, payloads)
                else:
                    check_headers(
                        self.slab.array,
                        [e.offset for e in lease.entries],
                        [e.size for e in lease.entries],
                        self.fingerprint,
                    )
            except BlockCorrupt:
                self.release(lease_id)
                raise
        with self._lock:
            if self._leases.pop(lease_id, None) is None:
                raise KeyError(f"write lease {lease_id} expired before its commit")
            for e in lease.entries:
                e.tier, e.leases = DRAM, 0
                self.dram_used += e.size
                self._order[DRAM][e.key] = e
                if e.parent is not None:
                    self._children[e.parent] = self._children.get(e.parent, 0) + 1
                self._event(e.key, DRAM)
            return len(lease.entries)

    def put(
        self, keys: list[bytes], blocks: list[bytes], parents: list[bytes | None], ttl: float = 60.0
    ) -> int:
        """Store encoded blocks in one step (reserve, copy, commit); the count newly stored."""
        lease_id, slots = self.reserve(keys, [len(b) for b in blocks], parents, ttl)
        for i, off in slots:
            self.slab.view[off : off + len(blocks[i])] = blocks[i]
        return self.commit(lease_id) if slots else 0

    # ------------------------------------------------------------------ leases

    def renew(self, lease_id: int, ttl: float) -> bool:
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None:
                return False
            lease.expires = self.clock() + ttl
            return True

    def release(self, lease_id: int, corrupt: list[bytes] = ()) -> bool:
        """End a lease: a read lease unpins its blocks (dropping those reported corrupt), a write
        lease is aborted (its reserved ranges freed). False if it was not held."""
        with self._lock:
            bad = set(corrupt)
            for key in bad:
                e = self._entries.get(key)
                if e is not None and e.tier != _PENDING:
                    self._corrupt_found(e, "a reader's checksum")
            lease = self._leases.pop(lease_id, None)
            if lease is None:
                for (
                    key
                ) in bad:  # reported outside a lease (the gRPC path's lease ended with its stream)
                    e = self._entries.get(key)
                    if e is not None and e.tier != _PENDING:
                        e.doomed = True
                        if not e.leases:
                            self._drop(e)
                return False
            if lease.write:
                for e in lease.entries:
                    self.alloc.free(e.offset, e.size)
                    del self._entries[e.key]
                return True
            for e in lease.entries:
                e.doomed |= e.key in bad
            self._unpin(lease.entries)
            return True

    def _unpin(self, entries: list[_Entry]) -> None:
        """A read lease lets go of `entries`; one doomed meanwhile (corrupt, cleared) and now
        held by no lease is dropped."""
        for e in entries:
            e.leases -= 1
            if e.leases == 0 and e.doomed and self._entries.get(e.key) is e:
                self._drop(e)

    def clear(self) -> tuple[int, int]:
        """Drop every block of every tier; a leased one goes when its last lease ends. (dropped,
        deferred)."""
        dropped = deferred = 0
        with self._lock:
            for tier in (DRAM, SSD):
                for e in list(self._order[tier].values()):
                    if e.leases:
                        e.doomed = True
                        deferred += 1
                    else:
                        self._drop(e)
                        dropped += 1
        return dropped, deferred

    def expire(self) -> int:
        """Release every lease past its expiry (its holder died or forgot); how many."""
        now = self.clock()
        with self._lock:
            dead = [i for i, lease in self._leases.items() if lease.expires < now]
            for i in dead:
                self.release(i)
            return len(dead)

    def persist(self) -> int:
        """Copy dram blocks into free ssd space (most recent first, evicting nothing), so that a
        graceful stop loses as little as it can; how many. Used when the node stops."""
        if not self.ssd:
            return 0
        n = 0
        with self._lock:
            for e in reversed(list(self._order[DRAM].values())):
                if self.ssd_used + e.size > self.ssd_capacity:
                    continue
                self.ssd.put(e.key, bytes(self.slab.view[e.offset : e.offset + e.size]), e.parent)
                self.ssd_used += e.size
                n += 1
            self.ssd.sync()
        return n

    # ------------------------------------------------------------------ internals (lock held)

    def _event(self, key: bytes, tier: str | None) -> None:
        """Queue a change for the index; a full queue is dropped whole (the listing replaces it),
        so a publisher that cannot keep up costs bounded memory."""
        if len(self.events) >= self.max_events:
            self.events = []
            self._events_lost = True
        self.events.append((key, tier))

    def _touch(self, e: _Entry) -> None:
        self._order[e.tier].move_to_end(e.key)

    def _victim(self, tier: str, leaves_only: bool = False) -> _Entry | None:
        """Least recently used unleased block of the tier, leaves (no cached child) first."""
        fallback = None
        for key, e in self._order[tier].items():
            if e.leases:
                continue
            if not self._children.get(key):
                return e
            if fallback is None and not leaves_only:
                fallback = e
        return fallback

    def _alloc_dram(self, size: int) -> int | None:
        while True:
            off = self.alloc.alloc(size)
            if off is not None:
                return off
            victim = self._victim(DRAM)
            if victim is None:
                return None
            self._evictions[DRAM] += 1
            self._demote(victim)

    def _make_room_ssd(self, size: int) -> bool:
        if size > self.ssd_capacity:
            return False
        while self.ssd_used + size > self.ssd_capacity:
            # Dropping a parent would orphan its children: when the ssd holds no evictable leaf,
            # the block being demoted is dropped instead.
            victim = self._victim(SSD, leaves_only=True)
            if victim is None:
                return False
            self._evictions[SSD] += 1
            self._drop(victim)
        return True

    def _demote(self, e: _Entry) -> None:
        if not (self.ssd and self._make_room_ssd(e.size)):
            self._drop(e)
            return
        data = bytes(self.slab.view[e.offset : e.offset + e.size])
        self.alloc.free(e.offset, e.size)
        self.dram_used -= e.size
        del self._order[DRAM][e.key]
        self.ssd.put(e.key, data, e.parent)
        self.ssd_used += e.size
        e.tier, e.offset = SSD, -1
        self._order[SSD][e.key] = e
        self.demotions += 1
        self._event(e.key, SSD)

    def _promotable(self, size: int) -> bool:
        """Whether dram can take `size` bytes, evicting unleased blocks if it must (counted only
        as far as needed: an ssd hit does not walk every dram entry)."""
        need = SlabAllocator.rounded(size) - (self.alloc.size - self.alloc.used)
        for x in self._order[DRAM].values():
            if need <= 0:
                break
            if not x.leases:
                need -= SlabAllocator.rounded(x.size)
        return need <= 0

    def _promote(self, e: _Entry, data: bytes) -> bool:
        """Move a leased ssd block into dram; False (it stays on ssd) when dram cannot take it."""
        if not self._promotable(e.size):
            return False
        # Leave ssd first, so that blocks demoted to make room can use its space.
        del self._order[SSD][e.key]
        self.ssd_used -= e.size
        self.ssd.delete(e.key)
        off = self._alloc_dram(e.size)
        if off is None:  # fragmentation: back to ssd
            self._order[SSD][e.key] = e
            self.ssd_used += e.size
            self.ssd.put(e.key, data, e.parent)
            return False
        self.slab.view[off : off + e.size] = data
        e.tier, e.offset = DRAM, off
        self.dram_used += e.size
        self._order[DRAM][e.key] = e
        self.promotions += 1
        self._event(e.key, DRAM)
        return True

    def _read_ssd(self, e: _Entry) -> tuple[bytes | None, str]:
        """(its checked bytes, "") or (None, why it is corrupt; "" when it is simply gone)."""
        data = self.ssd.get(e.key)
        if data is None:
            return None, ""
        if len(data) != e.size:
            return None, f"{len(data)} bytes on ssd, {e.size} recorded"
        try:
            check_bytes(data)
        except BlockCorrupt as exc:
            return None, str(exc)
        return data, ""

    def _corrupt_found(self, e: _Entry, why: str) -> None:
        """Count and log a block that failed its checks (it is dropped: a miss, recomputed)."""
        self.corrupt[e.tier] += 1
        log.warning(
            "%s: block %s in %s is corrupt (%s): dropped",
            self.node_id,
            e.key.hex()[:12],
            e.tier,
            why,
        )

    def _drop(self, e: _Entry) -> None:
        """Remove a block from this node entirely."""
        del self._order[e.tier][e.key]
        if e.tier == DRAM:
            self.alloc.free(e.offset, e.size)
            self.dram_used -= e.size
        else:
            self.ssd_used -= e.size
            self.ssd.delete(e.key)
        del self._entries[e.key]
        if e.parent is not None:
            n = self._children.get(e.parent, 0) - 1
            if n > 0:
                self._children[e.parent] = n
            else:
                self._children.pop(e.parent, None)
        self._event(e.key, None)

    def _load_ssd(self) -> None:
        """Find the blocks a previous run left on ssd (oldest first is unknown: scan order)."""
        for key, size, parent in self.ssd.scan():
            if self.ssd_used + size > self.ssd_capacity:  # capacity shrank since: drop the rest
                self.ssd.delete(key)
                continue
            e = _Entry(key, parent, SSD, size)
            self._entries[key] = e
            self._order[SSD][key] = e
            self.ssd_used += size
            if parent is not None:
                self._children[parent] = self._children.get(parent, 0) + 1
            self._event(key, SSD)
