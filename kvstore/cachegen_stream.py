"""CacheGen chunks in the store, and the per-chunk level choice of adaptive streaming.

A sequence's full blocks are grouped into chunks of `chunk_blocks` consecutive blocks from its
start (chunk i = blocks [i*C, (i+1)*C)); only whole chunks are encoded. A chunk at level n is one
record in the block format (header, fingerprint, checksum) under `chunk_key(last block's key, n)`:
shape [1, bytes] uint8, codec `cachegen{n}`, the payload a CacheGen bitstream
(kvstore/cachegen.py). Chunk keys chain from block keys, so a prefix's chunks are found exactly
as its blocks are, and levels never share keys.

The puller's rule is CacheGen's: with measured throughput `bw` (bytes/s) and `remaining` seconds
of budget for `left` chunks, chunk i goes at the highest level whose cost fits remaining / left,
the cost being bytes / bw, or the level's measured decode time where that is longer (decoding
chunk i overlaps the transfer of chunk i+1, and on a CPU decoding can be the slower of the two);
when none fits, the chunk (and, here, the rest of the prefix) is recomputed from text unless even
the cheapest level is faster than recomputing it.
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple

import torch

from kvstore.block_format import BlockCorrupt, BlockHeader
from kvstore.cachegen import cachegen_decode, cachegen_encode

CHUNK_TAG = b"halfmoon/cachegen-chunk/"


def chunk_key(last_block_key: bytes, level: int) -> bytes:
    """The store key of a chunk at `level`: derived from its last block's key (which commits to
    the whole prefix, fingerprint and salt included)."""
    h = hashlib.blake2b(CHUNK_TAG + bytes([level]), digest_size=len(last_block_key))
    h.update(last_block_key)
    return h.digest()


def chunk_keys(block_keys: list[bytes], chunk_blocks: int, level: int) -> list[bytes]:
    """Keys of the whole chunks of a run of block keys (from block 0), at `level`."""
    return [
        chunk_key(block_keys[end - 1], level)
        for end in range(chunk_blocks, len(block_keys) + 1, chunk_blocks)
    ]


def blocks_to_tokens(blocks: torch.Tensor) -> torch.Tensor:
    """Full-precision pool blocks [C, L, 2, bs, H, D] as one stretch [L, 2, C*bs, H, D]."""
    c, layers, two, bs, heads, dim = blocks.shape
    return blocks.permute(1, 2, 0, 3, 4, 5).reshape(layers, two, c * bs, heads, dim)


def tokens_to_blocks(kv: torch.Tensor, block_size: int) -> torch.Tensor:
    """Inverse of `blocks_to_tokens`: [L, 2, C*bs, H, D] -> [C, L, 2, bs, H, D]."""
    layers, two, t, heads, dim = kv.shape
    c = t // block_size
    return kv.reshape(layers, two, c, block_size, heads, dim).permute(2, 0, 1, 3, 4, 5)


def encode_chunk(blocks: torch.Tensor, level: int) -> torch.Tensor:
    """Blocks [C, L, 2, bs, H, D] encoded at `level`: the record payload, [1, bytes] uint8 (put
    it with codec `cachegen{level}`)."""
    stream = cachegen_encode(blocks_to_tokens(blocks), level)
    return torch.frombuffer(bytearray(stream), dtype=torch.uint8).reshape(1, -1)


def decode_chunk_record(record: bytes, header: BlockHeader, dtype: torch.dtype) -> torch.Tensor:
    """The KV [L, 2, T, H, D] of a checked record (`header`: its parsed header; the payload is
    its one [1, bytes] layer, padded in the record to the block format's alignment)."""
    if not header.codec.startswith("cachegen") or len(header.shape) != 2:
        raise BlockCorrupt(f"a {header.codec} block of shape {list(header.shape)} is no chunk")
    start = header.header_len
    return cachegen_decode(memoryview(record)[start : start + header.shape[1]], dtype=dtype)


class ChunkChoice(NamedTuple):
    """The level one chunk goes at, and why."""

    level: int  # chosen level; 0 = recompute this chunk (and the rest) from text
    predicted_s: float  # its predicted cost at that level
    budget_s: float  # this chunk's share of the remaining budget


def choose_level(
    costs: dict[int, float], remaining_s: float, left: int, recompute_s: float
) -> ChunkChoice:
    """CacheGen's per-chunk rule over `costs` (level -> predicted seconds for this chunk: its
    bytes over the measured throughput, or its decode time where that is longer): the highest
    level whose cost fits remaining_s / left; if none does, the cheapest level when it still
    beats recomputing the chunk (`recompute_s`), else 0 (recompute)."""
    budget = max(0.0, remaining_s) / max(1, left)
    if not costs:
        return ChunkChoice(0, 0.0, budget)
    for level in sorted(costs, reverse=True):
        if costs[level] <= budget:
            return ChunkChoice(level, costs[level], budget)
    cheapest = min(costs, key=lambda lv: costs[lv])
    t = costs[cheapest]
    return ChunkChoice(cheapest if t < recompute_s else 0, t, budget)


class Throughput:
    """Measured bytes/s of one link: the last transfer's rate, smoothed (CacheGen adapts to the
    throughput of the chunks just received)."""

    def __init__(self, prior_bytes_per_s: float, weight: float = 0.7):
        self.bytes_per_s = prior_bytes_per_s
        self.weight = weight  # of the newest measurement

    def add(self, nbytes: int, seconds: float) -> None:
        if seconds > 0 and nbytes > 0:
            now = nbytes / seconds
            self.bytes_per_s = self.weight * now + (1 - self.weight) * self.bytes_per_s
