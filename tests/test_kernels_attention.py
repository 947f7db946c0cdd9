"""Paged decode attention: Triton (interpreted on CPU) and the torch twin against dense
attention."""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kernels
from kernels.paged_attention_torch import paged_decode_attention_torch

# Max abs error against a float64 dense reference, per storage dtype: fp32 accumulates in fp32;
# fp16/bf16 add the rounding of the output (inputs are exact in both paths).
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DTYPES = list(TOL)
SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def make_case(
    seed, batch, kv_heads, group, head_dim, block_size, lens, dtype, num_layers=2, layer=1
):
    """A layer-major pool with each sequence's KV scattered into random blocks, plus the dense
    KV."""
    g = torch.Generator().manual_seed(seed)
    q_heads = kv_heads * group
    max_blocks = max(-(-n // block_size) for n in lens) + 1  # one spare column past every sequence
    num_blocks = batch * max_blocks + 3
    pool = torch.randn(num_blocks, num_layers, 2, block_size, kv_heads, head_dim, generator=g).to(
        dtype
    )
    perm = torch.randperm(num_blocks, generator=g)[: batch * max_blocks]
    table = perm.view(batch, max_blocks).to(torch.int32)
    dense = []
    for b, n in enumerate(lens):
        kv = pool[table[b].long(), layer]  # [max_blocks, 2, bs, H, D]
        dense.append(kv.transpose(0, 1).reshape(2, -1, kv_heads, head_dim)[:, :n])
        # Slots past the sequence's end were never written: poison them.
        flat = pool[table[b].long(), layer].transpose(0, 1).reshape(2, -1, kv_heads, head_dim)
        flat[:, n:] = float("nan")
        pool[table[b].long(), layer] = flat.reshape(
            2, max_blocks, block_size, kv_heads, head_dim
        ).transpose(0, 1)
    q = torch.randn(batch, q_heads, head_dim, generator=g).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    return q, pool[:, layer, 0], pool[:, layer, 1], table, seq_lens, dense


def dense_attention(q, dense, scale):
    """Plain softmax attention per sequence in float64 over unpaged K/V [2, n, H, D]."""
    outs = []
    for b, kv in enumerate(dense):
        k, v = kv[0].double(), kv[1].double()
        group = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(group, dim=1)  # query head h reads KV head h // group
        v = v.repeat_interleave(group, dim=1)
        s = torch.einsum("hd,thd->ht", q[b].double(), k) * scale
        outs.append(torch.einsum("ht,thd->hd", s.softmax(-1), v))
    return torch.stack(outs)


def lengths(block_size):
    """Ragged lengths that include 1 and exact block boundaries."""
    special = st.sampled_from([1, block_size, 2 * block_size, block_size + 1, 3 * block_size - 1])
    return st.one_of(special, st.integers(1, 4 * block_size))


@st.composite
def cases(draw):
    block_size = draw(st.sampled_from([8, 16]))
    mode = draw(st.sampled_from(["mha", "gqa", "mqa"]))  # group = 1, 3, all query heads
    kv_heads = 1 if mode == "mqa" else draw(st.sampled_from([1, 2, 3]))
    group = {"mha": 1, "gqa": 3}.get(mode) or draw(st.sampled_from([2, 4, 6, 9]))
    batch = draw(st.integers(1, 3))
    lens = draw(st.lists(lengths(block_size), min_size=batch, max_size=batch))
    return dict(
        seed=draw(st.integers(0, 2**16)),
        batch=batch,
        kv_heads=kv_heads,
        group=group,
        head_dim=draw(st.sampled_from([64, 128])),
        block_size=block_size,
        lens=lens,
        dtype=draw(st.sampled_from(DTYPES)),
    )


@SETTINGS
@given(cases())
def test_triton_and_torch_match_dense_attention(case):
    q, k_cache, v_cache, table, seq_lens, dense = make_case(**case)
    scale = case["head_dim"] ** -0.5
    want = dense_attention(q, dense, scale)
    tol = TOL[case["dtype"]]
    for backend in ("torch", "triton", "native"):
        got = kernels.paged_decode_attention(q, k_cache, v_cache, table, seq_lens, backend=backend)
        assert got.dtype == q.dtype and got.shape == q.shape
        assert not got.isnan().any(), backend
        err = (got.double() - want).abs().max().item()
        assert err <= tol, f"{backend}: max abs error {err} > {tol} for {case}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "kv_heads,group,head_dim,block_size,lens",
    [(3, 3, 64, 16, [1, 16, 37]), (1, 9, 128, 8, [70]), (2, 1, 64, 16, [5, 33])],
)
def test_the_dot_form_matches_dense_attention(kv_heads, group, head_dim, block_size, lens, dtype):
    """The split kernel with its products as tl.dot (`form="dot"`: the group padded to 16 rows,
    probabilities in the KV dtype), over NaN-poisoned slots past each sequence's end. bf16 is
    left to the GPU tests: the interpreter's bf16 tl.dot is wrong."""
    from kernels.paged_attention_triton import _full_source, _launch

    q, k, v, table, seq_lens, dense = make_case(
        1, len(lens), kv_heads, group, head_dim, block_size, lens, dtype
    )
    got = _launch(q, [_full_source(k, v, table, seq_lens)], None, kv_heads, head_dim, form="dot")
    assert got.dtype == dtype and not got.isnan().any()
    err = (got.double() - dense_attention(q, dense, head_dim**-0.5)).abs().max().item()
    assert err <= TOL[dtype], f"max abs error {err}"
    with pytest.raises(ValueError, match="form"):
        _launch(q, [_full_source(k, v, table, seq_lens)], None, kv_heads, head_dim, form="mma")


@settings(max_examples=6, deadline=None)
@given(st.integers(0, 2**16), st.sampled_from([1, 3, 9]))
def test_twins_agree_with_each_other_and_with_the_reference(seed, group):
    # The torch fast path splits the KV like the kernel does: force several splits and merges.
    q, k_cache, v_cache, table, seq_lens, _ = make_case(
        seed, 3, 3 if group < 9 else 1, group, 64, 16, [1, 50, 96], torch.float32
    )
    k_clean = torch.nan_to_num(k_cache)
    v_clean = torch.nan_to_num(v_cache)
    ref = kernels.paged_decode_attention_ref(q, k_clean, v_clean, table, seq_lens)
    tri = kernels.paged_decode_attention(q, k_cache, v_cache, table, seq_lens, backend="triton")
    tor = paged_decode_attention_torch(q, k_cache, v_cache, table, seq_lens, split_bytes=20_000)
    assert torch.allclose(tri, ref, atol=1e-5, rtol=0)
    assert torch.allclose(tor, ref, atol=1e-5, rtol=0)


def test_custom_scale_and_pool_dtype_other_than_query():
    q, k_cache, v_cache, table, seq_lens, dense = make_case(
        3, 2, 3, 3, 64, 16, [17, 40], torch.bfloat16
    )
    qf = q.float()
    want = dense_attention(qf, [d.float() for d in dense], 0.3)
    for backend in ("torch", "triton", "native"):
        got = kernels.paged_decode_attention(
            qf, k_cache, v_cache, table, seq_lens, 0.3, backend=backend
        )
        assert got.dtype == torch.float32
        assert (got.double() - want).abs().max().item() < 2e-5


def test_garbage_table_entries_past_the_end_are_never_read():
    q, k_cache, v_cache, table, seq_lens, dense = make_case(
        5, 2, 3, 3, 64, 16, [5, 33], torch.float32
    )
    table = table.clone()
    table[0, 1:] = -1  # unused columns: anything, even out of range
    table[1, 3:] = 10**6
    want = dense_attention(q, dense, 64**-0.5)
    for backend in ("torch", "triton", "native"):
        got = kernels.paged_decode_attention(q, k_cache, v_cache, table, seq_lens, backend=backend)
        assert (got.double() - want).abs().max().item() < 2e-5


def test_dispatch_picks_native_on_cpu_and_rejects_unknown_backends():
    assert kernels.available_backends("paged_decode_attention") == [
        "native",
        "ref",
        "torch",
        "triton",
    ]
    assert kernels.native_status().available, kernels.native_status().detail
    q, k_cache, v_cache, table, seq_lens, _ = make_case(1, 1, 1, 1, 64, 16, [3], torch.float32)
    picked = kernels.paged_decode_attention(q, k_cache, v_cache, table, seq_lens)
    assert torch.equal(
        picked,
        kernels.paged_decode_attention(q, k_cache, v_cache, table, seq_lens, backend="native"),
    )
    twin = kernels.paged_decode_attention(q, k_cache, v_cache, table, seq_lens, backend="torch")
    assert (picked - twin).abs().max().item() < 1e-5
    with pytest.raises(ValueError, match="unknown backend"):
        kernels.paged_decode_attention(q, k_cache, v_cache, table, seq_lens, backend="cuda-graphs")


def test_long_sequence_many_splits_torch_path():
    # 2,000 tokens: the torch path's split-and-merge over many staging buffers.
    q, k_cache, v_cache, table, seq_lens, dense = make_case(
        9, 2, 3, 3, 64, 16, [2000, 1234], torch.float32
    )
    want = dense_attention(q, dense, 1 / math.sqrt(64))
    for split_bytes in (None, 100_000):
        got = paged_decode_attention_torch(
            q, k_cache, v_cache, table, seq_lens, split_bytes=split_bytes
        )
        assert (got.double() - want).abs().max().item() < 2e-5
