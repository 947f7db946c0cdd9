"""KV store: block keys and format, codecs, tiers, eviction, global index, transfer."""

from kvstore.block_format import (
    BlockCorrupt,
    BlockHeader,
    FORMAT_VERSION,
    check_block,
    decode_block,
    encode_block,
    parse_header,
)
from kvstore.cachegen import (
    DEFAULT_LEVEL as CACHEGEN_DEFAULT_LEVEL,
    LEVELS,
    CachegenCorrupt,
    cachegen_decode,
    cachegen_encode,
)
from kvstore.cachegen_stream import RAW_LEVEL, chunk_key, chunk_keys, choose_level
from kvstore.client import BlockWriter, PutResult, StoreClient, StoreUnavailable
from kvstore.codecs import CODECS, Codec, block_tokens, get_codec
from kvstore.config import StoreConfig
from kvstore.connector import (
    ChunkFetch,
    ChunkPlan,
    KVConnector,
    LayerPublisher,
    PrefixLoad,
    write_tokens,
)
from kvstore.device import DeviceTier
from kvstore.index import Index
from kvstore.index_publisher import IndexPublisher
from kvstore.keys import KEY_BYTES, block_keys
from kvstore.redis_embed import EmbeddedRedis
from kvstore.server import StoreNode
from kvstore.store import StoreFull, StoreStats, TierStats
from kvstore.types import LookupResult, NodeInfo

CACHEGEN_LEVELS = tuple(sorted(LEVELS))  # CacheGen levels, 1 = smallest and lossiest

__all__ = [
    "KEY_BYTES",
    "block_keys",
    "BlockCorrupt",
    "BlockHeader",
    "FORMAT_VERSION",
    "check_block",
    "decode_block",
    "encode_block",
    "parse_header",
    "CODECS",
    "Codec",
    "block_tokens",
    "get_codec",
    "StoreConfig",
    "StoreNode",
    "StoreClient",
    "BlockWriter",
    "PutResult",
    "StoreFull",
    "StoreUnavailable",
    "StoreStats",
    "TierStats",
    "DeviceTier",
    "KVConnector",
    "LayerPublisher",
    "PrefixLoad",
    "write_tokens",
    "ChunkFetch",
    "ChunkPlan",
    "CACHEGEN_DEFAULT_LEVEL",
    "CACHEGEN_LEVELS",
    "CachegenCorrupt",
    "cachegen_decode",
    "cachegen_encode",
    "chunk_key",
    "chunk_keys",
    "choose_level",
    "RAW_LEVEL",
    "Index",
    "IndexPublisher",
    "EmbeddedRedis",
    "LookupResult",
    "NodeInfo",
]
