"""The CacheGen KV codec (kvstore/cachegen.py): round trips, error bounds per level, sizes, anchors,
corrupt streams, the header, and a real model's KV."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kvstore.client.cachegen import (
    DEFAULT_LEVEL,
    GROUP_SIZE,
    HEADER_FIELDS,
    HEADER_SIZE,
    LEVELS,
    CachegenCorrupt,
    CachegenInfo,
    cachegen_decode,
    cachegen_encode,
    cachegen_info,
    layer_bins,
)
from model import KVPool, load_model

# The tolerance on a bound of step / 2: float16 steps are rounded up by at most 2^-10 relative,
# and the float32 arithmetic adds a few ulps.
SLACK = 1 + 2.0**-9


def fake_kv(layers=4, tokens=64, heads=2, dim=16, seed=0) -> torch.Tensor:
    """KV-like numbers: per-channel offsets, a few outlier channels, a slow drift along the
    tokens (so neighbours are alike, as in real KV) and noise."""
    g = torch.Generator().manual_seed(seed)
    shape = (layers, 2, 1, heads, dim)
    offset = torch.randn(shape, generator=g) * 0.5
    scale = torch.ones(shape)
    scale.view(-1)[:: max(1, scale.numel() // 5)] = 8.0  # outlier channels
    drift = torch.randn(layers, 2, tokens, heads, dim, generator=g).cumsum(dim=2) * 0.05
    noise = torch.randn(layers, 2, tokens, heads, dim, generator=g) * 0.3
    return (offset + drift + noise) * scale


def anchor_mask(tokens: int) -> torch.Tensor:
    return torch.arange(tokens) % GROUP_SIZE == 0


def delta_bound(kv: torch.Tensor, out: torch.Tensor, level: int) -> torch.Tensor:
    """Half a delta step per (layer, K/V, channel), recomputed from the input and the decoded
    anchors (the decoder's anchor values are what the deltas were taken from)."""
    layers, _, tokens, heads, dim = kv.shape
    x = kv.float().reshape(layers, 2, tokens, heads * dim)
    anchors = out.float().reshape(layers, 2, tokens, heads * dim)[:, :, ::GROUP_SIZE]
    pos = torch.arange(tokens)
    pos = pos[pos % GROUP_SIZE != 0]
    delta = x[:, :, pos] - anchors[:, :, pos // GROUP_SIZE]
    c = torch.from_numpy((layer_bins(level, layers).astype(np.int64) - 1) // 2).float()
    return delta.abs().amax(dim=2) / c[:, :, None] / 2 * SLACK


@pytest.fixture(scope="module")
def kv():
    return fake_kv()


@pytest.fixture(scope="module")
def streams(kv):
    return {n: cachegen_encode(kv, n) for n in LEVELS}


# ---------------------------------------------------------------- round trips


def test_levels_table():
    assert 3 <= len(LEVELS) <= 4 and sorted(LEVELS) == list(range(1, len(LEVELS) + 1))
    assert DEFAULT_LEVEL in LEVELS and 1 < DEFAULT_LEVEL < max(LEVELS)  # a middle one
    for spec in LEVELS.values():
        for b in (*spec.key_bins, *spec.value_bins, spec.anchor_bins):
            assert b % 2 == 1 and 3 <= b <= 255
    # Each level has at least the bins of the one below it, everywhere.
    for lo, hi in zip(sorted(LEVELS), sorted(LEVELS)[1:]):
        a, b = LEVELS[lo], LEVELS[hi]
        assert all(x <= y for x, y in zip(a.key_bins + a.value_bins, b.key_bins + b.value_bins))
        assert a.anchor_bins <= b.anchor_bins and a != b
    # Thirds of the model's layers, as fractions (the reference's 0-9 / 10-19 / 20+ of 30).
    bins = layer_bins(DEFAULT_LEVEL, 30)
    spec = LEVELS[DEFAULT_LEVEL]
    layers = (0, 9, 10, 19, 20, 29)
    assert [bins[i, 0] for i in layers] == [spec.key_bins[i // 10] for i in layers]
    assert [bins[i, 1] for i in layers] == [spec.value_bins[i // 10] for i in layers]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip_shape_and_dtype(kv, dtype):
    x = kv.to(dtype)
    data = cachegen_encode(x)
    assert isinstance(data, bytes)
    for out_dtype in (torch.float32, torch.float16, torch.bfloat16):
        out = cachegen_decode(data, out_dtype)
        assert out.shape == x.shape and out.dtype == out_dtype
    out = cachegen_decode(data)
    assert out.dtype == torch.float32
    assert (out - x.float()).abs().max() <= delta_bound(x, out, DEFAULT_LEVEL).max() * 1.01


def test_encoding_is_deterministic(kv):
    assert cachegen_encode(kv) == cachegen_encode(kv.clone())


def test_decode_takes_any_byte_buffer(kv, streams):
    data = streams[DEFAULT_LEVEL]
    want = cachegen_decode(data)
    as_array = np.frombuffer(data, dtype=np.uint8)
    for buf in (bytearray(data), memoryview(data), as_array, torch.from_numpy(as_array.copy())):
        assert torch.equal(cachegen_decode(buf), want)


@pytest.mark.parametrize("level", sorted(LEVELS))
def test_error_within_half_a_step(kv, streams, level):
    out = cachegen_decode(streams[level])
    err = (out - kv).abs().reshape(kv.shape[0], 2, kv.shape[2], -1)
    anchors = anchor_mask(kv.shape[2])
    # Non-anchor tokens: within half the level's delta step of their (layer, K/V, channel).
    bound = delta_bound(kv, out, level)
    assert bool((err[:, :, ~anchors] <= bound[:, :, None] + 1e-6).all())
    # Anchors: within half the anchor step.
    a = kv.reshape(kv.shape[0], 2, kv.shape[2], -1)[:, :, anchors]
    a_bound = a.abs().amax(dim=2) / (LEVELS[level].anchor_bins - 1) * SLACK
    assert bool((err[:, :, anchors] <= a_bound[:, :, None] + 1e-6).all())


def test_sizes_and_errors_monotone_across_levels(kv, streams):
    sizes = [len(streams[n]) for n in sorted(LEVELS)]
    errors = [float((cachegen_decode(streams[n]) - kv).abs().mean()) for n in sorted(LEVELS)]
    assert sizes == sorted(sizes) and len(set(sizes)) == len(sizes)
    assert errors == sorted(errors, reverse=True)
    # The top level is close to lossless: under 1% of the mean magnitude.
    assert errors[-1] < 0.01 * float(kv.abs().mean())
    # The default level is under half of int8 (1 byte a number + an fp32 scale per token and
    # head) even on this small a chunk (64 tokens: scales and tables weigh more than at 256).
    int8 = kv.numel() + 4 * kv.numel() // kv.shape[-1]
    assert sizes[DEFAULT_LEVEL - 1] < int8 / 2


def test_anchors_nearly_exact(kv, streams):
    anchors = anchor_mask(kv.shape[2])
    for n in LEVELS:
        err = (cachegen_decode(streams[n]) - kv).abs()
        anchor_err = err[:, :, anchors].amax(dim=2)  # [L, 2, H, D]
        scale = kv[:, :, anchors].abs().amax(dim=2)
        # 6 or 8 bits: every group's first token within half a step of 1/31 (1/127) of its
        # channel's largest anchor, far closer than the deltas at the lower levels.
        assert bool((anchor_err <= scale / (LEVELS[n].anchor_bins - 1) * SLACK + 1e-6).all())
        if n <= DEFAULT_LEVEL:
            assert float(anchor_err.mean()) < 0.25 * float(err[:, :, ~anchors].mean())


@pytest.mark.parametrize("tokens", [1, 2, 5, GROUP_SIZE, GROUP_SIZE + 1, 33, 100])
def test_any_token_count(tokens):
    x = fake_kv(layers=3, tokens=tokens, heads=1, dim=8, seed=tokens)
    data = cachegen_encode(x)
    assert cachegen_info(data).shape == (3, 2, tokens, 1, 8)
    out = cachegen_decode(data)
    assert out.shape == x.shape
    if tokens > 1:
        err = (out - x).abs().reshape(3, 2, tokens, 8)[:, :, ~anchor_mask(tokens)]
        assert bool((err <= delta_bound(x, out, DEFAULT_LEVEL)[:, :, None] + 1e-6).all())


def test_constant_and_zero_channels():
    x = torch.zeros(2, 2, 40, 2, 4)
    x[0, 1, :, 1, 2] = 3.5  # a constant channel: deltas all zero, a one-symbol table
    out = cachegen_decode(cachegen_encode(x))
    assert torch.allclose(out, x, atol=3.5 / (LEVELS[DEFAULT_LEVEL].anchor_bins - 1))
    assert float(out[1].abs().max()) == 0.0


def test_encode_rejects_bad_input(kv):
    with pytest.raises(ValueError):
        cachegen_encode(kv, level=0)
    with pytest.raises(ValueError):
        cachegen_encode(kv, level=len(LEVELS) + 1)
    with pytest.raises(ValueError):
        cachegen_encode(kv[:, 0])  # [L, T, H, D]
    with pytest.raises(ValueError):
        cachegen_encode(kv[:, :, :0])
    with pytest.raises(ValueError):
        cachegen_encode(kv.to(torch.int32))
    bad = kv.clone()
    bad[0, 0, 3, 0, 0] = float("nan")
    with pytest.raises(ValueError):
        cachegen_encode(bad)


# ---------------------------------------------------------------- the header


def test_info_reads_the_header(kv, streams):
    for n, data in streams.items():
        info = cachegen_info(data)
        assert isinstance(info, CachegenInfo)
        assert info == CachegenInfo(tuple(kv.shape), n, GROUP_SIZE, len(data))
    # The header alone is enough.
    assert cachegen_info(streams[1][:HEADER_SIZE]).bytes == len(streams[1])
    with pytest.raises(CachegenCorrupt):
        cachegen_info(b"not a stream at all, long enough for a header")
    with pytest.raises(CachegenCorrupt):
        cachegen_info(streams[1][: HEADER_SIZE - 1])


# ---------------------------------------------------------------- corrupt streams


def small_stream(level=DEFAULT_LEVEL) -> tuple[torch.Tensor, bytes]:
    x = fake_kv(layers=2, tokens=40, heads=2, dim=8, seed=7)
    return x, cachegen_encode(x, level)


def decodes_sanely(data, shape) -> bool:
    """True when data decodes to finite numbers of the right shape; False when it raises
    CachegenCorrupt. Anything else (another exception, garbage shape) fails the test."""
    try:
        out = cachegen_decode(data)
    except CachegenCorrupt:
        return False
    assert out.shape == shape and bool(torch.isfinite(out).all())
    return True


def test_every_truncation_raises():
    x, data = small_stream()
    for n in range(len(data)):
        with pytest.raises(CachegenCorrupt):
            cachegen_decode(data[:n])
    with pytest.raises(CachegenCorrupt):
        cachegen_decode(data + b"\0")
    with pytest.raises(CachegenCorrupt):
        cachegen_decode(data + b"\0\0\0\0")


def test_random_bytes_raise():
    rng = np.random.default_rng(0)
    x, data = small_stream()
    for n in (0, 1, 10, HEADER_SIZE, 100, len(data), 5000):
        with pytest.raises(CachegenCorrupt):
            cachegen_decode(rng.integers(0, 256, n, dtype=np.uint8).tobytes())
    # A valid header followed by random bytes of the right length: well-formed or rejected,
    # never a crash and never out-of-range numbers.
    rejected = 0
    for _ in range(200):
        body = rng.integers(0, 256, len(data) - HEADER_SIZE, dtype=np.uint8).tobytes()
        rejected += not decodes_sanely(data[:HEADER_SIZE] + body, x.shape)
    assert rejected > 150


def test_bit_flips_are_rejected_or_well_formed():
    x, data = small_stream()
    rng = np.random.default_rng(1)

    def flipped(bit: int) -> bytes:
        bad = bytearray(data)
        bad[bit // 8] ^= 1 << (bit % 8)
        return bytes(bad)

    # Every flip in the header is caught (its CRC-32): it sizes everything else.
    for bit in range(8 * HEADER_SIZE):
        with pytest.raises(CachegenCorrupt):
            cachegen_decode(flipped(bit))
    # Elsewhere a flip may change numbers (the block format's checksums catch those) but the
    # result is either rejected or well-formed.
    body_bits = rng.choice(np.arange(8 * HEADER_SIZE, 8 * len(data)), 600, replace=False)
    rejected = sum(not decodes_sanely(flipped(int(bit)), x.shape) for bit in body_bits)
    assert rejected > 0


def test_trailing_payload_words_are_rejected():
    x, data = small_stream()
    info = cachegen_info(data)
    fields = list(HEADER_FIELDS.unpack_from(data, 0))
    # Two more words than the symbols use (a range decoder cannot tell one trailing word from
    # the coder's own last word; the header's CRC covers the word count against damage anyway).
    fields[-2] = info.bytes + 8  # total bytes
    fields[-1] += 2  # payload words
    header = HEADER_FIELDS.pack(*fields)
    header += zlib.crc32(header).to_bytes(4, "little")
    longer = header + data[HEADER_SIZE:] + b"\x55\xaa\x55\xaa" * 2
    with pytest.raises(CachegenCorrupt):
        cachegen_decode(longer)


def test_decode_rejects_non_buffers_and_bad_dtypes():
    x, data = small_stream()
    with pytest.raises(TypeError):
        cachegen_decode(torch.zeros(10, dtype=torch.float32))
    with pytest.raises(TypeError):
        cachegen_decode(12345)
    with pytest.raises(ValueError):
        cachegen_decode(data, torch.int8)


# ---------------------------------------------------------------- a real model's KV


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[T, H, D] each -> [T, H, D]."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
    )
    return out.transpose(0, 1)


@torch.inference_mode()
def test_tiny_model_kv_round_trip():
    """tiny-random's prefill KV through CacheGen: attention over the decoded KV (the keys as
    queries) stays close to attention over the exact KV, closer at higher levels; and the next
    tokens' logits computed over the decoded prefix follow (nearly exact at the top level)."""
    lm = load_model("tiny-random")
    model, config = lm.model, lm.config
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, config.vocab_size, (96,), generator=g)
    prefix, rest = ids[:80], ids[80:]
    bs = 16
    pool = KVPool(config, 8, bs, dtype=torch.float32)
    table = pool.allocate(8)
    model.prefill(prefix, pool, table, 0)
    n_blocks = prefix.numel() // bs
    blocks = pool.kv[table[:n_blocks]]  # [blocks, L, 2, 16, H, D]
    kv = blocks.permute(1, 2, 0, 3, 4, 5).reshape(config.num_layers, 2, -1, *blocks.shape[-2:])
    want_logits = model.prefill(rest, pool, table, prefix.numel()).clone()

    attn_err = {}
    for level in sorted(LEVELS):
        out = cachegen_decode(cachegen_encode(kv, level))
        errs = []
        for layer in range(config.num_layers):
            k, v = kv[layer]
            want = causal_attention(k, k, v)
            got = causal_attention(k, out[layer, 0], out[layer, 1])
            errs.append(float((got - want).norm() / want.norm()))
        attn_err[level] = max(errs)
    levels = sorted(LEVELS)
    assert [attn_err[n] for n in levels] == sorted(attn_err.values(), reverse=True)
    assert attn_err[DEFAULT_LEVEL] < 0.5 and attn_err[levels[-1]] < 0.03

    back = out.reshape(config.num_layers, 2, n_blocks, bs, *out.shape[-2:])  # the top level's
    pool.kv[table[:n_blocks]] = back.permute(2, 0, 1, 3, 4, 5)
    got_logits = model.prefill(rest, pool, table, prefix.numel())
    assert float((got_logits - want_logits).norm() / want_logits.norm()) < 0.05
    assert float((got_logits.argmax(-1) == want_logits.argmax(-1)).float().mean()) >= 0.9
