"""The device tier: full blocks left resident in a worker's own paged KV pool, found again by key.

It holds only bookkeeping (block key -> pool block id, pins, LRU order); the bytes stay in the pool,
which the connector reads. Every change is also queued as an index event, so that routing sees
what a worker's pool holds.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence


class DeviceTier:
    """key -> pool block id for full blocks kept after their request; pinned while a request uses
    them.

    Eviction is LRU and takes children before parents: a match touches its chain from the last key
    to the first, so the first (the parent every longer prefix needs) is the most recently used.
    """

    name = "device"

    def __init__(self) -> None:
        self._blocks: OrderedDict[bytes, int] = OrderedDict()
        self._pins: dict[bytes, int] = {}
        self._events: list[tuple[bytes, str | None]] = []  # (key, "device") held, (key, None) gone
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, keys: Sequence[bytes]) -> list[int]:
        """Block ids of the longest leading run of `keys` held; pinned until `release`."""
        with self._lock:
            ids: list[int] = []
            for k in keys:
                b = self._blocks.get(k)
                if b is None:
                    break
                ids.append(b)
            for k in reversed(keys[: len(ids)]):
                self._blocks.move_to_end(k)
                self._pins[k] = self._pins.get(k, 0) + 1
            self.hits += len(ids)
            self.misses += len(keys) - len(ids)
            return ids

    def release(self, keys: Sequence[bytes]) -> None:
        """Unpin blocks that `match` pinned."""
        with self._lock:
            for k in keys:
                n = self._pins.get(k, 0) - 1
                if n > 0:
                    self._pins[k] = n
                else:
                    self._pins.pop(k, None)

    def insert(self, keys: Sequence[bytes], block_ids: Sequence[int]) -> list[int]:
        """Keep these blocks resident under their keys; returns the ids it did not take (key held
        already: the caller frees them)."""
        rejected: list[int] = []
        with self._lock:
            for k, b in reversed(list(zip(keys, block_ids))):
                if k in self._blocks:
                    rejected.append(b)
                    continue
                self._blocks[k] = b
                self._blocks.move_to_end(k)
                self._events.append((k, self.name))
        return rejected

    def evict(self, n: int) -> list[int]:
        """Remove up to `n` unpinned blocks, least recently used first; their ids (now the
        caller's)."""
        out: list[int] = []
        with self._lock:
            for k in list(self._blocks):
                if len(out) >= n:
                    break
                if k not in self._pins:
                    out.append(self._blocks.pop(k))
                    self._events.append((k, None))
        return out

    def lookup(self, keys: Sequence[bytes]) -> int:
        """Leading keys held (no pin, no LRU touch)."""
        with self._lock:
            n = 0
            for k in keys:
                if k not in self._blocks:
                    break
                n += 1
            return n

    def drain_events(self) -> list[tuple[bytes, str | None]]:
        """The changes since the last call, oldest first, for the index."""
        with self._lock:
            events, self._events = self._events, []
        return events

    def listing(self) -> dict[bytes, str]:
        """Every block held (key -> "device"); the changes queued so far are dropped, since this
        supersedes them."""
        with self._lock:
            self._events = []
            return dict.fromkeys(self._blocks, self.name)
