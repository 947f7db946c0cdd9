"""The MLA latent KV layout and the absorbed paged MLA decode attention (torch twin)."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import KV_LAYOUTS, MlaKVLayout
from kernels.mla_attention import (
    mla_decode_attention_reference,
    paged_mla_decode_attention_torch,
)


def test_layout_shape_bytes_views_and_id():
    layout = MlaKVLayout(3, 32, 8, 16, torch.bfloat16)
    assert KV_LAYOUTS["mla"] is MlaKVLayout and layout.store_codec == "raw"
    assert layout.block_shape == (3, 16, 40) and layout.latent_dim == 40
    assert layout.block_bytes == 3 * 16 * 40 * 2 and layout.layer_bytes == 16 * 40 * 2
    pool = layout.empty_blocks(5)
    view = layout.layer_views(pool, 1)
    assert view.shape == (5, 16, 40)
    view[2, 3] = 1.0  # a view: writes land in the pool, in that layer only
    assert pool[2, 1, 3].eq(1).all() and pool.ne(0).sum() == 40
    ids = {
        MlaKVLayout(3, 32, 8, 16, torch.bfloat16).fingerprint_id,
        MlaKVLayout(3, 32, 8, 16, torch.float32).fingerprint_id,
        MlaKVLayout(3, 32, 8, 8, torch.bfloat16).fingerprint_id,
        MlaKVLayout(3, 64, 8, 16, torch.bfloat16).fingerprint_id,
        MlaKVLayout(3, 32, 16, 16, torch.bfloat16).fingerprint_id,
        kernels.FullKVLayout(3, 1, 40, 16, torch.bfloat16).fingerprint_id,
    }
    assert len(ids) == 6  # everything that changes a block's bytes changes its id
    for bad in [dict(kv_lora_rank=0), dict(block_size=-1), dict(dtype=torch.int8)]:
        args = dict(num_layers=2, kv_lora_rank=32, rope_dim=8, block_size=16, dtype=torch.float32)
        with pytest.raises(ValueError):
            MlaKVLayout(**{**args, **bad})


def _case(seed: int, lens: list[int], heads=4, rank=32, rope=8, block_size=4, num_blocks=40):
    g = torch.Generator().manual_seed(seed)
    batch = len(lens)
    q_latent = torch.randn(batch, heads, rank, generator=g)
    q_rope = torch.randn(batch, heads, rope, generator=g)
    cache = torch.randn(num_blocks, block_size, rank + rope, generator=g)
    width = max(1, max(-(-n // block_size) for n in lens))
    # distinct blocks per sequence, in shuffled order; entries past a sequence's end are junk
    tables = torch.randperm(num_blocks, generator=g)[: batch * width].view(batch, width)
    return q_latent, q_rope, cache, tables.int(), torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("split_bytes", [None, 1, 3000])
def test_matches_reference_ragged_and_split(split_bytes):
    q_latent, q_rope, cache, tables, lens = _case(0, [17, 0, 9, 1, 24])
    cache[tables[1]] = float("nan")  # an empty sequence's blocks are never read
    ref = mla_decode_attention_reference(q_latent, q_rope, cache, tables, lens, 0.3)
    out, lse = paged_mla_decode_attention_torch(
        q_latent, q_rope, cache, tables, lens, 0.3, split_bytes, return_lse=True
    )
    assert out.dtype == torch.float32 and out.shape == (5, 4, 32)
    assert (out - ref).abs().max().item() <= 1e-5
    assert out[1].eq(0).all() and lse[1].eq(float("-inf")).all() and lse[0].isfinite().all()


def test_bf16_cache_and_dispatch():
    q_latent, q_rope, cache, tables, lens = _case(1, [11, 30])
    low = cache.bfloat16()
    ref = mla_decode_attention_reference(q_latent, q_rope, low.float(), tables, lens, 0.2)
    out = kernels.paged_mla_decode_attention(q_latent.bfloat16(), q_rope, low, tables, lens, 0.2)
    assert out.dtype == torch.float32
    assert (out - ref).abs().max().item() <= 2e-2  # the bf16 query's rounding


@pytest.mark.skipif(not kernels.HAS_TRITON, reason="no triton")
@pytest.mark.parametrize(
    "heads, dtype, tol",
    [
        (4, torch.float32, 1e-5),
        (80, torch.float32, 1e-5),  # two head tiles, the second partly masked
        (20, torch.float16, 3e-3),  # fp16 dots: the query and weights rounded to fp16
        (4, torch.bfloat16, 1e-5),  # the interpreter dots bf16 pools in fp32
    ],
)
def test_triton_matches_reference(heads, dtype, tol):
    """The Triton twin (interpreted on CPU) against the reference: ragged lengths, an empty
    sequence, NaN in slots past every sequence's end, several splits."""
    lens = [17, 0, 9, 1, 38]
    q_latent, q_rope, cache, tables, seq_lens = _case(3, lens, heads=heads, block_size=5)
    for b, n in enumerate(lens):
        rows = cache[tables[b].long()].view(-1, cache.shape[-1])
        rows[n:] = float("nan")
        cache[tables[b].long()] = rows.view(-1, 5, cache.shape[-1])
    cache = cache.to(dtype)
    ref = mla_decode_attention_reference(q_latent, q_rope, cache.float(), tables, seq_lens, 0.3)
    out, lse = kernels.paged_mla_decode_attention(
        q_latent, q_rope, cache, tables, seq_lens, 0.3, backend="triton", return_lse=True
    )
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert (out - ref).abs().max().item() <= tol
    _, torch_lse = paged_mla_decode_attention_torch(
        q_latent, q_rope, cache, tables, seq_lens, 0.3, return_lse=True
    )
    assert torch.allclose(lse, torch_lse, atol=tol * 10) and lse[1].eq(float("-inf")).all()


