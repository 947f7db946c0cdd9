"""Small types and checks shared by the store's client, node and index: the contracts both sides
of a put, a lookup and a stats call agree on."""

from __future__ import annotations

from typing import NamedTuple

from kvstore.keys import KEY_BYTES


class LookupResult(NamedTuple):
    num_blocks: int  # leading keys held
    tiers: list[str]  # tier of each held block: device | dram | ssd
    sizes: tuple[int, ...] = ()  # encoded bytes of each held block (what fetching it moves)


class NodeInfo(NamedTuple):
    node_id: str
    address: str  # gRPC address HOST:PORT
    host: str  # host the node runs on (hostname)
    shm_path: str  # its dram slab's file ("" = none)
    dram_bytes: int  # dram tier capacity
    ssd_bytes: int  # ssd tier capacity
    model_fingerprint: str  # "" = accepts any
    started_at: float  # unix time the node started


def boot_id() -> str:
    """Identifies this boot of this machine (same host iff hostname and boot id match)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def grpc_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


class StoreFull(Exception):
    """Not enough evictable space for a put (RESOURCE_EXHAUSTED); nothing was stored. One put
    must fit in the dram tier at once."""


def write_problem(keys: list[bytes], sizes: list[int], fingerprint: str, want: str) -> str:
    """What is wrong with a put of `keys` with encoded `sizes` and model `fingerprint` on a node
    that takes `want` ("" = any); "" when nothing is (every transport's put checks this)."""
    if not keys:
        return "put of no blocks"
    if len(sizes) != len(keys):
        return f"{len(keys)} keys but {len(sizes)} sizes"
    bad = [i for i, k in enumerate(keys) if len(k) != KEY_BYTES]
    if bad:
        return f"block key {bad[0]} is {len(keys[bad[0]])} bytes, not {KEY_BYTES}"
    if any(s <= 0 for s in sizes):
        return "block sizes must be positive"
    if want and fingerprint != want:
        return f"model fingerprint {fingerprint!r} is not this store's {want!r}"
    return ""


class BlockRef(NamedTuple):
    key: bytes  # block key
    tier: str  # where it was found: dram | ssd (an ssd hit may have been promoted since)
    offset: int  # slab offset (dram), -1 when the bytes are in `data`
    length: int  # encoded block bytes
    data: bytes | None  # the block's bytes when it stays on ssd (could not be promoted)


class TierStats(NamedTuple):
    tier: str  # dram | ssd
    used_bytes: int  # encoded block bytes held (slab ranges are rounded up to 64 B)
    capacity_bytes: int  # the tier's configured capacity
    blocks: int  # blocks held
    hits: int  # block reads served from this tier
    evictions: int  # blocks that left this tier for lack of space (demoted or dropped)


class StoreStats(NamedTuple):
    node_id: str
    tiers: list[TierStats]  # dram first
    hits: int  # blocks found by reads
    misses: int  # blocks asked for past the held prefix
    promotions: int  # ssd -> dram moves
    demotions: int  # dram -> ssd moves
    leases: int  # leases held now
    pending_blocks: int  # blocks reserved by writers, not yet committed
    # the node process's (rss, uss, pss, configured) bytes: set by StoreClient.stats from the
    # node's reply (servekit.MemoryUsage and its in-memory tiers' capacity); None in-process
    memory: tuple[int, int, int, int] | None = None
