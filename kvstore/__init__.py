"""KV store: block keys and format, codecs, tiers, eviction, global index, transfer."""

import importlib

from kvstore.block_header import FORMAT_VERSION, BlockCorrupt, BlockHeader
from kvstore.bulk import BulkChannel, BulkError
from kvstore.config import StoreConfig
from kvstore.control import StoreControl, StoreUnavailable
from kvstore.device import DeviceTier
from kvstore.index import Index
from kvstore.index_publisher import IndexPublisher
from kvstore.keys import KEY_BYTES, block_keys
from kvstore.redis_embed import EmbeddedRedis
from kvstore.server import StoreNode
from kvstore.store import StoreFull, StoreStats, TierStats
from kvstore.types import LookupResult, NodeInfo

# Names whose modules import torch (encoding, decoding and moving tensors), loaded on first use:
# a store node stores bytes and holds no tensors, and torch alone costs a process ~170 MB.
_LAZY = {
    "check_block": "kvstore.block_format",
    "decode_block": "kvstore.block_format",
    "encode_block": "kvstore.block_format",
    "parse_header": "kvstore.block_format",
    "CachegenCorrupt": "kvstore.cachegen",
    "cachegen_decode": "kvstore.cachegen",
    "cachegen_encode": "kvstore.cachegen",
    "RAW_LEVEL": "kvstore.cachegen_stream",
    "chunk_key": "kvstore.cachegen_stream",
    "chunk_keys": "kvstore.cachegen_stream",
    "choose_level": "kvstore.cachegen_stream",
    "BlockWriter": "kvstore.client",
    "PutResult": "kvstore.client",
    "StoreClient": "kvstore.client",
    "CODECS": "kvstore.codecs",
    "Codec": "kvstore.codecs",
    "block_tokens": "kvstore.codecs",
    "get_codec": "kvstore.codecs",
    "ChunkFetch": "kvstore.connector",
    "ChunkPlan": "kvstore.connector",
    "KVConnector": "kvstore.connector",
    "LayerPublisher": "kvstore.connector",
    "PrefixLoad": "kvstore.connector",
    "write_tokens": "kvstore.connector",
}


def __getattr__(name: str):
    if name == "CACHEGEN_DEFAULT_LEVEL":
        value = importlib.import_module("kvstore.cachegen").DEFAULT_LEVEL
    elif name == "CACHEGEN_LEVELS":  # CacheGen levels, 1 = smallest and lossiest
        value = tuple(sorted(importlib.import_module("kvstore.cachegen").LEVELS))
    elif name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    else:
        raise AttributeError(f"module 'kvstore' has no attribute {name!r}")
    globals()[name] = value  # looked up once
    return value


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
    "StoreControl",
    "BulkChannel",
    "BulkError",
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
