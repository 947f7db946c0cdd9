"""CacheGen chunks in the store, and the per-chunk level choice of adaptive streaming.

A sequence's full blocks are grouped into chunks of `chunk_blocks` consecutive blocks from its
start (chunk i = blocks [i*C, (i+1)*C)); only whole chunks are encoded. A chunk at level n is one
record in the block format (header, fingerprint, checksum) under `chunk_key(last block's key, n)`:
shape [1, bytes] uint8, codec `cachegen{n}`, the payload a CacheGen bitstream
(kvstore/cachegen.py). Chunk keys chain from block keys, so a prefix's chunks are found exactly
as its blocks are, and levels never share keys.

The puller's rule is CacheGen's, over the options of each chunk: the CacheGen levels the node
holds, and above them RAW_LEVEL, the chunk's blocks as the node stores them (lossless, no entropy
decode). With `remaining` seconds of budget for `left` chunks, chunk i goes at the highest option
whose cost fits remaining / left; when none fits, at the cheapest unless recomputing the chunk
(and, here, the rest of the prefix) from text is faster still.

An option's cost is what the chunk adds to a two-stage pipeline (`chunk_costs`): the link carries
one transfer after another (busy until `link_free`), the puller's thread decodes or copies one
chunk after another in chunk order (busy until `decode_free`), and a chunk lands once it arrived.
A coded chunk is small on the link but long on the decoder (the entropy decoder runs on a CPU
core); a raw chunk is long on the link and needs only a copy. A coded chunk's gain, the link free
for the next chunk while it decodes, shows only in when the next chunk lands: so "cheapest", when
nothing fits, compares each option paired with the next chunk at its fastest, and a mix of raw
and coded chunks can land before either kind alone would. What must fit the budget is the chunk's
own cost: a pair's average would let a slow chunk borrow from a next one that may never be cheap.
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple

import torch

from kvstore.block_header import BlockCorrupt, BlockHeader
from kvstore.client.cachegen import LEVELS, cachegen_decode, cachegen_encode

CHUNK_TAG = b"halfmoon/cachegen-chunk/"
# The option "the chunk's stored blocks, as stored": lossless, so above every CacheGen level (and
# never a chunk key's level). A ChunkFetch's levels say RAW_LEVEL for a chunk that went raw.
RAW_LEVEL = 255
assert RAW_LEVEL > max(LEVELS)


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
    """The option one chunk goes at, and why."""

    level: int  # a CacheGen level, RAW_LEVEL (its stored blocks), or 0 = recompute it and the rest
    predicted_s: float  # its predicted cost at that option
    budget_s: float  # this chunk's share of the remaining budget


def choose_level(
    costs: dict[int, float],
    remaining_s: float,
    left: int,
    recompute_s: float,
    paired: dict[int, float] | None = None,
) -> ChunkChoice:
    """CacheGen's per-chunk rule over `costs` (option -> predicted seconds for this chunk: a
    CacheGen level, or RAW_LEVEL above them all; see `chunk_costs`): the highest option whose
    cost fits remaining_s / left; if none does, the cheapest option by `paired` (the same options'
    per-chunk cost with the next chunk; default `costs`) when it still beats recomputing the
    chunk (`recompute_s`), else 0 (recompute)."""
    budget = max(0.0, remaining_s) / max(1, left)
    if not costs:
        return ChunkChoice(0, 0.0, budget)
    for level in sorted(costs, reverse=True):
        if costs[level] <= budget:
            return ChunkChoice(level, costs[level], budget)
    paired = paired or costs
    cheapest = min(paired, key=lambda lv: paired[lv])
    t = paired[cheapest]
    return ChunkChoice(cheapest if t < recompute_s else 0, t, budget)


class OptionCost(NamedTuple):
    """What fetching one chunk at one option takes, on each stage of the pipeline."""

    link_s: float  # on the link: its bytes over the measured throughput
    decode_s: float  # on the puller's thread: entropy decode (coded) or copy into the pool (raw)


class ChunkCosts(NamedTuple):
    """A chunk's options priced in the pipeline (`chunk_costs`), seconds from `decode_free`."""

    alone: dict[int, float]  # option -> what the chunk adds (what must fit its budget share)
    paired: dict[int, float]  # option -> per chunk, it and the next at its fastest (cheapest)


def pipeline_done(link_free: float, decode_free: float, cost: OptionCost) -> tuple[float, float]:
    """When a chunk queued behind a link busy until `link_free` and a decoder busy until
    `decode_free` has arrived, and when it has landed in the pool (it decodes once arrived)."""
    arrived = link_free + cost.link_s
    return arrived, max(arrived, decode_free) + cost.decode_s


def chunk_costs(
    options: dict[int, OptionCost],
    next_options: dict[int, OptionCost],
    link_free: float,
    decode_free: float,
) -> ChunkCosts:
    """A chunk's `options` priced behind a link busy until `link_free` and a decoder busy until
    `decode_free` (seconds, one clock): alone, and paired with the next chunk (`next_options`,
    at its fastest; none for the last chunk: then paired = alone)."""
    alone, paired = {}, {}
    for option, cost in options.items():
        link, done = pipeline_done(link_free, decode_free, cost)
        alone[option] = done - decode_free
        if next_options:
            pair_done = min(pipeline_done(link, done, c)[1] for c in next_options.values())
            paired[option] = (pair_done - decode_free) / 2
        else:
            paired[option] = alone[option]
    return ChunkCosts(alone, paired)


class Throughput:
    """Measured bytes/s of one link: the last transfers' rate, smoothed (CacheGen adapts to the
    throughput of the chunks just received). Smoothed as seconds per byte, so that a link that
    thinned shows at once (a stale fast estimate would keep big options "fitting" for chunks) and
    one that widened over a few chunks; the first measurement replaces the prior, a guess."""

    def __init__(self, prior_bytes_per_s: float, weight: float = 0.7):
        self.bytes_per_s = prior_bytes_per_s
        self.weight = weight  # of the newest measurement
        self.measured = False  # whether a transfer was measured (else bytes_per_s is the prior)

    def add(self, nbytes: int, seconds: float) -> None:
        if seconds > 0 and nbytes > 0:
            w = self.weight if self.measured else 1.0
            per_byte = w * seconds / nbytes + (1 - w) / self.bytes_per_s
            self.bytes_per_s = 1.0 / per_byte
            self.measured = True
