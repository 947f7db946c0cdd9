"""The encoded block's header and its byte-level checks, without torch: what a store node needs.

A node stores, checks and serves blocks but never decodes one, so it reads headers for their
lengths, fingerprint and checksums and treats the codec and dtype as names (their sizes are
checked where a block is decoded: `kvstore.client.block_format.parse_header`). Importing torch alone
costs a process ~170 MB, and a store node holds no tensors.

Layout: [header, padded to 64 B][layer 0][layer 1]...; each layer is `layer_bytes` long (the codec's
size rounded up to 64 B) and has its own xxh3-64 checksum in the header, so a reader can check each
layer as it arrives. The header carries a checksum of itself.
"""

from __future__ import annotations

import functools
import struct
from typing import NamedTuple

import numpy as np
import xxhash

MAGIC = b"HMKV"
FORMAT_VERSION = 1
ALIGN = 64

_PREFIX = struct.Struct("<4sHHI")  # magic, version, bytes before the checksum table, header_len
_U64 = struct.Struct("<Q")

# the dtypes a block may hold, by torch's name for them
DTYPE_NAMES = ("float32", "float16", "bfloat16", "float8_e4m3fn", "int8", "uint8")


class BlockCorrupt(ValueError):
    """An encoded block that fails its checks (bad header, wrong length, checksum mismatch)."""


class BlockHeader(NamedTuple):
    version: int  # format version
    codec: str  # codec name (kvstore.CODECS)
    dtype_name: str  # the decoded block's dtype, by name (one of DTYPE_NAMES)
    fingerprint: str  # model fingerprint the block was computed with
    shape: tuple[int, ...]  # decoded block shape, layer-major: [L, 2, T, H, D] or [L, T, C]
    layer_bytes: int  # bytes of one encoded layer, padded to 64
    payload_len: int  # L * layer_bytes
    checksums: tuple[int, ...]  # xxh3-64 of each encoded layer (padding included)
    header_len: int  # header bytes, padded to 64; layer l starts at header_len + l * layer_bytes

    @property
    def dtype(self):
        """The decoded block's torch dtype (torch is imported here, by readers that decode)."""
        import torch

        return getattr(torch, self.dtype_name)

    @property
    def num_layers(self) -> int:
        return self.shape[0]

    @property
    def total_len(self) -> int:
        return self.header_len + self.payload_len

    def layer_offset(self, layer: int) -> int:
        return self.header_len + layer * self.layer_bytes


def pad(n: int) -> int:
    """n rounded up to ALIGN."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


def checksum(data) -> int:
    return xxhash.xxh3_64_intdigest(data)


def check_shape(dtype_name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """`shape` as ints, if a block of `dtype_name` may have it; else ValueError naming why."""
    shape = tuple(int(s) for s in shape)
    if dtype_name not in DTYPE_NAMES:
        raise ValueError(f"unsupported block dtype {dtype_name}")
    if len(shape) not in (2, 3, 5) or any(s <= 0 for s in shape):
        raise ValueError(
            "block shape must be [L, 2, T, H, D], [L, T, C] or [L, bytes] with positive sizes, "
            f"got {list(shape)}"
        )
    if len(shape) == 2 and dtype_name != "uint8":
        # [L, bytes]: a block a layout packed already (KIVI), one opaque record per layer
        raise ValueError(f"block shape [L, bytes] needs dtype uint8, got torch.{dtype_name}")
    if len(shape) == 5 and shape[1] != 2:
        raise ValueError(f"block shape [L, 2, T, H, D] needs 2 at axis 1, got {list(shape)}")
    return shape


def header(
    codec: str,
    dtype_name: str,
    shape: tuple[int, ...],
    fingerprint: str,
    layer_bytes: int,
    checksums: tuple[int, ...] | None = None,
) -> BlockHeader:
    """The header of a block whose encoded layers are `layer_bytes` long (a multiple of ALIGN;
    checksums zero until the layers are known); ValueError names a field that cannot be."""
    shape = check_shape(dtype_name, shape)
    if layer_bytes <= 0 or layer_bytes % ALIGN:
        raise ValueError(f"encoded layers must be a positive multiple of {ALIGN} bytes")
    fp = fingerprint.encode()
    if len(fp) > 0xFFFF:
        raise ValueError("model fingerprint too long")
    body_len = (
        _PREFIX.size
        + 1
        + len(codec)
        + 1
        + len(dtype_name)
        + 2
        + len(fp)
        + 1
        + 4 * len(shape)
        + 16
        + 8 * shape[0]
        + 8
    )
    sums = tuple(checksums) if checksums is not None else (0,) * shape[0]
    if len(sums) != shape[0]:
        raise ValueError("one checksum per layer")
    return BlockHeader(
        FORMAT_VERSION,
        codec,
        dtype_name,
        fingerprint,
        shape,
        layer_bytes,
        layer_bytes * shape[0],
        sums,
        pad(body_len),
    )


def pack_header(h: BlockHeader) -> bytes:
    fixed, sums_struct = _packed_fixed(h[:7] + h[8:])
    body = fixed + sums_struct.pack(*h.checksums)
    return body + _U64.pack(checksum(body)) + bytes(h.header_len - len(body) - 8)


@functools.lru_cache(maxsize=256)
def _packed_fixed(key: tuple) -> tuple[bytes, struct.Struct]:
    """The bytes before the checksum table of a header with these fields (all but checksums),
    and the table's struct: one per model and codec, so a put packs each header by one join."""
    h = BlockHeader._make((*key[:7], (), key[7]))
    codec, dt, fp = h.codec.encode(), h.dtype_name.encode(), h.fingerprint.encode()
    fields = [
        bytes([len(codec)]),
        codec,
        bytes([len(dt)]),
        dt,
        struct.pack("<H", len(fp)),
        fp,
        bytes([len(h.shape)]),
        struct.pack(f"<{len(h.shape)}I", *h.shape),
        struct.pack("<QQ", h.layer_bytes, h.payload_len),
    ]
    fixed_len = _PREFIX.size + sum(len(f) for f in fields)
    fixed = b"".join([_PREFIX.pack(MAGIC, h.version, fixed_len, h.header_len), *fields])
    return fixed, struct.Struct(f"<{h.num_layers}Q")


