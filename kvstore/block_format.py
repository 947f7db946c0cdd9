"""The encoded block: a header (version, fingerprint, codec, shape, dtype, lengths, checksums) and
per-layer payloads, so one layer can be written or sent before the next is computed.

Layout: [header, padded to 64 B][layer 0][layer 1]...; each layer is `layer_bytes` long (the codec's
size rounded up to 64 B) and has its own xxh3-64 checksum in the header, so a reader can check each
layer as it arrives. The header carries a checksum of itself.
"""

from __future__ import annotations

import functools
import struct
import warnings
from typing import NamedTuple

import torch
import xxhash

from kvstore.codecs import copy_bytes, get_codec

MAGIC = b"HMKV"
FORMAT_VERSION = 1
ALIGN = 64

_PREFIX = struct.Struct("<4sHHI")  # magic, version, bytes before the checksum table, header_len
_U64 = struct.Struct("<Q")

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "int8": torch.int8,
    "uint8": torch.uint8,
}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class BlockCorrupt(ValueError):
    """An encoded block that fails its checks (bad header, wrong length, checksum mismatch)."""


class BlockHeader(NamedTuple):
    version: int  # format version
    codec: str  # codec name (kvstore.CODECS)
    dtype: torch.dtype  # the decoded block's dtype
    fingerprint: str  # model fingerprint the block was computed with
    shape: tuple[int, ...]  # decoded block shape, layer-major: [L, 2, T, H, D] or [L, T, C]
    layer_bytes: int  # bytes of one encoded layer, padded to 64
    payload_len: int  # L * layer_bytes
    checksums: tuple[int, ...]  # xxh3-64 of each encoded layer (padding included)
    header_len: int  # header bytes, padded to 64; layer l starts at header_len + l * layer_bytes

    @property
    def num_layers(self) -> int:
        return self.shape[0]

    @property
    def total_len(self) -> int:
        return self.header_len + self.payload_len

    def layer_offset(self, layer: int) -> int:
        return self.header_len + layer * self.layer_bytes


def _pad(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"unsupported block dtype {dtype}") from None


def checksum(data) -> int:
    return xxhash.xxh3_64_intdigest(data)


def make_header(
    codec: str,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    fingerprint: str,
    checksums: tuple[int, ...] | None = None,
) -> BlockHeader:
    """The header of a block (checksums zero until the layers are known)."""
    shape = tuple(int(s) for s in shape)
    c = get_codec(codec)
    dtype_name(dtype)
    if len(shape) not in (2, 3, 5) or any(s <= 0 for s in shape):
        raise ValueError(
            "block shape must be [L, 2, T, H, D], [L, T, C] or [L, bytes] with positive sizes, "
            f"got {list(shape)}"
        )
    if len(shape) == 2 and dtype != torch.uint8:
        # [L, bytes]: a block a layout packed already (KIVI), one opaque record per layer
        raise ValueError(f"block shape [L, bytes] needs dtype uint8, got {dtype}")
    if len(shape) == 5 and shape[1] != 2:
        raise ValueError(f"block shape [L, 2, T, H, D] needs 2 at axis 1, got {list(shape)}")
    layer_bytes = _pad(c.layer_nbytes(shape[1:], dtype))
    fp = fingerprint.encode()
    if len(fp) > 0xFFFF:
        raise ValueError("model fingerprint too long")
    body_len = (
        _PREFIX.size
        + 1
        + len(codec)
        + 1
        + len(dtype_name(dtype))
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
        dtype,
        fingerprint,
        shape,
        layer_bytes,
        layer_bytes * shape[0],
        sums,
        _pad(body_len),
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
    codec, dt, fp = h.codec.encode(), dtype_name(h.dtype).encode(), h.fingerprint.encode()
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
    if dt not in DTYPES:
        raise BlockCorrupt(f"unknown dtype {dt!r}")
    h = make_header(codec, DTYPES[dt], shape, fp)
    if h.header_len != header_len or h.layer_bytes != layer_bytes or h.payload_len != payload_len:
        raise BlockCorrupt("block header lengths disagree with its shape and codec")
    return h, struct.Struct(f"<{shape[0]}Q")


def parse_header(data) -> BlockHeader:
    """Parse and check a header (not the payload); BlockCorrupt names what is wrong."""
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


def check_block(data, fingerprint: str = "", payload: bool = True) -> BlockHeader:
    """Parse the header and check length, (if given) the fingerprint and (unless payload is
    False) every layer's checksum."""
    mv = memoryview(data).cast("B")
    h = parse_header(mv)
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


def layer_ok(data, h: BlockHeader, layer: int, base: int = 0) -> bool:
    """Whether layer `layer` of the block starting at `base` in `data` matches its checksum."""
    off = base + h.layer_offset(layer)
    return checksum(memoryview(data)[off : off + h.layer_bytes]) == h.checksums[layer]


def encode_block(block: torch.Tensor, model_fingerprint: str, codec: str = "raw") -> bytes:
    """Encode one block tensor [L, ...] into the block format."""
    h = make_header(codec, block.dtype, tuple(block.shape), model_fingerprint)
    buf = torch.zeros(h.total_len, dtype=torch.uint8)
    sums = encode_layers_into(block, h, buf, range(h.num_layers))
    buf[: h.header_len].copy_(u8view(pack_header(h._replace(checksums=tuple(sums)))))
    return buf.numpy().tobytes()


def encode_layers_into(block: torch.Tensor, h: BlockHeader, buf: torch.Tensor, layers) -> list[int]:
    """Encode the given layers of `block` into `buf` (uint8, the whole encoded block); their
    checksums."""
    codec = get_codec(h.codec)
    n = codec.layer_nbytes(h.shape[1:], h.dtype)
    sums = []
    for layer in layers:
        off = h.layer_offset(layer)
        codec.encode_layer(block[layer], buf[off : off + n])
        sums.append(checksum(buf[off : off + h.layer_bytes].numpy()))
    return sums


def decode_block(
    data, out: torch.Tensor | None = None, model_fingerprint: str = ""
) -> torch.Tensor:
    """Decode an encoded block (checking it) into `out` or a new tensor; BlockCorrupt if it fails a
    check."""
    h = check_block(data, model_fingerprint)
    if out is None:
        out = torch.empty(h.shape, dtype=h.dtype)
    elif tuple(out.shape) != h.shape or out.dtype != h.dtype:
        raise BlockCorrupt(
            f"block is {list(h.shape)} {h.dtype}, out is {list(out.shape)} {out.dtype}"
        )
    decode_layers(u8view(data), h, out, range(h.num_layers))
    return out


def u8view(data) -> torch.Tensor:
    """A uint8 tensor over any buffer without a copy (read-only buffers too: readers never
    write)."""
    mv = memoryview(data).cast("B")
    if len(mv) == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mv, dtype=torch.uint8)


def decode_layers(
    src: torch.Tensor, h: BlockHeader, out: torch.Tensor, layers, base: int = 0
) -> None:
    """Decode layers of the encoded block at src[base:] into out[layer] (no checks)."""
    codec = get_codec(h.codec)
    n = codec.layer_nbytes(h.shape[1:], h.dtype)
    layers = list(layers)
    if (
        codec.name == "raw"
        and n == h.layer_bytes
        and len(layers) == h.num_layers
        and out.is_contiguous()
    ):
        # unpadded raw layers are the block tensor's bytes as they are: one copy for all of them
        off = base + h.header_len
        copy_bytes(out.view(-1).view(torch.uint8), src[off : off + h.payload_len])
        return
    for layer in layers:
        off = base + h.layer_offset(layer)
        codec.decode_layer(src[off : off + n], out[layer])
