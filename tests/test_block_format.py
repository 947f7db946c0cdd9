"""The encoded block format: round trips, and every kind of damage is caught as BlockCorrupt."""

from __future__ import annotations

import struct

import pytest
import torch

from kvstore import FORMAT_VERSION, BlockCorrupt
from kvstore.block_header import ALIGN, layer_ok
from kvstore.client import check_block, decode_block, encode_block, parse_header


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 2, 16, 3, 8), (2, 2, 5, 1, 7), (4, 16, 24)])
def test_raw_round_trip_is_exact(dtype, shape):
    x = torch.randn(shape).to(dtype)
    data = encode_block(x, "model-a")
    h = parse_header(data)
    assert h.version == FORMAT_VERSION and h.codec == "raw" and h.dtype == dtype
    assert h.shape == shape and h.fingerprint == "model-a" and h.num_layers == shape[0]
    assert h.header_len % ALIGN == 0 and h.layer_bytes % ALIGN == 0
    assert len(data) == h.total_len == h.header_len + h.num_layers * h.layer_bytes
    y = decode_block(data, model_fingerprint="model-a")
    assert y.dtype == dtype and torch.equal(y, x)


def test_layers_are_contiguous_and_independently_checked():
    x = torch.randn(3, 2, 4, 2, 8)
    data = bytearray(encode_block(x, "fp"))
    h = parse_header(data)
    for layer in range(3):  # each layer's bytes are exactly that layer's tensor (raw codec)
        off = h.layer_offset(layer)
        got = torch.frombuffer(bytes(data[off : off + x[layer].numel() * 4]), dtype=torch.float32)
        assert torch.equal(got, x[layer].reshape(-1))
    data[h.layer_offset(1) + 5] ^= 0x10
    assert layer_ok(data, h, 0) and not layer_ok(data, h, 1) and layer_ok(data, h, 2)
    with pytest.raises(BlockCorrupt, match="layer 1"):
        check_block(data)


def test_every_payload_byte_is_covered():
    data = encode_block(torch.randn(2, 2, 2, 1, 16), "fp")
    h = parse_header(data)
    for pos in range(h.header_len, len(data), 37):
        bad = bytearray(data)
        bad[pos] ^= 1
        with pytest.raises(BlockCorrupt):
            decode_block(bytes(bad))


def test_header_damage_is_caught():
    data = encode_block(torch.randn(2, 2, 2, 1, 16), "fp")
    h = parse_header(data)
    for pos in range(0, h.header_len - 1):
        bad = bytearray(data)
        bad[pos] ^= 0x41
        try:
            got = parse_header(bytes(bad))
        except BlockCorrupt:
            continue
        # only padding after the header checksum may change without notice
        assert got == h, f"header byte {pos} changed the header unnoticed"


@pytest.mark.parametrize("damage", ["truncate", "extend", "magic", "version", "empty"])
def test_malformed_blocks(damage):
    data = bytearray(encode_block(torch.randn(2, 2, 2, 1, 16), "fp"))
    if damage == "truncate":
        data = data[:-1]
    elif damage == "extend":
        data += b"\0" * 64
    elif damage == "magic":
        data[:4] = b"NOPE"
    elif damage == "version":
        data[4:6] = struct.pack("<H", FORMAT_VERSION + 1)
    else:
        data = b""
    with pytest.raises(BlockCorrupt):
        decode_block(bytes(data))


def test_wrong_fingerprint_and_wrong_out():
    x = torch.randn(2, 2, 2, 1, 16)
    data = encode_block(x, "model-a")
    with pytest.raises(BlockCorrupt, match="fingerprint"):
        decode_block(data, model_fingerprint="model-b")
    with pytest.raises(BlockCorrupt):
        decode_block(data, out=torch.empty(2, 2, 2, 1, 16, dtype=torch.float16))
    out = torch.empty_like(x)
    assert decode_block(data, out=out) is out and torch.equal(out, x)


def test_bad_shapes_refused_at_encode():
    with pytest.raises(ValueError):
        encode_block(torch.randn(2, 3, 2, 1, 16), "fp")  # axis 1 must be K/V
    with pytest.raises(ValueError):
        encode_block(torch.randn(2, 16), "fp")
    with pytest.raises(ValueError):
        encode_block(torch.randn(2, 2, 2, 1, 16), "fp", codec="nope")
