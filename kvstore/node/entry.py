"""A block's record in the store node, and the names of the places it can be. Shared by the tiers,
their eviction order and the leases, which all point at the same records."""

from __future__ import annotations

from dataclasses import dataclass

DRAM, SSD = "dram", "ssd"
# A block reserved by a writer and not committed yet: in the slab, invisible to readers.
PENDING = "pending"


# eq=False: records are compared and found by identity (a key dropped and stored again is a new
# record, and a reader holding the old one must see that). slots: a node holds millions of them.
@dataclass(eq=False, slots=True)
class Entry:
    key: bytes  # the block's key
    parent: bytes | None  # the key of the block before it in its prefix (None: a first block)
    tier: str  # DRAM, SSD or PENDING
    size: int  # encoded bytes
    offset: int = -1  # its slab range's start while in dram (or reserved); -1 on ssd
    leases: int = 0  # leases pinning it: a pinned block is not demoted, evicted or dropped
    doomed: bool = False  # reported corrupt or cleared while leased: dropped when its last goes
