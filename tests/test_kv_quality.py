"""bench/kv_quality.py's simulated KIVI cache on tiny-random: what it leaves alone, what it
quantizes, and that the quantized cache is the KIVI round trip of the tokens that left the
window."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import kernels
from model import load_model

ROOT = Path(__file__).resolve().parent.parent


def _load_bench():
    spec = importlib.util.spec_from_file_location(
        "bench_kv_quality", ROOT / "bench" / "kv_quality.py"
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


kq = _load_bench()

# tiny-random: 2 KV heads of 16 channels. G=8 gives 2 value groups a token; R=16 two key groups.
G, R, WINDOW, CHUNK = 8, 16, 130, 12


@pytest.fixture(scope="module")
def lm():
    return load_model("tiny-random")


@pytest.fixture(scope="module")
def ids(lm):
    text = (ROOT / "bench" / "data" / "pride_and_prejudice.txt").read_text(encoding="utf-8")
    tokens = lm.tokenizer.encode(text[:400], add_bos=False)
    assert len(tokens) >= WINDOW
    return tokens[:WINDOW]


@pytest.fixture(scope="module")
def ref(lm, ids):
    return kq.run_sequence(lm.model, ids, kq.BF16, CHUNK)


def test_schedule():
    # Keys leave in whole groups once R + G are held; values one at a time past R.
    assert [kq.keys_due(n, 32, 32) for n in (0, 32, 63, 64, 95, 96)] == [0, 0, 0, 32, 32, 64]
    assert [kq.values_due(n, 32) for n in (0, 32, 33, 40)] == [0, 0, 1, 8]
    assert [kq.keys_due(n, 0, 32) for n in (31, 32, 70)] == [0, 32, 64]
    with pytest.raises(ValueError):
        kq.kivi_setting(2, 32, 48)


def test_nothing_leaves_the_window_equals_16_bit(lm, ids, ref):
    run = kq.run_sequence(lm.model, ids, kq.kivi_setting(2, G, 136), CHUNK)
    assert run.cache.keys_quantized == 0 and run.cache.values_quantized == 0
    assert run.logprobs.shape == (WINDOW - 1,)
    assert torch.equal(run.logprobs, ref.logprobs)
    assert torch.equal(run.argmax, ref.argmax)


def test_16_bit_cache_holds_bf16_and_does_not_depend_on_chunking(lm, ids, ref):
    kv = ref.cache.read(0, WINDOW)
    assert torch.equal(kv, kv.to(torch.bfloat16).double())
    fp32 = kq.run_sequence(lm.model, ids, kq.FP32, CHUNK)
    kv32 = fp32.cache.read(0, WINDOW)
    assert not torch.equal(kv32, kv32.to(torch.bfloat16).double())
    assert not torch.equal(fp32.logprobs, ref.logprobs)
    whole = kq.run_sequence(lm.model, ids, kq.BF16, 64)
    # On AVX-512 oneDNN and SDPA sum in an order that depends on the rows per call, so a
    # chunk of 64 and one of 12 give K/V a float ulp apart, and the bf16 rounding of the odd
    # value moves a logprob by up to ~3e-4. A chunking bug (a row dropped or written twice)
    # or a cache that kept fp32 moves them by >= 1.6e-2 (the fp32 run above), 16x more.
    chunking = (whole.logprobs - ref.logprobs).abs().max().item()
    assert chunking < 1e-3
    assert chunking < (fp32.logprobs - ref.logprobs).abs().max().item() / 10


def test_two_bits_with_no_window_differs(lm, ids, ref):
    run = kq.run_sequence(lm.model, ids, kq.kivi_setting(2, G, 0), CHUNK)
    assert run.cache.keys_quantized == WINDOW // G * G and run.cache.values_quantized == WINDOW
    assert (run.logprobs - ref.logprobs).abs().max() > 0.05


def test_rewritten_cache_is_the_round_trip_of_what_left(lm, ids):
    setting = kq.kivi_setting(2, G, R)
    raw = []  # each chunk's K/V as computed, before any of it is rewritten

    def capture(cache, start, end):
        raw.append(cache.read(start, end))

    run = kq.run_sequence(lm.model, ids, setting, CHUNK, on_chunk=capture)
    raw = torch.cat(raw, dim=2)
    got = run.cache.read(0, WINDOW)
    keys, values = (WINDOW - R) // G * G, WINDOW - R  # 112 and 114: a key group not yet whole
    assert (run.cache.keys_quantized, run.cache.values_quantized) == (keys, values)
    assert keys < values

    def round_trip(x):
        return kernels.kivi_dequantize(kernels.kivi_quantize(x.float(), 2, G)).double()

    want_k = round_trip(raw[:, :, :keys])[:, 0]
    want_v = round_trip(raw[:, :, :values])[:, 1]
    assert torch.equal(got[:, 0, :keys], want_k)
    assert torch.equal(got[:, 1, :values], want_v)
    assert torch.equal(got[:, 0, keys:], raw[:, 0, keys:])  # the window's keys untouched
    assert torch.equal(got[:, 1, values:], raw[:, 1, values:])
    assert not torch.equal(got[:, 0, :keys], raw[:, 0, :keys])  # the round trip changed them
    assert not torch.equal(got[:, 1, :values], raw[:, 1, :values])


def test_greedy_decode_settles_each_token(lm, ids, ref):
    setting = kq.kivi_setting(4, G, R)
    run = kq.run_sequence(lm.model, ids[:100], setting, CHUNK, generate=10)
    held = 100 + 10 - 1  # the last generated token is never fed back
    assert len(run.generated) == 10
    assert run.cache.keys_quantized == kq.keys_due(held, R, G) == 88
    assert run.cache.values_quantized == held - R
    same = kq.run_sequence(lm.model, ids[:100], kq.BF16, CHUNK, generate=10)
    assert kq.greedy_agreement([same.generated], [same.generated]) == {
        "prefix": 1.0,
        "overall": 1.0,
    }
    assert kq.greedy_agreement([[1, 2, 3, 4]], [[1, 9, 3, 4]]) == {"prefix": 0.25, "overall": 0.75}


def test_bytes_vs_fp16():
    config = SimpleNamespace(num_kv_heads=3, head_dim=64)  # SmolLM2-135M's KV shape
    fp16 = 2 * config.num_kv_heads * config.head_dim * 2
    for bits in (4, 2):
        packed = kernels.kivi_packed_nbytes(16, config.num_kv_heads, config.head_dim, bits, 32)
        assert kq.kivi_bytes_vs_fp16(config, bits, 32, 0, 2048) == pytest.approx(packed / 16 / fp16)
        with_window = kq.kivi_bytes_vs_fp16(config, bits, 32, 32, 2048)
        assert with_window == pytest.approx((2016 * packed / 16 + 32 * fp16) / 2048 / fp16)
        assert kq.kivi_bytes_vs_fp16(config, bits, 32, 2048, 2048) == pytest.approx(1.0)
    assert kq.kivi_bytes_vs_fp16(config, 2, 32, 32, 2048) < kq.kivi_bytes_vs_fp16(
        config, 4, 32, 32, 2048
    )
