"""The KV store's shared side: block keys, the block header, the global index, the result types
and checks both ends agree on, and the control client. Torch-free, so the conductor and the
store node import it without loading torch (about 180 MiB of a process's RSS).

Where the rest lives, by who uses it:
- `kvstore.client`: what a worker links (the client library, its transports shm / tcp / gRPC,
  the connector between a worker's KV pool and the store, the block formats and codecs);
- `kvstore.node`: the store node (its gRPC server, dram / ssd tiers, eviction), imported by
  deploy alone."""

from kvstore.block_header import FORMAT_VERSION, BlockCorrupt, BlockHeader
from kvstore.bulk import BulkChannel, BulkError
from kvstore.control import StoreControl, StoreUnavailable
from kvstore.index import Index
from kvstore.index_publisher import IndexPublisher
from kvstore.keys import KEY_BYTES, block_keys
from kvstore.redis_embed import EmbeddedRedis
from kvstore.types import LookupResult, NodeInfo, StoreFull, StoreStats, TierStats

__all__ = [
    "KEY_BYTES",
    "block_keys",
    "BlockCorrupt",
    "BlockHeader",
    "FORMAT_VERSION",
    "StoreControl",
    "StoreUnavailable",
    "BulkChannel",
    "BulkError",
    "StoreFull",
    "StoreStats",
    "TierStats",
    "Index",
    "IndexPublisher",
    "EmbeddedRedis",
    "LookupResult",
    "NodeInfo",
]
