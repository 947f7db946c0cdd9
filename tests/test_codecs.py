"""Codecs: raw is exact, int8 stays within half a quantization step, each knows its size."""

from __future__ import annotations

import pytest
import torch

from kvstore.client import CODECS, decode_block, encode_block, parse_header


def test_registry_names():
    assert {"raw", "int8", "kivi4", "kivi2"} <= set(CODECS)
    assert all(c.name == name for name, c in CODECS.items())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_error_within_half_a_step(dtype):
    torch.manual_seed(0)
    x = (torch.randn(3, 2, 16, 3, 8) * torch.logspace(-3, 2, 8)).to(dtype)
    y = decode_block(encode_block(x, "fp", codec="int8"))
    assert y.dtype == dtype and y.shape == x.shape
    step = x.float().abs().amax(dim=-1, keepdim=True) / 127
    # half a step of quantization plus the rounding of the output dtype
    tol = step / 2 + x.float().abs() * (2**-7 if dtype == torch.bfloat16 else 2**-20) + 1e-30
    assert ((y.float() - x.float()).abs() <= tol).all()
    assert not torch.equal(y, x)  # it is lossy: the check above has teeth


def test_int8_zero_vectors():
    x = torch.zeros(1, 2, 4, 2, 8)
    assert torch.equal(decode_block(encode_block(x, "fp", codec="int8")), x)


@pytest.mark.parametrize("name", ["raw", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_bytes_per_token_matches_the_encoding(name, dtype):
    L, T, H, D = 4, 16, 3, 64
    codec = CODECS[name]
    x = torch.randn(L, 2, T, H, D).to(dtype)
    h = parse_header(encode_block(x, "fp", codec=name))
    per_token = codec.bytes_per_token(h.shape, dtype)
    assert per_token * T == L * codec.layer_nbytes(h.shape[1:], dtype)
    assert h.payload_len >= per_token * T  # padding only adds
    if name == "raw":
        assert per_token == L * 2 * H * D * dtype.itemsize
    else:  # one byte per value, a 4-byte scale per (K/V, head) vector
        assert per_token == L * (2 * H * D + 2 * H * 4)
        assert per_token < CODECS["raw"].bytes_per_token(h.shape, dtype)


@pytest.mark.parametrize("bits", [4, 2])
def test_kivi_round_trip(bits):
    torch.manual_seed(0)
    L, T, H, D = 2, 16, 3, 64
    x = torch.randn(L, 2, T, H, D) * torch.linspace(0.1, 3, D)
    y = decode_block(encode_block(x, "fp", codec=f"kivi{bits}"))
    assert y.shape == x.shape and y.dtype == x.dtype
    levels = 2**bits - 1
    # keys: one group per channel over the block's 16 tokens;
    # values: per token, channels in groups of 32
    k, v = x[:, 0], x[:, 1]
    k_step = (k.amax(dim=1, keepdim=True) - k.amin(dim=1, keepdim=True)) / levels
    vg = v.reshape(L, T, H, D // 32, 32)
    v_step = (
        ((vg.amax(-1, keepdim=True) - vg.amin(-1, keepdim=True)) / levels)
        .expand_as(vg)
        .reshape(L, T, H, D)
    )
    tol = 1.01  # scales are rounded up to float16
    assert ((y[:, 0] - k).abs() <= k_step * tol / 2 + 1e-3).all()
    assert ((y[:, 1] - v).abs() <= v_step * tol / 2 + 1e-3).all()
    assert not torch.equal(y, x)
    fp16_raw = CODECS["raw"].bytes_per_token(tuple(x.shape), torch.float16)
    kivi = CODECS[f"kivi{bits}"].bytes_per_token(tuple(x.shape), torch.float32)
    assert kivi < fp16_raw * (bits + 2) / 16  # codes plus small per-group scales and zeros


def test_kivi_needs_kv_layers():
    with pytest.raises(ValueError):
        encode_block(torch.randn(2, 16, 24), "fp", codec="kivi4")  # a latent cache has no K/V axis


def test_int8_carries_mla_latent_blocks():
    # An MLA block is [L, T, kv_lora_rank + rope]: int8 scales each token's latent row (the
    # per-channel KIVI split has no meaning for a latent; per-row int8 is its analogue here).
    g = torch.Generator().manual_seed(0)
    latent = torch.randn(3, 16, 576, generator=g)
    data = encode_block(latent, "mla-test", codec="int8")
    back = decode_block(data, model_fingerprint="mla-test")
    assert back.shape == latent.shape
    step = latent.abs().amax(dim=-1, keepdim=True) / 127
    assert torch.all((back - latent).abs() <= step / 2 + 1e-6)
    assert len(data) < 0.3 * len(encode_block(latent, "mla-test"))
