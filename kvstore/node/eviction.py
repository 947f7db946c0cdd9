"""Leaf-first LRU: the order in which a store node's blocks leave a tier. A block whose prefix goes
on in a cached child is evicted after the leaves, since dropping it would strand the child (a
prefix is only ever read from its start). Not thread-safe: the store's lock guards it."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from kvstore.node.entry import DRAM, SSD, Entry
from kvstore.slab import SlabAllocator


class LruOrder:
    """Each tier's held blocks, least recently used first, and how many cached children each
    parent key has (committed or loaded blocks only: a reservation is not a child yet)."""

    def __init__(self) -> None:
        self._order: dict[str, OrderedDict[bytes, Entry]] = {
            DRAM: OrderedDict(),
            SSD: OrderedDict(),
        }
        self._children: dict[bytes, int] = {}  # parent key -> cached children

    def blocks(self, tier: str) -> Iterable[Entry]:
        """The tier's blocks, oldest first (a live view: copy it before dropping any)."""
        return self._order[tier].values()

    def count(self, tier: str) -> int:
        return len(self._order[tier])

    def add(self, e: Entry) -> None:
        """`e` is in its tier now, as the most recently used."""
        self._order[e.tier][e.key] = e

    def remove(self, e: Entry) -> None:
        """`e` leaves its tier (before its `tier` changes)."""
        del self._order[e.tier][e.key]

    def touch(self, e: Entry) -> None:
        self._order[e.tier].move_to_end(e.key)

    def add_child(self, parent: bytes | None) -> None:
        if parent is not None:
            self._children[parent] = self._children.get(parent, 0) + 1

    def remove_child(self, parent: bytes | None) -> None:
        if parent is None:
            return
        n = self._children.get(parent, 0) - 1
        if n > 0:
            self._children[parent] = n
        else:
            self._children.pop(parent, None)

    def victim(self, tier: str, leaves_only: bool = False) -> Entry | None:
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

    def evictable_dram(self) -> int:
        """Slab bytes that evicting every unleased dram block would free (a walk over them all:
        only for a put that does not fit in the free space)."""
        return sum(
            SlabAllocator.rounded(e.size) for e in self._order[DRAM].values() if not e.leases
        )

    def dram_can_free(self, need: int) -> bool:
        """Whether evicting unleased dram blocks frees `need` slab bytes, counted only as far as
        needed (an ssd hit does not walk every dram entry)."""
        for x in self._order[DRAM].values():
            if need <= 0:
                break
            if not x.leases:
                need -= SlabAllocator.rounded(x.size)
        return need <= 0