@functools.lru_cache(maxsize=256)
def _layout(fixed: bytes) -> tuple[BlockHeader, struct.Struct]:
    """The header encoded by `fixed` (everything before the checksum table), checksums zero, and
    the struct of its checksum table. Blocks of one model share them, so parsing a header is a
    lookup, two unpacks and a hash."""
    mv = memoryview(fixed)
    _, _, fixed_len, header_len = _PREFIX.unpack_from(mv, 0)
    pos = _PREFIX.size

    def take(n: int) -> bytes:
        nonlocal pos
        if pos + n > fixed_len:
            raise BlockCorrupt("truncated header")
        out = bytes(mv[pos : pos + n])
        pos += n
        return out

    codec = take(take(1)[0]).decode()
    dt = take(take(1)[0]).decode()
    fp = take(struct.unpack("<H", take(2))[0]).decode()
    ndim = take(1)[0]
    shape = struct.unpack(f"<{ndim}I", take(4 * ndim))
    layer_bytes, payload_len = struct.unpack("<QQ", take(16))
    if pos != fixed_len:
        raise BlockCorrupt("header fields do not fill the fixed part")
    if ndim not in (2, 3, 5):
        raise BlockCorrupt(f"bad block rank {ndim}")
    if fixed_len + 8 * (shape[0] + 1) > header_len:
        raise BlockCorrupt("header too short for its checksum table")
    if dt not in DTYPE_NAMES:
        raise BlockCorrupt(f"unknown dtype {dt!r}")
    h = header(codec, dt, shape, fp, layer_bytes)
    if h.header_len != header_len or h.payload_len != payload_len:
        raise BlockCorrupt("block header lengths disagree with its shape and codec")
    return h, struct.Struct(f"<{shape[0]}Q")


def read_header(data) -> BlockHeader:
    """Parse and check a header's bytes (not the payload, and not its codec's sizes: see
    block_format.parse_header); BlockCorrupt names what is wrong."""
    mv = memoryview(data).cast("B")
    try:
        magic, version, fixed_len, header_len = _PREFIX.unpack_from(mv, 0)
        if magic != MAGIC:
            raise BlockCorrupt("not an encoded KV block (bad magic)")
        if version != FORMAT_VERSION:
            raise BlockCorrupt(f"unsupported block format version {version}")
        if header_len > len(mv) or header_len % ALIGN or not _PREFIX.size < fixed_len < header_len:
            raise BlockCorrupt(f"header length {header_len} invalid for {len(mv)} bytes")
        base, sums_struct = _layout(bytes(mv[:fixed_len]))
        end = fixed_len + sums_struct.size
        if end + 8 > header_len:
            raise BlockCorrupt("truncated header")
        (hsum,) = _U64.unpack_from(mv, end)
        if checksum(mv[:end]) != hsum:
            raise BlockCorrupt("header checksum mismatch")
        # every field but the checksums is the layout's (a tuple build: _replace is slow per block)
        return BlockHeader._make((*base[:7], sums_struct.unpack_from(mv, fixed_len), base[8]))
    except BlockCorrupt:
        raise
    except (struct.error, UnicodeDecodeError, ValueError, NotImplementedError, IndexError) as e:
        raise BlockCorrupt(f"malformed block header: {e}") from None


