"""The fused prefill attention (kernels/prefill_attn.py, csrc/prefill_attention.c), bf16 and
fp32, against float64 causal attention and torch's SDPA on the same inputs: fresh K/V and a
cached prefix read in place from a layer-major pool through a shuffled block table, GQA, MQA and
MHA, head dims 32-128, tiles cut short (the kernel works in tiles of 32 queries, panels of up to
6 rows, 16 on AMX tiles, key blocks of 64 in bf16 and 32 in fp32), and bad tables."""

from __future__ import annotations

import pytest
import torch

from kernels import FullKVLayout, native, prefill_attention
from kernels.native import amx_supported, prefill_attention_available


def _path(dtype, amx, name, available):
    return pytest.param(
        (dtype, amx), marks=pytest.mark.skipif(not available, reason=f"no {name} here"), id=name
    )


# each of the kernel's paths on this CPU: bf16 on AMX tiles and on `vdpbf16ps`, fp32
PATHS = [
    _path(torch.bfloat16, True, "bf16 (AMX)", prefill_attention_available() and amx_supported()),
    _path(torch.bfloat16, False, "bf16 (AVX-512 BF16)", prefill_attention_available()),
    _path(torch.float32, False, "fp32 (AVX2)", prefill_attention_available(torch.float32)),
]


@pytest.fixture(params=PATHS)
def dtype(request, monkeypatch):
    """The kernel path's dtype, with that path chosen for the test."""
    dtype, amx = request.param
    monkeypatch.setattr(native, "PREFILL_AMX", amx)
    return dtype


# the kernel's error against float64, at most: bf16 outputs (|x| <~ 1: a rounding step up to
# 2^-8) and bf16 softmax weights before P.V; fp32 throughout
MAX_ERR = {torch.bfloat16: 8e-3, torch.float32: 1e-5}


def dense(q, ks, vs, start, scale):
    """float64 causal attention: query i at position start + i sees keys 0..start + i."""
    t, q_heads, _ = q.shape
    rep = q_heads // ks.shape[1]
    k, v = ks.double().repeat_interleave(rep, 1), vs.double().repeat_interleave(rep, 1)
    s = torch.einsum("thd,shd->hts", q.double(), k) * scale
    seen = torch.arange(start + t)[None, :] <= torch.arange(start, start + t)[:, None]
    s = s.masked_fill(~seen, float("-inf"))
    return torch.einsum("hts,shd->thd", torch.softmax(s, -1), v)


def pool_case(seed, t, start, q_heads, kv_heads, head_dim, block_size, dtype=torch.bfloat16):
    """q [t, QH, D] and a layer-major pool's layer-1 K/V views with the sequence's blocks at
    shuffled ids: (q, k_blocks, v_blocks, table, the keys and values in order)."""
    g = torch.Generator().manual_seed(seed)
    end = start + t
    used = -(-end // block_size)
    layout = FullKVLayout(3, kv_heads, head_dim, block_size, dtype)
    kv = torch.randn(used + 4, *layout.block_shape, generator=g).to(dtype)
    k_blocks, v_blocks = kv[:, 1, 0], kv[:, 1, 1]  # strided views of the pool, read in place
    table = torch.randperm(used + 4, generator=g)[:used]
    q = torch.randn(t, q_heads, head_dim, generator=g).to(dtype)
    ks = k_blocks[table].reshape(-1, kv_heads, head_dim)[:end]
    vs = v_blocks[table].reshape(-1, kv_heads, head_dim)[:end]
    return q, k_blocks, v_blocks, table, ks, vs


@pytest.mark.parametrize(
    "t, start, q_heads, kv_heads, head_dim, block_size",
    [
        (1, 0, 9, 3, 64, 16),  # one query: one row, one key
        (33, 0, 9, 3, 64, 16),  # a tile and one token; rows not a multiple of 4
        (70, 25, 9, 3, 64, 16),  # a cached prefix ending inside a key block
        (40, 300, 8, 1, 128, 16),  # MQA, head_dim 128, a long prefix
        (65, 64, 4, 4, 32, 32),  # MHA, head_dim 32, block-aligned prefix
        (7, 3, 6, 2, 96, 8),  # head_dim 96 (three 32-lane steps), small blocks
        (150, 0, 9, 3, 64, 16),  # several tiles, the last cut short; many key blocks
    ],
)
def test_matches_float64_attention_as_closely_as_sdpa(
    t, start, q_heads, kv_heads, head_dim, block_size, dtype
):
    q, kb, vb, table, ks, vs = pool_case(
        t + start, t, start, q_heads, kv_heads, head_dim, block_size, dtype
    )
    scale = head_dim**-0.5
    ref = dense(q, ks, vs, start, scale)
    ours = prefill_attention(q, kb, vb, table, start, scale, backend="native")
    sdpa = prefill_attention(q, kb, vb, table, start, scale, backend="torch")
    assert ours.dtype == dtype and ours.shape == (t, q_heads, head_dim)
    err, sdpa_err = (ours.double() - ref).abs(), (sdpa.double() - ref).abs()
    # within a rounding step of the truth, and on average no further from it than SDPA (which
    # keeps bf16's softmax weights in fp32)
    assert err.max() <= MAX_ERR[dtype], err.max()
    slack = MAX_ERR[dtype] / 800
    assert err.mean() <= 1.25 * sdpa_err.mean() + slack, (err.mean(), sdpa_err.mean())


def test_fresh_keys_as_one_block_equal_the_same_keys_in_the_pool(dtype):
    """The direct path (a fresh K/V of T tokens passed as one block) and the pool path read the
    same values: the same packed keys, the same bits out."""
    q, kb, vb, table, ks, vs = pool_case(1, 90, 0, 9, 3, 64, 16, dtype)
    one = torch.zeros(1, dtype=torch.long)
    fresh = prefill_attention(q, ks[None], vs[None], one, 0, 0.125, backend="native")
    pooled = prefill_attention(q, kb, vb, table, 0, 0.125, backend="native")
    assert torch.equal(fresh, pooled)


def test_a_bad_table_is_an_error_and_what_does_not_fit_goes_to_sdpa(dtype):
    q, kb, vb, table, _, _ = pool_case(2, 20, 10, 9, 3, 64, 16, dtype)
    bad = table.clone()
    bad[0] = kb.shape[0]
    with pytest.raises(IndexError, match="outside the pool"):
        prefill_attention(q, kb, vb, bad, 10, 0.125)
    with pytest.raises(ValueError, match="does not take"):  # too few blocks for the positions
        prefill_attention(q, kb, vb, table[:1], 10, 0.125, backend="native")
    # fp16 and head dims the kernel has no steps for are SDPA's, not an error
    for other in (
        pool_case(3, 20, 10, 9, 3, 64, 16, torch.float16),
        pool_case(3, 20, 10, 9, 3, 40, 16, dtype),
    ):
        q, kb, vb, table = other[:4]
        out = prefill_attention(q, kb, vb, table, 10, 0.125)
        assert out.dtype == q.dtype
        assert torch.equal(out, prefill_attention(q, kb, vb, table, 10, 0.125, backend="torch"))
