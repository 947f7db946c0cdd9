"""BlockStore: one node's blocks across its dram slab and ssd tiers, with leaf-first LRU eviction,
demotion (dram -> ssd), promotion (ssd -> dram on a hit) and leases. No networking: the node's
gRPC service calls it. One lock guards all state; bulk copies into leased ranges happen outside
it.

This is the façade: the lock and the read and write paths. Its parts, each with one job and none
thread-safe on its own: tiers.py (where each block lies, the moves between tiers), eviction.py
(the leaf-first LRU order), leases.py (the lease table), changes.py (the global index's queue)."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterable

from kvstore.block_header import (
    BlockCorrupt,
    BlockHeader,
    check_bytes,
    check_headers,
    read_header,
)
from kvstore.node.changes import MAX_EVENTS, Change, ChangeQueue
from kvstore.node.entry import DRAM, PENDING, SSD
from kvstore.node.leases import LeaseTable
from kvstore.node.ssd import SsdTier
from kvstore.node.tiers import Tiers
from kvstore.slab import ShmSlab, SlabAllocator
from kvstore.types import BlockRef, StoreFull, StoreStats

__all__ = ["DRAM", "MAX_EVENTS", "SSD", "BlockStore"]


class BlockStore:
    """The tiers of one node. Its block changes, (key, tier or None), are queued for the global
    index, at most `max_events` of them: past that they are dropped and `take_events` says so
    (the index publisher then sends the whole listing instead)."""

    def __init__(
        self,
        node_id: str,
        slab: ShmSlab | None,
        ssd: SsdTier | None,
        fingerprint: str = "",
        clock: Callable[[], float] = time.monotonic,
        max_events: int = MAX_EVENTS,
    ):
        self.node_id, self.slab, self.ssd, self.fingerprint = node_id, slab, ssd, fingerprint
        self._lock = threading.RLock()
        self._changes = ChangeQueue(max_events)
        self._tiers = Tiers(node_id, slab, ssd, self._changes)  # (finds what ssd kept)
        self._leases = LeaseTable(clock)
        self.alloc = self._tiers.alloc  # the slab's allocator, one object for the store's life

    @property
    def corrupt(self) -> dict[str, int]:
        """Blocks found corrupt (and dropped), by tier."""
        return self._tiers.counts.corrupt

    # ------------------------------------------------------------------ queries

    def lookup(self, keys: list[bytes]) -> list[str]:
        """Tiers of the leading held keys (no lease, no LRU touch)."""
        return [tier for tier, _ in self.lookup_sizes(keys)]

    def lookup_sizes(self, keys: list[bytes]) -> list[tuple[str, int]]:
        """(tier, encoded bytes) of the leading held keys (no lease, no LRU touch)."""
        with self._lock:
            found = []
            for key in keys:
                if (e := self._tiers.held(key)) is None:
                    break
                found.append((e.tier, e.size))
            return found

    def count_held(self, keys: list[bytes]) -> int:
        with self._lock:
            return sum(1 for k in keys if self._tiers.held(k) is not None)

    def holds(self) -> dict[bytes, str]:
        with self._lock:
            return {k: e.tier for k, e in self._tiers.entries.items() if e.tier != PENDING}

    def drain_events(self) -> list[Change]:
        return self.take_events()[0]

    def take_events(self) -> tuple[list[Change], bool]:
        """The changes since the last call, oldest first, and whether some were dropped (the
        queue overflowed): then only a full `listing` brings the index back in line."""
        with self._lock:
            return self._changes.take()

    def listing(self) -> dict[bytes, str]:
        """Every held block's tier; the changes queued so far are dropped, since this
        supersedes them (taken under the lock, so no change falls between the two)."""
        with self._lock:
            self._changes.reset()
            return self.holds()

    def stats(self) -> StoreStats:
        with self._lock:
            return self._tiers.stats(len(self._leases))

    # ------------------------------------------------------------------ reads

    def acquire(self, keys: list[bytes], ttl: float) -> tuple[int, list[BlockRef]]:
        """Lease the leading held keys for reading (promoting ssd hits); (lease id, their refs).
        Ssd blocks are read and checked outside the store's lock: the lease pins them meanwhile
        (nothing demotes, evicts or drops a leased block), so no other call waits on the disk or
        on a checksum."""
        tiers = self._tiers
        with self._lock:
            lease = self._leases.new(False, ttl)
            for key in keys:
                e = tiers.entries.get(key)
                if e is None or e.tier == PENDING or e.doomed:
                    break
                e.leases += 1
                lease.entries.append(e)
            on_ssd = [e for e in lease.entries if e.tier == SSD]
        read = {id(e): tiers.read_ssd(e) for e in on_ssd}
        with self._lock:
            refs: list[BlockRef] = []
            for i, e in enumerate(lease.entries):
                if tiers.entries.get(e.key) is not e:  # dropped to make room for an earlier one
                    tiers.unpin(lease.entries[i:])
                    del lease.entries[i:]
                    break
                found, data = e.tier, None
                if e.tier == SSD:  # (one another reader promoted meanwhile is in dram now)
                    # read outside the lock above, unless an earlier promotion demoted it
                    data, why = read[id(e)] if id(e) in read else tiers.read_ssd(e)
                    if data is None:  # gone or corrupt: a miss from here on
                        if why:
                            tiers.corrupt_found(e, why)
                        e.doomed = True  # dropped now, or when another reader lets it go
                        tiers.unpin(lease.entries[i:])
                        del lease.entries[i:]
                        break
                    # As in a walk that leases one block at a time: the call's later blocks may
                    # make room for this one (a prefix's head stays in dram before its tail).
                    later = lease.entries[i + 1 :]
                    for x in later:
                        x.leases -= 1
                    promoted = tiers.promote(e, data)
                    for x in later:
                        x.leases += 1
                    if promoted:
                        data = None
                tiers.counts.hits[found] += 1
                tiers.lru.touch(e)
                refs.append(BlockRef(e.key, found, e.offset if data is None else -1, e.size, data))
            tiers.counts.misses += len(keys) - len(refs)
            if lease.entries:
                self._leases.hold(lease)
                return lease.id, refs
            return 0, refs

    def read(self, ref: BlockRef) -> memoryview | bytes:
        """The bytes of a leased block (a view into the slab, or the ssd copy)."""
        if ref.data is not None:
            return ref.data
        return self._tiers.view[ref.offset : ref.offset + ref.length]

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
        tiers, alloc = self._tiers, self._tiers.alloc
        with self._lock:
            todo: list[int] = []  # the first of each key not held yet
            seen: set[bytes] = set()
            for i, k in enumerate(keys):
                if k not in tiers.entries and k not in seen:
                    seen.add(k)
                    todo.append(i)
            rounded = [SlabAllocator.rounded(sizes[i]) for i in todo]
            need, free = sum(rounded), alloc.size - alloc.used
            if need > free:  # (the walk over every held block only when free space is short)
                evictable = tiers.lru.evictable_dram()
                if need > free + evictable:
                    raise StoreFull(
                        f"put of {len(todo)} blocks needs {need} bytes; dram tier has "
                        f"{free} free and {evictable} evictable of {alloc.size}"
                    )
            if not todo:
                return 0, []
            lease = self._leases.new(True, ttl)
            out = []
            # One range for the whole batch where one is free (each block is freed on its own
            # later: the allocator frees any part of a range); else block by block, evicting.
            run = alloc.alloc(need) if len(todo) > 1 else None
            starts = itertools.accumulate(rounded[:-1], initial=run) if run is not None else None
            for i in todo:
                off = next(starts) if starts is not None else tiers.alloc_dram(sizes[i])
                if off is None:  # fragmentation: undo this reservation
                    tiers.unreserve(lease.entries)
                    raise StoreFull(f"no contiguous {sizes[i]} bytes in the dram tier")
                lease.entries.append(tiers.reserve(keys[i], parents[i], sizes[i], off))
                out.append((i, off))
            self._leases.hold(lease)
            return lease.id, out

    def pending(self, lease_id: int) -> list[tuple[bytes, int, int]]:
        """(key, offset, size) of a write lease's reserved blocks; KeyError if it is not a live
        write lease."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None or not lease.write:
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
                    view = self._tiers.view
                    for e in reversed(lease.entries):
                        check_bytes(view[e.offset : e.offset + e.size], self.fingerprint, payloads)
                else:
                    check_headers(
                        self._tiers.array,
                        [e.offset for e in lease.entries],
                        [e.size for e in lease.entries],
                        self.fingerprint,
                    )
            except BlockCorrupt:
                self.release(lease_id)
                raise
        with self._lock:
            if self._leases.pop(lease_id) is None:
                raise KeyError(f"write lease {lease_id} expired before its commit")
            for e in lease.entries:
                self._tiers.commit(e)
            return len(lease.entries)

    def put(
        self, keys: list[bytes], blocks: list[bytes], parents: list[bytes | None], ttl: float = 60.0
    ) -> int:
        """Store encoded blocks in one step (reserve, copy, commit); the count newly stored."""
        lease_id, slots = self.reserve(keys, [len(b) for b in blocks], parents, ttl)
        for i, off in slots:
            self._tiers.view[off : off + len(blocks[i])] = blocks[i]
        return self.commit(lease_id) if slots else 0

    # ------------------------------------------------------------------ leases

    def renew(self, lease_id: int, ttl: float) -> bool:
        with self._lock:
            return self._leases.renew(lease_id, ttl)

    def release(self, lease_id: int, corrupt: Iterable[bytes] = ()) -> bool:
        """End a lease: a read lease unpins its blocks (dropping those reported corrupt), a write
        lease is aborted (its reserved ranges freed). False if it was not held."""
        tiers = self._tiers
        with self._lock:
            bad = set(corrupt)
            for key in bad:
                if (e := tiers.held(key)) is not None:
                    tiers.corrupt_found(e, "a reader's checksum")
            lease = self._leases.pop(lease_id)
            if lease is None:
                # reported outside a lease (the gRPC path's lease ended with its stream)
                for key in bad:
                    if (e := tiers.held(key)) is not None:
                        tiers.doom(e)
                return False
            if lease.write:
                tiers.unreserve(lease.entries)
                return True
            for e in lease.entries:
                e.doomed |= e.key in bad
            tiers.unpin(lease.entries)
            return True

    def clear(self) -> tuple[int, int]:
        """Drop every block of every tier; a leased one goes when its last lease ends. (dropped,
        deferred)."""
        with self._lock:
            return self._tiers.clear()

    def expire(self) -> int:
        """Release every lease past its expiry (its holder died or forgot); how many."""
        now = self._leases.clock()
        with self._lock:
            dead = self._leases.expired(now)
            for i in dead:
                self.release(i)
            return len(dead)

    def persist(self) -> int:
        """Copy dram blocks into free ssd space (most recent first, evicting nothing), so that a
        graceful stop loses as little as it can; how many. Used when the node stops."""
        if not self.ssd:
            return 0
        with self._lock:
            return self._tiers.persist()
