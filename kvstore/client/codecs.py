"""Codecs: how one layer of a KV block becomes bytes and back. Each knows its bytes per token."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import numpy as np
import torch

import kernels


def block_tokens(block_shape: tuple[int, ...]) -> int:
    """Tokens in a block: [L, 2, T, H, D] (MHA/GQA) or [L, T, C] (latent cache)."""
    if len(block_shape) == 5:
        return block_shape[2]
    if len(block_shape) == 3:
        return block_shape[1]
    raise ValueError(f"block shape must be [L, 2, T, H, D] or [L, T, C], got {list(block_shape)}")


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[:] = src for flat uint8 CPU tensors, as one plain memcpy: torch's copy_ splits a copy
    over its thread pool, which stalls for milliseconds when the cores are busy elsewhere."""
    if dst.device.type != "cpu" or src.device.type != "cpu":
        dst.copy_(src)
        return
    np.copyto(dst.numpy(), src.numpy())


class Codec(ABC):
    """Encodes one layer ([2, T, H, D] or [T, C]) into a flat uint8 buffer and decodes it back."""

    name: str
    lossless: bool

    @abstractmethod
    def layer_nbytes(self, layer_shape: tuple[int, ...], dtype: torch.dtype) -> int:
        """Encoded bytes of one layer."""
        ...

    @abstractmethod
    def encode_layer(self, layer: torch.Tensor, out: torch.Tensor) -> None:
        """Write `layer` encoded into `out` (uint8, exactly layer_nbytes long)."""
        ...

    @abstractmethod
    def decode_layer(self, data: torch.Tensor, out: torch.Tensor) -> None:
        """Decode `data` (uint8, layer_nbytes long) into `out` (the layer tensor, its dtype and
        shape)."""
        ...

    def bytes_per_token(self, block_shape: tuple[int, ...], dtype: torch.dtype) -> float:
        """Encoded bytes per token over all layers of a block of this shape."""
        return (
            block_shape[0]
            * self.layer_nbytes(tuple(block_shape[1:]), dtype)
            / block_tokens(block_shape)
        )


class RawCodec(Codec):
    """The model's dtype, bit for bit."""

    name = "raw"
    lossless = True

    def layer_nbytes(self, layer_shape, dtype):
        return math.prod(layer_shape) * dtype.itemsize

    def encode_layer(self, layer, out):
        copy_bytes(out, layer.contiguous().reshape(-1).view(torch.uint8))

    def decode_layer(self, data, out):
        copy_bytes(out.view(-1).view(torch.uint8), data)


class Int8Codec(Codec):
    """Symmetric int8 with one fp32 scale per vector of the last axis (per token, per head)."""

    name = "int8"
    lossless = False

    def layer_nbytes(self, layer_shape, dtype):
        n = math.prod(layer_shape)
        return n + 4 * (n // layer_shape[-1])

    def encode_layer(self, layer, out):
        x = layer.float()
        scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / 127.0
        q = torch.round(x / scale).clamp_(-127, 127).to(torch.int8)
        n = q.numel()
        out[:n].copy_(q.reshape(-1).view(torch.uint8))
        out[n:].copy_(scale.reshape(-1).view(torch.uint8))

    def decode_layer(self, data, out):
        n = out.numel()
        q = data[:n].view(torch.int8).reshape(out.shape)
        scale = data[n:].clone().view(torch.float32).reshape(*out.shape[:-1], 1)
        out.copy_(q.float() * scale)


class KiviCodec(Codec):
    """KIVI through the kernels package: keys quantized per channel, values per token, to `bits`
    bits with float16 scales and zero points (groups of 32)."""

    lossless = False
    group_size = 32

    def __init__(self, bits: int):
        self.bits = bits
        self.name = f"kivi{bits}"

    @staticmethod
    def _check(layer_shape):
        if len(layer_shape) != 4 or layer_shape[0] != 2:
            raise ValueError(f"KIVI codecs need a [2, T, H, D] layer, got {list(layer_shape)}")

    def layer_nbytes(self, layer_shape, dtype):
        self._check(layer_shape)
        _, t, h, d = layer_shape
        return int(kernels.kivi_packed_nbytes(t, h, d, self.bits, self.group_size))

    def encode_layer(self, layer, out):
        self._check(tuple(layer.shape))
        packed = kernels.kivi_quantize(layer, self.bits, self.group_size)
        off = 0
        for field in packed:  # kivi_to_bytes's layout, written in place
            b = field.contiguous().reshape(-1).view(torch.uint8)
            copy_bytes(out[off : off + b.numel()], b)
            off += b.numel()

    def decode_layer(self, data, out):
        self._check(tuple(out.shape))
        _, t, h, d = out.shape
        packed = kernels.kivi_from_bytes(data.numpy(), t, h, d, self.bits, self.group_size)
        out.copy_(kernels.kivi_dequantize(packed, out.dtype))


class CachegenRecordCodec(Codec):
    """A CacheGen bitstream (kvstore/cachegen.py) carried whole as a block's one record:
    [1, bytes] uint8. The payload is already encoded; this codec copies it and names its level in
    the header (cachegen_encode/cachegen_decode turn KV into the bitstream and back)."""

    lossless = False

    def __init__(self, level: int):
        self.level = level
        self.name = f"cachegen{level}"

    def layer_nbytes(self, layer_shape, dtype):
        if len(layer_shape) != 1 or dtype != torch.uint8:
            raise ValueError(f"{self.name} records are [1, bytes] uint8, got {list(layer_shape)}")
        return int(layer_shape[0])

    def encode_layer(self, layer, out):
        copy_bytes(out, layer.reshape(-1))

    def decode_layer(self, data, out):
        copy_bytes(out.reshape(-1), data)


def _cachegen_levels() -> list[int]:
    from kvstore.client.cachegen import LEVELS

    return sorted(LEVELS)


# name -> codec; the name is what the block header records.
CODECS: dict[str, Codec] = {
    c.name: c
    for c in (
        RawCodec(),
        Int8Codec(),
        KiviCodec(4),
        KiviCodec(2),
        *(CachegenRecordCodec(level) for level in _cachegen_levels()),
    )
}


def get_codec(name: str) -> Codec:
    try:
        return CODECS[name]
    except KeyError:
        raise ValueError(f"unknown codec {name!r}; known: {', '.join(CODECS)}") from None