def fixed_fields(h: BlockHeader) -> bytes:
    """The bytes a packed header of `h` begins with, before its checksum table: the same in
    every block of one layout (what a writer sealing many headers at once copies into each)."""
    return _packed_fixed(h[:7] + h[8:])[0]


def table_offsets(data, h: BlockHeader) -> tuple[int, int]:
    """Where the header `data` begins with (parsed as `h`) holds its layers' checksum table and
    its own checksum (a hash of every byte before it): what a reader checking many blocks of one
    layout in one pass needs (kernels.copy_checked). The bytes before the table are the layout's
    fixed fields, the same in every block of it."""
    (fixed_len,) = struct.unpack_from("<H", data, 6)
    return fixed_len, fixed_len + 8 * h.num_layers


def check_bytes(
    data, fingerprint: str = "", payload: bool = True, parse=read_header
) -> BlockHeader:
    """The header `parse` reads from data, after checking the block's length, (if given) the
    fingerprint and (unless payload is False) every layer's checksum."""
    mv = memoryview(data).cast("B")
    h = parse(mv)
    if len(mv) != h.total_len:
        raise BlockCorrupt(f"block is {len(mv)} bytes, its header says {h.total_len}")
    if fingerprint and h.fingerprint != fingerprint:
        raise BlockCorrupt(
            f"model fingerprint {h.fingerprint!r} is not this store's {fingerprint!r}"
        )
    if not payload:
        return h
    lb, sums = h.layer_bytes, h.checksums
    for layer, off in enumerate(range(h.header_len, h.total_len, lb)):
        if checksum(mv[off : off + lb]) != sums[layer]:
            raise BlockCorrupt(f"checksum mismatch in layer {layer}")
    return h


def check_headers(array: np.ndarray, offsets: list[int], sizes: list[int], fingerprint: str = ""):
    """check_bytes(payload=False) of each block array[offsets[i]:][:sizes[i]] (a flat uint8
    array: the slab), in one pass where the blocks share the first one's layout: a put's commit
    of many blocks of one model. A block whose bytes before its checksum table are the first
    block's, whose length is the first block's and whose header checksum holds parses to the
    first block's header but for its layers' checksums, so per block only that checksum is
    hashed (256 headers: ~0.1 ms, against ~0.6 parsing each). Any other block is checked alone.
    BlockCorrupt (naming the block) at the first that fails."""
    if not offsets:
        return
    first = array[offsets[0] : offsets[0] + sizes[0]]
    h = _checked(first, fingerprint, 0)
    fixed_len, end = table_offsets(first, h)
    off = np.asarray(offsets, dtype=np.int64)[:, None]
    # the fixed fields and the header's checksum of every block (indices clipped: a block too
    # short to hold them differs in length, and is checked alone below)
    last = len(array) - 1
    same = (array[np.minimum(off + np.arange(fixed_len), last)] == first[:fixed_len]).all(axis=1)
    same &= np.asarray(sizes) == h.total_len
    stored = array[np.minimum(off + np.arange(end, end + 8), last)].copy().view("<u8")[:, 0]
    mv = array.data  # a memoryview of the same bytes
    hashed = [checksum(mv[o : o + end]) if ok else 0 for o, ok in zip(offsets, same.tolist())]
    for i in np.flatnonzero(~same | (np.asarray(hashed, dtype=np.uint64) != stored)).tolist():
        _checked(array[offsets[i] : offsets[i] + sizes[i]], fingerprint, i)


def _checked(data, fingerprint: str, i: int) -> BlockHeader:
    try:
        return check_bytes(data, fingerprint, payload=False)
    except BlockCorrupt as e:
        raise BlockCorrupt(f"block {i}: {e}") from None


def layer_ok(data, h: BlockHeader, layer: int, base: int = 0) -> bool:
    """Whether layer `layer` of the block starting at `base` in `data` matches its checksum."""
    off = base + h.layer_offset(layer)
    return checksum(memoryview(data)[off : off + h.layer_bytes]) == h.checksums[layer]