def test_rejects_mismatched_shapes():
    q_latent, q_rope, cache, tables, lens = _case(2, [5])
    with pytest.raises(ValueError):
        paged_mla_decode_attention_torch(q_latent, q_rope, cache[..., :-1], tables, lens, 0.1)
    with pytest.raises(ValueError):
        paged_mla_decode_attention_torch(q_latent, q_rope[:, :2], cache, tables, lens, 0.1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-4)])
@pytest.mark.parametrize("batch, seq_len", [(8, 4096), (64, 700)])
def test_triton_at_deepseek_v2_sizes_on_gpu(batch, seq_len, dtype, tol):
    """Compiled on a GPU at DeepSeek-V2's shapes (128 heads, latent 512 + rope 64) against the
    torch twin (never run by this change's author: no GPU was available)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    block_size, heads, rank, rope = 64, 128, 512, 64
    max_blocks = -(-seq_len // block_size)
    num_blocks = batch * max_blocks + 5
    cache = torch.randn(num_blocks, block_size, rank + rope, device="cuda", generator=g).to(dtype)
    perm = torch.randperm(num_blocks, device="cuda", generator=g)[: batch * max_blocks]
    tables = perm.view(batch, max_blocks).int()
    lens = torch.randint(1, seq_len + 1, (batch,), device="cuda", generator=g).int()
    lens[0] = seq_len
    q_latent = torch.randn(batch, heads, rank, device="cuda", generator=g).to(dtype)
    q_rope = torch.randn(batch, heads, rope, device="cuda", generator=g).to(dtype)
    scale = 192**-0.5
    got = kernels.paged_mla_decode_attention(q_latent, q_rope, cache, tables, lens, scale)
    want = paged_mla_decode_attention_torch(q_latent, q_rope, cache, tables, lens, scale)
    assert got.dtype == torch.float32 and not got.isnan().any()
    assert (got - want).abs().max().item() <= tol


def test_the_fused_cpu_kernel_matches_the_reference():
    # CPU dispatch runs absorbed MLA on the fused C kernel: one KV head whose key is the whole
    # latent row and whose value is the same row (its rope columns dropped from the output).
    q_latent, q_rope, cache, tables, lens = _case(5, [17, 0, 9, 1, 24], heads=16)
    cache[tables[1]] = float("nan")  # an empty sequence's blocks are never read
    ref = mla_decode_attention_reference(q_latent, q_rope, cache, tables, lens, 0.3)
    out, lse = kernels.paged_mla_decode_attention(
        q_latent, q_rope, cache, tables, lens, 0.3, backend="native", return_lse=True
    )
    assert out.shape == q_latent.shape and (out - ref).abs().max() < 1e-5
    assert torch.all(out[1] == 0) and torch.all(lse[1] == float("-inf"))
    twin, twin_lse = paged_mla_decode_attention_torch(
        q_latent, q_rope, cache, tables, lens, 0.3, return_lse=True
    )
    finite = twin_lse.isfinite()
    assert (lse[finite] - twin_lse[finite]).abs().max() < 1e-5
    assert torch.equal(
        kernels.paged_mla_decode_attention(q_latent, q_rope, cache, tables, lens, 0.3), out
    )


@pytest.mark.parametrize("heads", [16, 4, 6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_fused_cpu_kernel_at_deepseek_v2_lite_widths(heads, dtype):
    # latent 512 + rope 64: the AVX-512 tiled path where this CPU has it (16 and 4 heads: rows
    # in fours), the row-at-a-time path for 6; ragged lengths end blocks mid-way. 16-bit rows are
    # widened once and serve as key and value; the reference reads the same rounded rows.
    q_latent, q_rope, cache, tables, lens = _case(
        8, [1, 37, 64, 0], heads=heads, rank=512, rope=64, block_size=16, num_blocks=24
    )
    cache = cache.to(dtype)
    ref = mla_decode_attention_reference(q_latent, q_rope, cache, tables, lens, 0.05)
    out, lse = kernels.paged_mla_decode_attention(
        q_latent, q_rope, cache, tables, lens, 0.05, backend="native", return_lse=True
    )
    assert (out - ref).abs().max() < 1e-5 and torch.all(out[3] == 0)
    _, twin_lse = paged_mla_decode_attention_torch(
        q_latent, q_rope, cache, tables, lens, 0.05, return_lse=True
    )
    finite = twin_lse.isfinite()
    assert (lse[finite] - twin_lse[finite]).abs().max() < 1e-5


@pytest.mark.parametrize("heads", [16, 6])
def test_bf16_rows_and_a_bf16_query_at_deepseek_v2_lite_widths(heads):
    # A bf16 model's query (every value a bf16) over bf16 rows: scored on bf16 dot products
    # where the CPU has them (16 heads), the scale applied to their sums; the same values as the
    # fp32 reference over the same rounded numbers, to fp32 rounding
    q_latent, q_rope, cache, tables, lens = _case(
        6, [3, 40, 64, 16], heads=heads, rank=512, rope=64, block_size=16, num_blocks=24
    )
    q_latent, q_rope, cache = q_latent.bfloat16(), q_rope.bfloat16(), cache.bfloat16()
    ref = mla_decode_attention_reference(
        q_latent.float(), q_rope.float(), cache.float(), tables, lens, 0.07
    )
    out, lse = kernels.paged_mla_decode_attention(
        q_latent, q_rope, cache, tables, lens, 0.07, backend="native", return_lse=True
    )
    assert (out - ref).abs().max() < 1e-5
    _, twin_lse = paged_mla_decode_attention_torch(
        q_latent.float(), q_rope.float(), cache, tables, lens, 0.07, return_lse=True
    )
    assert (lse - twin_lse).abs().max() < 1e-5


def test_the_fused_cpu_kernel_refuses_a_block_outside_the_pool():
    q_latent, q_rope, cache, tables, lens = _case(
        4, [20, 33], heads=16, rank=512, rope=64, block_size=16, num_blocks=8
    )
    tables[1, 2] = 8  # sequence 1's third block (its tokens 32..33) is past the pool's end
    with pytest.raises(IndexError, match="sequence 1 names a block outside the pool"):
        kernels.paged_mla_decode_attention(
            q_latent, q_rope, cache, tables, lens, 0.05, backend="native"
        )


def test_sequences_split_among_idle_threads_merge_exactly(monkeypatch):
    # Fewer sequences than threads: each is cut into runs of blocks, one work item each, merged
    # by their log-sum-exps. An empty sequence and a run past a short sequence's end weigh nothing.
    import kernels.native as native

    monkeypatch.setattr(native, "_MLA_SPLIT_TOKENS", 8)
    threads = torch.get_num_threads()
    torch.set_num_threads(6)  # 3 runs a sequence at a batch of 2
    try:
        for lens in ([0, 300], [40, 301], [7, 5]):
            q_latent, q_rope, cache, tables, seq_lens = _case(
                9, lens, heads=8, rank=64, rope=16, block_size=16, num_blocks=48
            )
            ref, ref_lse = paged_mla_decode_attention_torch(
                q_latent, q_rope, cache, tables, seq_lens, 0.2, return_lse=True
            )
            out, lse = kernels.paged_mla_decode_attention(
                q_latent, q_rope, cache, tables, seq_lens, 0.2, backend="native", return_lse=True
            )
            assert (out - ref).abs().max() < 1e-5, lens
            assert torch.equal(lse.isfinite(), ref_lse.isfinite())
            finite = ref_lse.isfinite()
            assert (lse[finite] - ref_lse[finite]).abs().max() < 1e-5
            assert torch.all(out[seq_lens == 0] == 0)
    finally:
        torch.set_num_threads(threads)
