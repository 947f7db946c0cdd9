"""Compiled Triton kernels at real sizes against their torch twins (needs CUDA; skipped
otherwise)."""

import pytest
import torch

import kernels
from kernels.paged_attention_torch import paged_decode_attention_torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# SmolLM2-135M: 9 query heads, 3 KV heads, head_dim 64; and a Llama-8B-like layer (32 / 8 / 128).
SHAPES = [(9, 3, 64), (32, 8, 128)]
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def paged_case(
    batch, seq_len, q_heads, kv_heads, head_dim, dtype, block_size=16, num_layers=4, ragged=True
):
    g = torch.Generator(device="cuda").manual_seed(0)
    max_blocks = -(-seq_len // block_size)
    num_blocks = batch * max_blocks + 7
    pool = torch.randn(
        num_blocks, num_layers, 2, block_size, kv_heads, head_dim, device="cuda", generator=g
    ).to(dtype)
    table = (
        torch.randperm(num_blocks, device="cuda", generator=g)[: batch * max_blocks]
        .view(batch, max_blocks)
        .int()
    )
    lens = torch.full((batch,), seq_len, dtype=torch.int32, device="cuda")
    if ragged:
        lens = torch.randint(1, seq_len + 1, (batch,), device="cuda", generator=g).int()
        lens[0] = seq_len
    q = torch.randn(batch, q_heads, head_dim, device="cuda", generator=g).to(dtype)
    return q, pool[:, 2, 0], pool[:, 2, 1], table, lens


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("q_heads,kv_heads,head_dim", SHAPES)
@pytest.mark.parametrize("batch,seq_len", [(8, 4096), (1, 32768), (64, 1000)])
def test_paged_attention_matches_twin_at_real_sizes(
    batch, seq_len, q_heads, kv_heads, head_dim, dtype
):
    q, k_cache, v_cache, table, lens = paged_case(
        batch, seq_len, q_heads, kv_heads, head_dim, dtype
    )
    got = kernels.paged_decode_attention(
        q, k_cache, v_cache, table, lens
    )  # dispatch: Triton on CUDA
    want = paged_decode_attention_torch(q, k_cache, v_cache, table, lens)
    assert got.dtype == dtype and not got.isnan().any()
    assert (got.float() - want.float()).abs().max().item() <= TOL[dtype]


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("q_heads,kv_heads,head_dim", SHAPES)
@pytest.mark.parametrize("batch,seq_len", [(8, 4096), (64, 1000)])
def test_the_dot_form_matches_the_twin_at_real_sizes(
    batch, seq_len, q_heads, kv_heads, head_dim, dtype
):
    """The split kernel with tensor-core products (`form="dot"`, bench/decode_attn_sweep.py's
    alternative): bf16 products are checked here only, the interpreter's bf16 tl.dot being
    wrong."""
    from kernels.paged_attention_triton import _full_source, _launch

    q, k_cache, v_cache, table, lens = paged_case(
        batch, seq_len, q_heads, kv_heads, head_dim, dtype
    )
    source = _full_source(k_cache, v_cache, table, lens)
    got = _launch(q, [source], None, kv_heads, head_dim, form="dot")
    want = paged_decode_attention_torch(q, k_cache, v_cache, table, lens)
    assert got.dtype == dtype and not got.isnan().any()
    assert (got.float() - want.float()).abs().max().item() <= TOL[dtype]


@pytest.mark.parametrize("bits", [2, 4])
def test_kivi_quantize_and_attention_match_twins(bits):
    q, k_cache, v_cache, table, lens = paged_case(8, 4096, 9, 3, 64, torch.float16)
    kv = torch.stack([k_cache, v_cache], dim=1)  # [num_blocks, 2, bs, H, D]
    a = kernels.kivi_quantize(kv, bits, backend="torch")
    b = kernels.kivi_quantize(kv, bits)  # Triton
    for x, y in zip(a, b):
        # fp32 rounding may differ by FMA contraction: allow rare one-level code differences.
        if x.dtype == torch.uint8:
            assert (x != y).float().mean().item() < 1e-3
        else:
            assert torch.allclose(x.float(), y.float(), rtol=2e-3, atol=0)
    assert torch.allclose(
        kernels.kivi_dequantize(a),
        kernels.kivi_dequantize(a, backend="torch"),
        atol=1e-5,
        rtol=1e-6,
    )
    got = kernels.paged_decode_attention_kivi(q, a, table, lens)
    want = kernels.paged_decode_attention_kivi(q, a, table, lens, backend="torch")
    assert (got.float() - want.float()).abs().max().item() <= 2e-3


def test_gather_scatter_match_twins():
    pool = torch.randn(4096, 30, 2, 16, 3, 64, device="cuda", dtype=torch.bfloat16)
    ids = torch.randperm(4096, device="cuda")[:512]
    staged = kernels.gather_blocks(pool, ids)
    assert torch.equal(staged, kernels.gather_blocks(pool, ids, backend="torch"))
    target = torch.zeros_like(pool)
    kernels.scatter_blocks(staged, target, ids)
    assert torch.equal(target[ids], pool[ids])
    assert target.count_nonzero() == pool[ids].count_nonzero()


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kivi_window_attention_matches_twin(bits, dtype):
    """KIVI decode attention over packed blocks plus a full-precision window (the decode step of
    a kivi cache) against the torch twin, at SmolLM2's shape, with ragged parts."""
    q, k_cache, v_cache, table, lens = paged_case(8, 4096, 9, 3, 64, dtype)
    packed = kernels.kivi_quantize(torch.stack([k_cache, v_cache], dim=1), bits)
    g = torch.Generator(device="cuda").manual_seed(1)
    window_lens = torch.randint(0, 48, (8,), device="cuda", generator=g).int()
    window_table = torch.randperm(table.numel(), device="cuda", generator=g)[:24].view(8, 3).int()
    window_table = window_table % k_cache.shape[0]
    args = (q, packed, table, lens, k_cache, v_cache, window_table, window_lens)
    got = kernels.paged_decode_attention_kivi_window(*args)
    want = kernels.paged_decode_attention_kivi_window(*args, backend="torch")
    assert not got.isnan().any()
    assert (got.float() - want.float()).abs().max().item() <= TOL[dtype]
