"""The device tier: blocks left resident in the prefill worker's own KV pool, found again by block key."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Sequence

import torch

from kvstore import DeviceTier


class DevicePrefixCache(DeviceTier):
    """key -> pool block id for full blocks kept after their request; pinned while a request uses them.

    `kv` is the pool's tensor [num_blocks, ...]; it backs the DeviceTier reads (lookup, get_into).

    Eviction is LRU and takes children before parents: a match touches its chain from the last key to
    the first, so the first (the parent every longer prefix needs) is the most recently used.
    """

    def __init__(self, kv: torch.Tensor) -> None:
        self._kv = kv
        self._blocks: OrderedDict[bytes, int] = OrderedDict()
        self._pins: dict[bytes, int] = {}
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, keys: Sequence[bytes]) -> list[int]:
        """Block ids of the longest leading run of `keys` held; those blocks are pinned until `release`."""
        with self._lock:
            ids: list[int] = []
            for k in keys:
                b = self._blocks.get(k)
                if b is None:
                    break
                ids.append(b)
            held = list(keys[: len(ids)])
            for k in reversed(held):
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
        """Keep these blocks resident under their keys; returns the ids it did not take (key already held)."""
        rejected: list[int] = []
        with self._lock:
            for k, b in reversed(list(zip(keys, block_ids))):
                if k in self._blocks:
                    rejected.append(b)
                    continue
                self._blocks[k] = b
                self._blocks.move_to_end(k)
        return rejected

    def evict(self, n: int) -> list[int]:
        """Remove up to `n` unpinned blocks, least recently used first; returns their ids (now the caller's)."""
        out: list[int] = []
        with self._lock:
            for k in list(self._blocks):
                if len(out) >= n:
                    break
                if k not in self._pins:
                    out.append(self._blocks.pop(k))
        return out

    def contains(self, keys: Sequence[bytes]) -> int:
        """Leading keys held (no pin, no LRU touch)."""
        with self._lock:
            n = 0
            for k in keys:
                if k not in self._blocks:
                    break
                n += 1
            return n

    # ---- DeviceTier ----

    def lookup(self, keys: list[bytes]) -> int:
        return self.contains(keys)

    def get_into(self, keys: list[bytes], out: torch.Tensor) -> int:
        ids = self.match(keys)
        try:
            if ids:
                out[: len(ids)] = self._kv[torch.tensor(ids, dtype=torch.long)]
        finally:
            self.release(keys[: len(ids)])
        return len(ids)
