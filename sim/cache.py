"""One node's cached blocks in up to two tiers, with the store's eviction rule
(kvstore/store.py): least recently used first, leaves (no cached child) before their parents; a
block leaving the fast tier is demoted to the slow one when there is one, and a slow-tier hit is
promoted back. Every block held is published to the global index under the cache's node id.

The store scans its LRU order for the first leaf; here each tier keeps two heaps keyed by last
use, leaves and parents, with stale entries skipped when they surface, so a victim costs
O(log n) however many parents sit at the cold end."""

from __future__ import annotations

import heapq
from typing import NamedTuple

from sim.index import GlobalIndex

FAST, SLOW = 0, 1


class Held(NamedTuple):
    blocks: int  # leading blocks of the prompt held here
    slow: int  # ... of which in the slow tier


class BlockCache:
    def __init__(
        self, node: str, index: GlobalIndex, fast_blocks: int, slow_blocks: int = 0
    ) -> None:
        self.node = node
        self.index = index
        self.capacity = [max(0, fast_blocks), max(0, slow_blocks)]
        self.count = [0, 0]  # blocks in each tier
        self._tier: dict[int, int] = {}
        self._used: dict[int, int] = {}  # key -> tick of its last use
        self._parent: dict[int, int] = {}
        self._children: dict[int, int] = {}  # cached children (any tier); absent = a leaf
        # per tier: [leaves heap, parents heap] of (tick, key); an entry is live while the key
        # is in that tier, used at that tick, and still a leaf (or still a parent)
        self._heaps: list[list[list[tuple[int, int]]]] = [[[], []], [[], []]]
        self._tick = 0
        self.promotions = self.demotions = self.dropped = 0

    def __len__(self) -> int:
        return len(self._tier)

    def held(self, keys: tuple[int, ...]) -> Held:
        n = slow = 0
        tier = self._tier
        for k in keys:
            t = tier.get(k)
            if t is None:
                break
            n += 1
            slow += t
        return Held(n, slow)

    def use(self, keys: tuple[int, ...]) -> None:
        """Blocks read: each becomes the most recently used; slow-tier ones are promoted."""
        for k in keys:
            t = self._tier.get(k)
            if t is None:
                return
            if t == SLOW and self.capacity[FAST] > 0:
                self.count[SLOW] -= 1
                del self._tier[k]
                self._place(k, FAST)
                self.promotions += 1
            else:
                self._touch(k)

    def insert(self, keys: tuple[int, ...]) -> None:
        """The prompt's blocks written here (those held already are used instead)."""
        if self.capacity[FAST] <= 0:
            return
        parent = 0
        for k in keys:
            if k in self._tier:
                self.use((k,))
            else:
                self._parent[k] = parent
                if parent:
                    self._add_child(parent)
                self._place(k, FAST)
                self.index.add(k, self.node)
            parent = k

    def set_fast_capacity(self, blocks: int) -> None:
        """Shrink (or grow) the fast tier: a colocated instance's cache is its free pool."""
        self.capacity[FAST] = max(0, blocks)
        while self.count[FAST] > self.capacity[FAST]:
            if not self._evict(FAST):
                break

    # ---- internals ----

    def _touch(self, k: int) -> None:
        self._tick += 1
        self._used[k] = self._tick
        self._push(k)

    def _push(self, k: int) -> None:
        kind = 1 if self._children.get(k) else 0
        heapq.heappush(self._heaps[self._tier[k]][kind], (self._used[k], k))

    def _add_child(self, parent: int) -> None:
        n = self._children.get(parent, 0)
        self._children[parent] = n + 1
        if n == 0 and parent in self._tier:
            self._push(parent)  # a leaf no more: it moves to the parents' heap, same recency

    def _remove_child(self, parent: int) -> None:
        n = self._children.get(parent, 0) - 1
        if n > 0:
            self._children[parent] = n
        else:
            self._children.pop(parent, None)
            if parent in self._tier:
                self._push(parent)  # a leaf again

    def _place(self, k: int, tier: int) -> None:
        while self.count[tier] >= self.capacity[tier]:
            if not self._evict(tier):
                break
        self._tier[k] = tier
        self.count[tier] += 1
        self._touch(k)

    def _top(self, tier: int, kind: int) -> int | None:
        heap = self._heaps[tier][kind]
        while heap:
            tick, k = heap[0]
            live = (
                self._tier.get(k) == tier
                and self._used.get(k) == tick
                and bool(self._children.get(k)) == bool(kind)
            )
            if live:
                return k
            heapq.heappop(heap)
        return None

    def _victim(self, tier: int, leaves_only: bool) -> int | None:
        k = self._top(tier, 0)
        if k is None and not leaves_only:
            k = self._top(tier, 1)
        return k

    def _evict(self, tier: int) -> bool:
        victim = self._victim(tier, leaves_only=tier == SLOW)
        if victim is None:
            return False
        self.count[tier] -= 1
        del self._tier[victim]
        if tier == FAST and self.capacity[SLOW] > 0 and self._room_slow():
            self._tier[victim] = SLOW
            self.count[SLOW] += 1
            self._push(victim)  # keeps its last use: demotion is not a use
            self.demotions += 1
        else:
            self._drop(victim)
        return True

    def _room_slow(self) -> bool:
        # Dropping a parent would orphan its children: with no leaf to drop, the demoted block
        # is dropped instead.
        while self.count[SLOW] >= self.capacity[SLOW]:
            victim = self._victim(SLOW, leaves_only=True)
            if victim is None:
                return False
            self.count[SLOW] -= 1
            del self._tier[victim]
            self._drop(victim)
        return True

    def _drop(self, k: int) -> None:
        """k has left its tier already: forget it on this node."""
        self._used.pop(k, None)
        parent = self._parent.pop(k, 0)
        if parent:
            self._remove_child(parent)
        self.index.remove(k, self.node)
        self.dropped += 1
