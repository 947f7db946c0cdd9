"""KIVI decode attention over packed blocks plus the full-precision window, and the log-sum-exps
that merge them: both backends (Triton interpreted on CPU, see conftest.py) against float64 dense
attention over concat(dequantized packed K/V, window K/V)."""

import pytest
import torch

import kernels
from kernels.paged_attention_torch import (
    paged_decode_attention_kivi_torch,
    paged_decode_attention_torch,
)

BACKENDS = [
    "torch",
    "native",
    pytest.param("triton", marks=pytest.mark.skipif(not kernels.HAS_TRITON, reason="no triton")),
]
# Max abs error of the output against the float64 dense reference, per q / window dtype: fp32
# accumulates in fp32 (measured < 3e-7); fp16 adds the rounding of the output (half an ulp of
# values below 2 is 2**-10 ~ 1e-3). The LSE is fp32 in both: |lse| < 10 here, measured < 3e-7.
OUT_TOL = {torch.float32: 2e-5, torch.float16: 2e-3}
LSE_TOL = 2e-5
GARBAGE = (-1, 10**6)  # block-table entries past a sequence's last block: never to be read


def _table(g, batch, cols, num_blocks, lens, block_size):
    """Disjoint random blocks per sequence; columns past each sequence's last block hold garbage."""
    table = torch.randperm(num_blocks, generator=g)[: batch * cols].view(batch, cols).int()
    for b, n in enumerate(lens):
        for c in range(-(-n // block_size), cols):
            table[b, c] = GARBAGE[c % 2]
    return table


def _tokens(kv, table_row, n):
    """Tokens [0, n) of one sequence: kv [num_blocks, 2, bs, H, D] -> fp32 [2, n, H, D]."""
    used = table_row[: -(-n // kv.shape[2])].long()
    return kv[used].transpose(0, 1).reshape(2, -1, *kv.shape[-2:])[:, :n].float()


def window_case(
    seed,
    packed_lens,
    window_lens,
    *,
    kv_heads=2,
    group=3,
    head_dim=64,
    bits=4,
    dtype=torch.float32,
    packed_block=16,
    window_block=8,
):
    """(kwargs of paged_decode_attention_kivi_window, dense packed KV, dense window KV): the dense
    lists hold each sequence's [2, tokens, H, D] fp32 K/V (the packed part dequantized)."""
    g = torch.Generator().manual_seed(seed)
    batch = len(packed_lens)
    pcols = max(-(-n // packed_block) for n in packed_lens) + 1  # a spare column past every end
    pnum = batch * pcols + 2
    kv = torch.randn(pnum, 2, packed_block, kv_heads, head_dim, generator=g)
    kv[:, 0, :, :, 0] += 4.0  # an outlier key channel, as real keys have
    pool = kernels.kivi_quantize(kv, bits)
    deq = kernels.kivi_dequantize(pool)  # what the kernels must attend over
    ptable = _table(g, batch, pcols, pnum, packed_lens, packed_block)
    wcols = max(-(-n // window_block) for n in window_lens) + 1
    wnum = batch * wcols + 2
    wpool = torch.randn(wnum, 2, window_block, kv_heads, head_dim, generator=g).to(dtype)
    wtable = _table(g, batch, wcols, wnum, window_lens, window_block)
    dense_packed = [_tokens(deq, ptable[b], n) for b, n in enumerate(packed_lens)]
    dense_window = [_tokens(wpool, wtable[b], n) for b, n in enumerate(window_lens)]
    # Slots past a sequence's end were never written: poison them (window K/V, and the per-token
    # value scales of the packed blocks) so that reading one shows up as NaN.
    for b, (p, w) in enumerate(zip(packed_lens, window_lens)):
        if p % packed_block:
            blk = int(ptable[b, p // packed_block])
            pool.v_scale[blk, p % packed_block :] = float("nan")
            pool.v_zero[blk, p % packed_block :] = float("nan")
        if w % window_block:
            wpool[int(wtable[b, w // window_block]), :, w % window_block :] = float("nan")
    q = torch.randn(batch, kv_heads * group, head_dim, generator=g).to(dtype)
    args = dict(
        q=q,
        packed_pool=pool,
        packed_tables=ptable,
        packed_lens=torch.tensor(packed_lens, dtype=torch.int32),
        k_window=wpool[:, 0],
        v_window=wpool[:, 1],
        window_tables=wtable,
        window_lens=torch.tensor(window_lens, dtype=torch.int32),
    )
    return args, dense_packed, dense_window


def dense_attention(q, dense, scale):
    """(out, lse) float64 of softmax attention per sequence over dense [2, n, H, D]; a sequence
    with n = 0 gets (0, -inf)."""
    outs, lses = [], []
    q_heads, head_dim = q.shape[1:]
    for b, kv in enumerate(dense):
        if kv.shape[1] == 0:
            outs.append(torch.zeros(q_heads, head_dim, dtype=torch.float64))
            lses.append(torch.full((q_heads,), float("-inf"), dtype=torch.float64))
            continue
        group = q_heads // kv.shape[2]
        k = kv[0].double().repeat_interleave(group, dim=1)  # query head h reads KV head h // group
        v = kv[1].double().repeat_interleave(group, dim=1)
        s = torch.einsum("hd,thd->ht", q[b].double(), k) * scale
        outs.append(torch.einsum("ht,thd->hd", s.softmax(-1), v))
        lses.append(s.logsumexp(-1))
    return torch.stack(outs), torch.stack(lses)


def concat(dense_packed, dense_window):
    return [torch.cat([p, w], dim=1) for p, w in zip(dense_packed, dense_window)]


def max_err(got, want) -> float:
    if got.numel() == 0:
        return 0.0
    return (got.double() - want).abs().max().item()


def check_lse(lse, want):
    assert lse.dtype == torch.float32 and lse.shape == want.shape
    empty = want == float("-inf")
    assert torch.equal(lse == float("-inf"), empty), "lse is -inf exactly where a sequence is empty"
    err = max_err(lse[~empty], want[~empty])
    assert err <= LSE_TOL, f"lse max abs error {err} > {LSE_TOL}"


# ---------------------------------------------------------------- return_lse of the two ops


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "lens,kv_heads,group",
    [
        ([0, 1, 16, 37], 2, 3),  # an empty sequence; one split each in the interpreter
        ([60], 1, 4),  # batch 1, one KV head: the interpreter's kernel merges several splits
        ([0, 0], 1, 2),  # nothing at all to attend to
    ],
)
def test_return_lse_equals_the_dense_logsumexp(backend, lens, kv_heads, group):
    args, dense_packed, dense_window = window_case(7, lens, lens, kv_heads=kv_heads, group=group)
    q = args["q"]
    scale = 0.11  # not the default: the lse is of the scaled scores
    empty = torch.tensor(lens) == 0
    calls = {
        "full": (
            kernels.paged_decode_attention,
            [args[k] for k in ("k_window", "v_window", "window_tables", "window_lens")],
            dense_window,
        ),
        "kivi": (
            kernels.paged_decode_attention_kivi,
            [args[k] for k in ("packed_pool", "packed_tables", "packed_lens")],
            dense_packed,
        ),
    }
    for name, (op, op_args, dense) in calls.items():
        want_out, want_lse = dense_attention(q, dense, scale)
        out, lse = op(q, *op_args, scale, backend=backend, return_lse=True)
        assert out.shape == q.shape and out.dtype == q.dtype, name
        err = max_err(out, want_out)
        assert err <= OUT_TOL[q.dtype], f"{name}: out max abs error {err}"
        check_lse(lse, want_lse)
        assert (out[empty] == 0).all(), f"{name}: an empty sequence's output is 0"
        # The option changes nothing about the output.
        assert torch.equal(op(q, *op_args, scale, backend=backend), out), name


def test_return_lse_of_the_torch_path_across_several_splits():
    # A tiny staging budget forces the torch path through several splits and merge_splits.
    lens = [0, 5, 70, 33]
    args, dense_packed, dense_window = window_case(3, lens, lens, kv_heads=2, group=2)
    q = args["q"]
    out, lse = paged_decode_attention_torch(
        q,
        args["k_window"],
        args["v_window"],
        args["window_tables"],
        args["window_lens"],
        split_bytes=3_000,
        return_lse=True,
    )
    want_out, want_lse = dense_attention(q, dense_window, 64**-0.5)
    assert max_err(out, want_out) <= OUT_TOL[torch.float32]
    check_lse(lse, want_lse)
    out, lse = paged_decode_attention_kivi_torch(
        q,
        args["packed_pool"],
        args["packed_tables"],
        args["packed_lens"],
        split_bytes=3_000,
        return_lse=True,
    )
    want_out, want_lse = dense_attention(q, dense_packed, 64**-0.5)
    assert max_err(out, want_out) <= OUT_TOL[torch.float32]
    check_lse(lse, want_lse)


# ---------------------------------------------------------------- packed blocks + window


WINDOW_CASES = {
    # packed_lens, window_lens, options
    "kivi4-fp32-gqa3": ([0, 16, 32, 45, 0], [5, 0, 8, 16, 0], dict(bits=4, group=3)),
    "kivi2-fp16-gqa2": ([48, 0, 7], [0, 3, 9], dict(bits=2, group=2, dtype=torch.float16)),
    "kivi4-fp16-gqa4-blocks8x16": (
        [8, 24, 3],
        [16, 1, 30],
        dict(bits=4, group=4, dtype=torch.float16, packed_block=8, window_block=16),
    ),
    "kivi2-fp32-gqa2-mqa": ([64], [12], dict(bits=2, group=2, kv_heads=1, head_dim=128)),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(WINDOW_CASES))
def test_window_op_equals_dense_attention_over_packed_then_window(backend, name):
    packed_lens, window_lens, opts = WINDOW_CASES[name]
    args, dense_packed, dense_window = window_case(11, packed_lens, window_lens, **opts)
    q = args["q"]
    scale = q.shape[-1] ** -0.5
    want, _ = dense_attention(q, concat(dense_packed, dense_window), scale)
    got = kernels.paged_decode_attention_kivi_window(**args, backend=backend)
    assert got.shape == q.shape and got.dtype == q.dtype
    tol = OUT_TOL[q.dtype]
    err = max_err(got, want)
    assert err <= tol, f"{backend} {name}: max abs error {err} > {tol}"
    both_empty = [p + w == 0 for p, w in zip(packed_lens, window_lens)]
    assert (got[torch.tensor(both_empty)] == 0).all()
    # Not vacuous: where a sequence has both parts, either part alone is far from the answer.
    for part in (dense_packed, dense_window):
        alone, _ = dense_attention(q, part, scale)
        for b, (p, w) in enumerate(zip(packed_lens, window_lens)):
            if p and w:
                assert max_err(alone[b], want[b]) > 20 * tol


@pytest.mark.parametrize("backend", BACKENDS)
def test_window_op_with_a_custom_scale(backend):
    args, dense_packed, dense_window = window_case(5, [20, 9], [7, 16], group=3)
    want, _ = dense_attention(args["q"], concat(dense_packed, dense_window), 0.3)
    got = kernels.paged_decode_attention_kivi_window(**args, scale=0.3, backend=backend)
    assert max_err(got, want) <= OUT_TOL[torch.float32]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_window_holding_everything_equals_paged_decode_attention(backend, dtype):
    window_lens = [1, 8, 19, 32]
    args, _, _ = window_case(13, [0] * 4, window_lens, group=3, dtype=dtype)
    want = kernels.paged_decode_attention(
        args["q"],
        args["k_window"],
        args["v_window"],
        args["window_tables"],
        args["window_lens"],
        backend=backend,
    )
    # Float tolerance: the empty packed part has weight exactly 0, so only the merge's summation
    # order may differ (fp32: 1e-6; fp16: that difference may flip one rounding, one ulp < 2e-3).
    tol = {torch.float32: 1e-6, torch.float16: 2e-3}[dtype]
    got = kernels.paged_decode_attention_kivi_window(**args, backend=backend)
    assert max_err(got, want.double()) <= tol
    # And with a packed block table of no columns at all.
    args["packed_tables"] = args["packed_tables"][:, :0]
    got = kernels.paged_decode_attention_kivi_window(**args, backend=backend)
    assert max_err(got, want.double()) <= tol


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_window_equals_paged_decode_attention_kivi(backend):
    packed_lens = [16, 3, 40]
    args, _, _ = window_case(17, packed_lens, [0] * 3, group=2, bits=2)
    want = kernels.paged_decode_attention_kivi(
        args["q"], args["packed_pool"], args["packed_tables"], args["packed_lens"], backend=backend
    )
    got = kernels.paged_decode_attention_kivi_window(**args, backend=backend)
    assert max_err(got, want.double()) <= 1e-6
    args["window_tables"] = args["window_tables"][:, :0]
    got = kernels.paged_decode_attention_kivi_window(**args, backend=backend)
    assert max_err(got, want.double()) <= 1e-6


# ---------------------------------------------------------------- the merge helper and dispatch


def test_merge_attention_is_exact_and_stable():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 16, generator=g)
    kv = [torch.randn(2, n, 2, 16, generator=g) * 3 for n in (9, 1, 20)]
    splits = [0, 1, 13]  # the first sequence's first part is empty
    whole_out, whole_lse = dense_attention(q, kv, 0.7)
    a = dense_attention(q, [x[:, :s] for x, s in zip(kv, splits)], 0.7)
    b = dense_attention(q, [x[:, s:] for x, s in zip(kv, splits)], 0.7)
    out, lse = kernels.merge_attention(a[0].float(), a[1].float(), b[0].float(), b[1].float())
    assert out.dtype == lse.dtype == torch.float32
    assert max_err(out, whole_out) <= 1e-6 and max_err(lse, whole_lse) <= 1e-5
    # Both parts empty: (0, -inf), no NaN.
    zeros, ninf = torch.zeros(2, 5), torch.full((2,), float("-inf"))
    out, lse = kernels.merge_attention(zeros, ninf, zeros, ninf)
    assert torch.equal(out, zeros) and torch.equal(lse, ninf)
    # Huge log-sum-exps (exp would overflow fp32): weights e / (1 + e) and 1 / (1 + e).
    oa, ob = torch.ones(1, 3), -torch.ones(1, 3)
    out, lse = kernels.merge_attention(oa, torch.tensor([1000.0]), ob, torch.tensor([999.0]))
    e = torch.e
    assert torch.allclose(out, torch.full((1, 3), (e - 1) / (e + 1)), atol=1e-6, rtol=0)
    assert abs(lse.item() - (1000 + torch.log1p(torch.tensor(1 / e)).item())) <= 1e-4


def test_dispatch_registers_every_backend_and_checks_shapes():
    assert kernels.available_backends("paged_decode_attention_kivi_window") == (
        ["native", "torch", "triton"] if kernels.HAS_TRITON else ["native", "torch"]
    )
    args, _, _ = window_case(1, [16, 5], [3, 8])
    picked = kernels.paged_decode_attention_kivi_window(**args)  # CPU tensors: the fused kernel
    assert torch.equal(picked, kernels.paged_decode_attention_kivi_window(**args, backend="native"))
    twin = kernels.paged_decode_attention_kivi_window(**args, backend="torch")
    assert (picked - twin).abs().max().item() < 1e-5
    with pytest.raises(ValueError, match="unknown backend"):
        kernels.paged_decode_attention_kivi_window(**args, backend="cuda-graphs")
    bad = dict(args, k_window=args["k_window"][..., :32], v_window=args["v_window"][..., :32])
    for backend in kernels.available_backends("paged_decode_attention_kivi_window"):
        with pytest.raises(ValueError, match="do not match"):
            kernels.paged_decode_attention_kivi_window(**bad, backend=backend)
