"""The CacheGen stream's format (kvstore/client/cachegen.py has the codec): its header, where each
section lies, and the checks on both before the decoder allocates anything.

Stream layout (little-endian):
    header        HEADER_FIELDS (magic, version, level, group size, anchor C, L, T, H, D,
                  total bytes, payload words), then a CRC-32 of those: the header sizes
                  everything the decoder allocates, so a damaged one must not pass for another
    delta bins    uint8 [L, 2]: the delta quantizer's bins (2C + 1) for each (layer, K/V), as
                  the level says (checked: a mismatch is corruption)
    scales        float16 [L, 2, H*D] anchor steps, then float16 [L, 2, H*D] delta steps
    tables        uint8 lo[n], uint8 width[n], then uint8 counts (width of each, concatenated):
                  table i codes symbols lo .. lo+width-1 with probabilities proportional to its
                  counts. n = 2 anchor tables (K, V over all layers) + L*2*H delta tables
    payload       uint32 words of one range-coded stream: the anchor tables' symbols, then the
                  delta tables', each table's symbols in one run (tables of width 1 take no bits)
"""

from __future__ import annotations

import struct
import zlib
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from kvstore.client.cachegen_quant import GROUP_SIZE, LEVELS

if TYPE_CHECKING:
    from typing_extensions import Buffer  # collections.abc.Buffer from Python 3.12

MAGIC = b"CGKV"
VERSION = 1
# magic, version, level, group size, anchor C, layers, tokens, kv heads, head dim, total bytes of
# the stream, payload words; then HEADER_CRC, the CRC-32 of those bytes
HEADER_FIELDS = struct.Struct("<4sBBBBHIHHII")
HEADER_CRC = struct.Struct("<I")
HEADER_SIZE = HEADER_FIELDS.size + HEADER_CRC.size
MAX_NUMBERS = 1 << 31  # L*2*T*H*D a stream may hold: no header makes the decoder allocate more


class CachegenCorrupt(ValueError):
    """A stream that is malformed, truncated or inconsistent."""


class CachegenInfo(NamedTuple):
    """What a stream's header says."""

    shape: tuple[int, int, int, int, int]  # [L, 2, T, H, D] of the encoded KV
    level: int  # the level it was encoded at (a key of LEVELS)
    group_size: int  # tokens per anchor group
    bytes: int  # the whole stream's length, header included


class Header(NamedTuple):
    """The header's fields after magic and version, in their order."""

    level: int  # the level it was encoded at (a key of LEVELS)
    group_size: int  # tokens per anchor group (GROUP_SIZE: the only one this decoder knows)
    anchor_c: int  # anchors are quantized to q in [-anchor_c, anchor_c]
    layers: int  # L
    tokens: int  # T
    heads: int  # H, the KV heads
    head_dim: int  # D
    total_bytes: int  # the whole stream's length, header included
    payload_words: int  # uint32 words of the range-coded payload


class Layout(NamedTuple):
    """Where each section starts, from the header alone (the tables' counts are variable)."""

    delta_bins: int  # offset of uint8 [L, 2]
    anchor_scales: int  # offset of float16 [L, 2, C]
    delta_scales: int  # offset of float16 [L, 2, C]
    table_lo: int  # offset of uint8 lo[n]
    table_width: int  # offset of uint8 width[n]
    table_counts: int  # offset of the concatenated counts
    num_tables: int  # n


def layout(h: Header) -> Layout:
    channels = h.heads * h.head_dim
    delta_bins = HEADER_SIZE
    anchor_scales = delta_bins + h.layers * 2
    delta_scales = anchor_scales + h.layers * 2 * channels * 2
    table_lo = delta_scales + h.layers * 2 * channels * 2
    num_tables = 2 + h.layers * 2 * h.heads
    return Layout(
        delta_bins,
        anchor_scales,
        delta_scales,
        table_lo,
        table_lo + num_tables,
        table_lo + 2 * num_tables,
        num_tables,
    )


def pack_header(h: Header) -> bytes:
    """The header's bytes, its CRC included."""
    header = HEADER_FIELDS.pack(MAGIC, VERSION, *h)
    return header + HEADER_CRC.pack(zlib.crc32(header))


def as_bytes(data: Buffer | np.ndarray | torch.Tensor) -> memoryview:
    """bytes, bytearray, memoryview, a uint8 numpy array or a uint8 CPU tensor, as bytes."""
    if isinstance(data, torch.Tensor):
        if data.dtype != torch.uint8 or data.dim() != 1:
            raise TypeError(f"a CacheGen stream tensor must be flat uint8, got {data.dtype}")
        data = data.cpu().numpy()
    if isinstance(data, np.ndarray):
        if data.dtype != np.uint8:
            raise TypeError(f"a CacheGen stream array must be uint8, got {data.dtype}")
        return np.ascontiguousarray(data).reshape(-1).data.cast("B")  # (.data: its memoryview)
    try:
        return memoryview(data).cast("B")
    except TypeError:
        raise TypeError(
            f"a CacheGen stream must be bytes-like, got {type(data).__name__}"
        ) from None


def read_header(buf: memoryview) -> Header:
    """The header, checked: its CRC, and every field against what this decoder knows."""
    if len(buf) < HEADER_SIZE:
        raise CachegenCorrupt(f"stream of {len(buf)} bytes is shorter than its header")
    magic, version, *fields = HEADER_FIELDS.unpack_from(buf, 0)
    if magic != MAGIC:
        raise CachegenCorrupt(f"bad magic {bytes(magic)!r}, not a CacheGen stream")
    if version != VERSION:
        raise CachegenCorrupt(f"unsupported CacheGen stream version {version}")
    (crc,) = HEADER_CRC.unpack_from(buf, HEADER_FIELDS.size)
    if crc != zlib.crc32(buf[: HEADER_FIELDS.size]):
        raise CachegenCorrupt("header checksum mismatch")
    h = Header(*fields)
    if h.level not in LEVELS:
        raise CachegenCorrupt(f"unknown level {h.level}")
    if h.group_size != GROUP_SIZE:
        raise CachegenCorrupt(f"group size {h.group_size}, this decoder knows {GROUP_SIZE}")
    if h.anchor_c != (LEVELS[h.level].anchor_bins - 1) // 2:
        raise CachegenCorrupt(f"anchor range {h.anchor_c} disagrees with level {h.level}")
    shape = [h.layers, 2, h.tokens, h.heads, h.head_dim]
    if min(shape) < 1:
        raise CachegenCorrupt(f"empty shape {shape}")
    if h.layers * 2 * h.tokens * h.heads * h.head_dim > MAX_NUMBERS:
        raise CachegenCorrupt(f"shape {shape} exceeds {MAX_NUMBERS} numbers")
    return h
