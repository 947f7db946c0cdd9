"""The ssd tier: encoded blocks in LMDB (a `blocks` table) with their parent keys (`parents`),
so that a restarted node finds them again."""

from __future__ import annotations

import os

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
            max_dbs=2,
            sync=False,
            metasync=False,
            readahead=False,
            lock=True,
            max_readers=256,
        )
        self.blocks = self.env.open_db(b"blocks")
        self.parents = self.env.open_db(b"parents")

    def put(self, key: bytes, data, parent: bytes | None) -> None:
        with self.env.begin(write=True) as txn:
            txn.put(key, data, db=self.blocks)
            txn.put(key, parent or b"", db=self.parents)

    def get(self, key: bytes) -> bytes | None:
        with self.env.begin(buffers=False) as txn:
            return txn.get(key, db=self.blocks)

    def delete(self, key: bytes) -> None:
        with self.env.begin(write=True) as txn:
            txn.delete(key, db=self.blocks)
            txn.delete(key, db=self.parents)

    def scan(self) -> list[tuple[bytes, int, bytes | None]]:
        """(key, size, parent) of every stored block."""
        out = []
        with self.env.begin() as txn:
            parents = txn.cursor(db=self.parents)
            for key, value in txn.cursor(db=self.blocks):
                parent = parents.get(key) if parents.set_key(key) else b""
                out.append((bytes(key), len(value), bytes(parent) or None))
        return out

    def sync(self) -> None:
        self.env.sync(True)

    def close(self) -> None:
        self.env.sync(True)
        self.env.close()
