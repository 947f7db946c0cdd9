"""What a worker links to use the store: the block formats and codecs it encodes, the client
library (`StoreClient`) over one transport per node (shm on the same host, tcp or gRPC across),
the device tier in the worker's own memory and the connector between its KV pool and the store.
Imports torch (it moves tensors); the store node and the conductor never import it."""

from kvstore.client.block_format import check_block, decode_block, encode_block, parse_header
from kvstore.client.cachegen import DEFAULT_LEVEL as CACHEGEN_DEFAULT_LEVEL
from kvstore.client.cachegen import LEVELS as _CACHEGEN_LEVEL_TABLE
from kvstore.client.cachegen import CachegenCorrupt, cachegen_decode, cachegen_encode
from kvstore.client.cachegen_stream import RAW_LEVEL, choose_level, chunk_key, chunk_keys
from kvstore.client.codecs import CODECS, Codec, block_tokens, get_codec
from kvstore.client.connector import (
    ChunkFetch,
    ChunkPlan,
    KVConnector,
    LayerPublisher,
    PrefixLoad,
    write_tokens,
)
from kvstore.client.device import DeviceTier
from kvstore.client.store_client import BlockWriter, PutResult, StoreClient

CACHEGEN_LEVELS = tuple(sorted(_CACHEGEN_LEVEL_TABLE))  # CacheGen levels, 1 = smallest, lossiest

__all__ = [
    "check_block",
    "decode_block",
    "encode_block",
    "parse_header",
    "CODECS",
    "Codec",
    "block_tokens",
    "get_codec",
    "StoreClient",
    "BlockWriter",
    "PutResult",
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
]
