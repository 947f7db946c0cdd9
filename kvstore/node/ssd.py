"""The ssd tier: encoded blocks in LMDB (a `blocks` table) with their parent keys (`parents`)
and sizes (`sizes`), so that a restarted node finds them again without reading them."""

from __future__ import annotations

import os
from collections.abc import Iterable

import lmdb


class SsdTier:
    """Durable block bytes by key. Capacity is enforced by the store; the map is sized above it."""

    def __init__(self, path: str, capacity: int):
        os.makedirs(path, exist_ok=True)
        self.capacity = capacity
        # B-tree pages and overflow rounding cost space beyond the values themselves.
        map_size = max(capacity * 2 + (64 << 20), 1 << 26)
        self.env = lmdb.open(
            path,
            map_size=map_size,
            max_dbs=3,
            sync=False,
            metasync=False,
            readahead=False,
            lock=True,
            max_readers=256,
        )
        self.blocks = self.env.open_db(b"blocks")
        self.parents = self.env.open_db(b"parents")
        # Sizes apart from the blocks: finding a block's size in `blocks` touches its pages (and
        # the kernel's fault-around maps more), which made a restarted node's whole tier resident.
        self.sizes = self.env.open_db(b"sizes")

    def put(self, key: bytes, data, parent: bytes | None) -> None:
        with self.env.begin(write=True) as txn:
            txn.put(key, data, db=self.blocks)
            txn.put(key, parent or b"", db=self.parents)
            txn.put(key, len(memoryview(data)).to_bytes(8, "little"), db=self.sizes)

    def get(self, key: bytes) -> bytes | None:
        with self.env.begin(buffers=False) as txn:
            return txn.get(key, db=self.blocks)

    def delete(self, key: bytes) -> None:
        with self.env.begin(write=True) as txn:
            txn.delete(key, db=self.blocks)
            txn.delete(key, db=self.parents)
            txn.delete(key, db=self.sizes)

    def scan(self) -> list[tuple[bytes, int, bytes | None]]:
        """(key, size, parent) of every stored block, from the small `sizes` and `parents`
        tables. Blocks written before `sizes` existed are measured in `blocks` (their pages read
        once) and their sizes recorded, so that the next scan reads none."""
        out: list[tuple[bytes, int, bytes | None]] = []
        measured: list[tuple[bytes, int]] = []
        with self.env.begin(buffers=True) as txn:
            parents = txn.cursor(db=self.parents)
            sizes = {bytes(k): int.from_bytes(v, "little") for k, v in txn.cursor(db=self.sizes)}
            keys: Iterable[bytes] = sizes
            if len(sizes) != txn.stat(self.blocks)["entries"]:
                keys = [bytes(k) for k in txn.cursor(db=self.blocks).iternext(values=False)]
            for key in keys:
                size = sizes.get(key)
                if size is None:
                    block = txn.get(key, db=self.blocks)
                    # the key came from this transaction's own walk over `blocks`
                    assert block is not None
                    size = len(block)
                    measured.append((key, size))
                parent = parents.get(key, b"")  # "" (no parent) for a first block
                out.append((key, size, bytes(parent) or None))
        if measured:
            with self.env.begin(write=True) as txn:
                for key, size in measured:
                    txn.put(key, size.to_bytes(8, "little"), db=self.sizes)
        return out

    def sync(self) -> None:
        self.env.sync(True)

    def close(self) -> None:
        self.env.sync(True)
        self.env.close()
