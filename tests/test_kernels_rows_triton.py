"""The row-wise Triton kernels of a CUDA forward (kernels/rows_triton.py) against torch's ops:
RMSNorm, rotary embedding in place, silu(gate) * up; on CPU tensors under TRITON_INTERPRET=1
here, compiled where CUDA is. And the model's forward on CUDA (these kernels, the fused
residual GEMM) against the same model on the CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.rows_triton import rms_norm_triton, rope_triton_, silu_mul_triton
from model import Engine, KVPool, SamplingParams, load_model

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter takes CPU tensors
# one bf16 rounding step (the kernels round once, torch's bf16 ops after each op)
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _randn(*shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=DEVICE, dtype=dtype)


def _close(got, want, dtype):
    assert got.dtype == want.dtype and got.shape == want.shape
    assert (got.float() - want.float()).abs().max().item() <= TOL[dtype] * max(
        1.0, want.float().abs().max().item()
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 576), (2, 5, 64), (1, 100)])
def test_rms_norm(shape, dtype):
    x, w = _randn(*shape, dtype=dtype), 1 + 0.1 * _randn(shape[-1], dtype=dtype, seed=1)
    xf = x.float()
    want = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    _close(rms_norm_triton(x, w, 1e-5), want, dtype)
    # a strided view of rows (a projection's slice) reads as its values
    wide = _randn(4, 2 * shape[-1], dtype=dtype, seed=2)
    view = wide[:, : shape[-1]]
    vf = view.float()
    want = w * (vf * torch.rsqrt(vf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    _close(rms_norm_triton(view, w, 1e-5), want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_in_place_on_a_strided_view(dtype):
    # q and k heads as the model rotates them: a view into the QKV projection's rows
    n, heads, d = 5, 12, 64
    qkv = _randn(n, (heads + 3) * d, dtype=dtype)
    x = qkv[:, : heads * d].view(n, heads, d)
    angles = _randn(n, 1, d // 2, dtype=torch.float32, seed=3)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos.float(), sin.float()
    want = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(dtype)
    untouched = qkv[:, heads * d :].clone()
    assert rope_triton_(x, cos, sin) is x
    _close(x, want, dtype)
    assert torch.equal(qkv[:, heads * d :], untouched)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 1536), (7, 100), (3, 2500)])
def test_silu_mul(rows, inter, dtype):
    gate_up = _randn(rows, 2 * inter, dtype=dtype)
    gate, up = gate_up.float().chunk(2, dim=-1)
    _close(silu_mul_triton(gate_up), (F.silu(gate) * up).to(dtype), dtype)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_cuda_forward_matches_the_cpu_forward(dtype):
    models = [load_model("tiny-random", dtype=dtype, device=d) for d in ("cpu", "cuda")]
    ids = torch.tensor(list(range(40, 75)))
    logits = []
    for lm in models:
        pool = KVPool(lm.config, 8, 16, lm.model.dtype, lm.model.device)
        logits.append(lm.model.prefill(ids, pool, [0, 1, 2], 0).float().cpu())
    assert (logits[0] - logits[1]).abs().max().item() <= (1e-3 if dtype == "float32" else 0.25)
    prompts = [[5, 9, 200, 17], list(range(40, 75))]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    cpu, gpu = (Engine(lm).generate_batch(prompts, params) for lm in models)
    assert gpu == cpu
