"""The encoded block as tensors: encoding a block tensor into the block format
(kvstore/block_header.py: a header, then per-layer payloads, so one layer can be written or sent
before the next is computed) and decoding it back, with the codec's sizes checked."""

from __future__ import annotations

import functools
import warnings

import torch

from kvstore.block_header import (
    DTYPE_NAMES,
    BlockCorrupt,
    BlockHeader,
    check_bytes,
    check_shape,
    checksum,
    header,
    pack_header,
    pad,
    read_header,
)
from kvstore.client.codecs import copy_bytes, get_codec

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_NAMES}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"unsupported block dtype {dtype}") from None


def make_header(
    codec: str,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    fingerprint: str,
    checksums: tuple[int, ...] | None = None,
) -> BlockHeader:
    """The header of a block (checksums zero until the layers are known)."""
    get_codec(codec)
    name = dtype_name(dtype)
    shape = check_shape(name, shape)  # before the codec sizes it
    return header(codec, name, shape, fingerprint, _layer_bytes(codec, name, shape), checksums)


@functools.lru_cache(maxsize=256)
def _layer_bytes(codec: str, dtype: str, shape: tuple[int, ...]) -> int:
    """An encoded layer's bytes, padded: the codec's size for this shape and dtype."""
    return pad(get_codec(codec).layer_nbytes(shape[1:], DTYPES[dtype]))


def parse_header(data) -> BlockHeader:
    """Parse and check a header (not the payload), its codec's sizes too, as a reader that decodes
    the block needs; BlockCorrupt names what is wrong."""
    h = read_header(data)
    try:
        fits = _layer_bytes(h.codec, h.dtype_name, h.shape) == h.layer_bytes
    except ValueError as e:  # an unknown codec, or a shape the codec cannot hold
        raise BlockCorrupt(f"malformed block header: {e}") from None
    if not fits:
        raise BlockCorrupt("block header lengths disagree with its shape and codec")
    return h


def check_block(data, fingerprint: str = "", payload: bool = True) -> BlockHeader:
    """Parse the header (parse_header) and check length, (if given) the fingerprint and (unless
    payload is False) every layer's checksum."""
    return check_bytes(data, fingerprint, payload, parse=parse_header)


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
