"""Triton kernels for the row-wise steps of a CUDA forward: RMSNorm, rotary embedding (in place)
and SwiGLU's silu(gate) * up, each one kernel where torch's ops take 2 to 8.

Why: a small model's decode step on a GPU is bound by its kernels' count, not their work
(SmolLM2 at batch 1: ~36 kernels a layer, each a few microseconds of launch and drain, even
replayed from a CUDA graph). These steps were 26 of the 36.

Each computes in fp32 and rounds once, where torch's bf16 ops round after every op: results
agree with them to a bf16 rounding step, not bits. kernels/packed_linear.py dispatches CUDA
tensors here; the tests run them on CPU tensors under TRITON_INTERPRET=1. Imported on first
use, so that a CPU server never loads triton."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, D] with unit stride along D (a view where it can be)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


@triton.jit
def _rms_norm_kernel(X, W, OUT, x_stride, out_stride, d, eps, ROUND_FIRST: tl.constexpr,
                     BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < d
    x = tl.load(X + row * x_stride + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    normed = x * tl.rsqrt(tl.sum(x * x, axis=0) / d + eps)
    if ROUND_FIRST:  # as the reference: normalised, rounded to the dtype, then scaled
        normed = normed.to(OUT.dtype.element_ty).to(tl.float32)
    tl.store(OUT + row * out_stride + offs, (w * normed).to(OUT.dtype.element_ty), mask=mask)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [..., D] by weight [D], in fp32; x's dtype out."""
    rows = _rows(x)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    d = rows.shape[1]
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](
            rows, weight, out, rows.stride(0), out.stride(0), d, float(eps),
            ROUND_FIRST=x.dtype != torch.float32, BLOCK=triton.next_power_of_2(d),
        )  # fmt: skip
    return out.view(x.shape)


@triton.jit
def _rope_kernel(X, COS, SIN, x_stride_n, x_stride_h, cs_stride, heads, HALF: tl.constexpr,
                 BLOCK_H: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    n = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    i = tl.arange(0, BLOCK)[None, :]
    mask = (h < heads) & (i < HALF)
    c = tl.load(COS + n * cs_stride + i, mask=i < HALF, other=0.0).to(tl.float32)
    s = tl.load(SIN + n * cs_stride + i, mask=i < HALF, other=0.0).to(tl.float32)
    p1 = X + n * x_stride_n + h * x_stride_h + i
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(p1, (x1 * c - x2 * s).to(X.dtype.element_ty), mask=mask)
    tl.store(p1 + HALF, (x2 * c + x1 * s).to(X.dtype.element_ty), mask=mask)


def rope_triton_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [N, heads, D] in place (rotate-half layout) by cos/sin [N, 1, D/2] (or
    [N, D/2]); unit stride along D. Returns x."""
    n, heads, d = x.shape
    if x.stride(-1) != 1:
        raise ValueError("rope_triton_ needs unit stride along head_dim")
    c, s = cos.reshape(n, d // 2), sin.reshape(n, d // 2)
    if c.stride(-1) != 1 or s.stride(-1) != 1 or c.stride(0) != s.stride(0):
        c, s = c.contiguous(), s.contiguous()
    if n:
        _rope_kernel[(n,)](
            x, c, s, x.stride(0), x.stride(1), c.stride(0), heads, HALF=d // 2,
            BLOCK_H=triton.next_power_of_2(heads), BLOCK=triton.next_power_of_2(d // 2),
        )  # fmt: skip
    return x


@triton.jit
def _silu_mul_kernel(GU, OUT, gu_stride, out_stride, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(GU + row * gu_stride + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(GU + row * gu_stride + inter + offs, mask=mask, other=0.0).to(tl.float32)
    act = gate / (1.0 + tl.exp(-gate))
    tl.store(OUT + row * out_stride + offs, (act * up).to(OUT.dtype.element_ty), mask=mask)


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gate_up [..., 2I] (gate, then up): [..., I]."""
    rows = _rows(gate_up)
    inter = rows.shape[1] // 2
    out = torch.empty(rows.shape[0], inter, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(inter))
    if rows.shape[0]:
        _silu_mul_kernel[(rows.shape[0], triton.cdiv(inter, block))](
            rows, out, rows.stride(0), out.stride(0), inter, BLOCK=block
        )
    return out.view(*gate_up.shape[:-1], inter)
