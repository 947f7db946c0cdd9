"""Triton KIVI quantize/dequantize, twins of kernels/kivi.py's torch functions (same arithmetic).

Tiles are [rows, packed bytes, 8/bits] so a row's codes are packed into bytes with one sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kivi import KiviPacked, _check, kivi_field_shapes, kivi_groups, kivi_layout


@triton.jit
def _zero_scale(mn, mx, LEVELS: tl.constexpr):
    """Same directed float16 rounding as kivi._zero_scale (2**-10 margins, 2**-24 floor)."""
    zero = (mn - tl.abs(mn) * 0.0009765625 - 5.960464477539063e-08).to(tl.float16)
    scale = ((mx - zero.to(tl.float32)) / LEVELS * 1.0009765625 + 5.960464477539063e-08).to(
        tl.float16
    )
    return zero, scale


@triton.jit
def _encode(x, zero, scale, LEVELS: tl.constexpr):
    c = tl.floor((x - zero.to(tl.float32)) / scale.to(tl.float32) + 0.5)
    return tl.minimum(tl.maximum(c, 0.0), LEVELS).to(tl.int32)


@triton.jit
def _quantize_keys_kernel(
    X,
    KS,
    KZ,
    KC,
    tokens,
    kv_heads,
    HEAD_DIM: tl.constexpr,
    BITS: tl.constexpr,
    GK: tl.constexpr,
    GK_P: tl.constexpr,
    DP_P: tl.constexpr,
):
    """One program: (stretch n, kv head, key group) -> per-channel scale/zero and packed codes."""
    PER: tl.constexpr = 8 // BITS
    LEVELS: tl.constexpr = (1 << BITS) - 1
    DP: tl.constexpr = HEAD_DIM // PER
    n = tl.program_id(0)
    h = tl.program_id(1)
    g = tl.program_id(2)
    kg = tl.num_programs(2)
    t = g * GK + tl.arange(0, GK_P)
    j = tl.arange(0, DP_P)
    i = tl.arange(0, PER)
    ch = j[:, None] * PER + i[None, :]  # [DP_P, PER]
    tmask = (tl.arange(0, GK_P) < GK) & (t < tokens)
    cmask = j[:, None] < DP
    m3 = tmask[:, None, None] & cmask[None, :, :]
    x = tl.load(
        X + ((n * 2 * tokens + t[:, None, None]) * kv_heads + h) * HEAD_DIM + ch[None, :, :],
        mask=m3,
        other=0.0,
    )
    x = x.to(tl.float32)
    mn = tl.min(tl.where(m3, x, float("inf")), axis=0)
    mx = tl.max(tl.where(m3, x, float("-inf")), axis=0)
    zero, scale = _zero_scale(mn, mx, LEVELS)
    soff = ((n * kg + g) * kv_heads + h) * HEAD_DIM + ch
    tl.store(KS + soff, scale, mask=cmask)
    tl.store(KZ + soff, zero, mask=cmask)
    codes = _encode(x, zero[None, :, :], scale[None, :, :], LEVELS)
    byte = tl.sum(codes << (i * BITS)[None, None, :], axis=2)
    tl.store(
        KC + ((n * tokens + t[:, None]) * kv_heads + h) * DP + j[None, :],
        byte.to(tl.uint8),
        mask=tmask[:, None] & (j[None, :] < DP),
    )


@triton.jit
def _quantize_values_kernel(
    X,
    VS,
    VZ,
    VC,
    tokens,
    kv_heads,
    HEAD_DIM: tl.constexpr,
    BITS: tl.constexpr,
    GV: tl.constexpr,
    GV_P: tl.constexpr,
    VG: tl.constexpr,
    DP_P: tl.constexpr,
):
    """One program: (stretch n, token, kv head) -> per-channel-group scale/zero and packed codes."""
    PER: tl.constexpr = 8 // BITS
    LEVELS: tl.constexpr = (1 << BITS) - 1
    DP: tl.constexpr = HEAD_DIM // PER
    n = tl.program_id(0)
    t = tl.program_id(1)
    h = tl.program_id(2)
    j = tl.arange(0, DP_P)
    i = tl.arange(0, PER)
    ch = j[:, None] * PER + i[None, :]  # [DP_P, PER]
    cmask = j[:, None] < DP
    base = X + ((n * 2 + 1) * tokens + t) * kv_heads * HEAD_DIM + h * HEAD_DIM
    x = tl.load(base + ch, mask=cmask, other=0.0).to(tl.float32)
    # Each channel's group statistics, from a [DP_P, PER, GV_P] tile of its group's members.
    mem = (ch // GV)[:, :, None] * GV + tl.arange(0, GV_P)[None, None, :]
    m3 = cmask[:, :, None] & (tl.arange(0, GV_P)[None, None, :] < GV) & (mem < HEAD_DIM)
    xg = tl.load(base + mem, mask=m3, other=0.0).to(tl.float32)
    mn = tl.min(tl.where(m3, xg, float("inf")), axis=2)
    mx = tl.max(tl.where(m3, xg, float("-inf")), axis=2)
    zero, scale = _zero_scale(mn, mx, LEVELS)
    first = cmask & (ch % GV == 0)
    soff = ((n * tokens + t) * kv_heads + h) * VG + ch // GV
    tl.store(VS + soff, scale, mask=first)
    tl.store(VZ + soff, zero, mask=first)
    codes = _encode(x, zero, scale, LEVELS)
    byte = tl.sum(codes << (i * BITS)[None, :], axis=1)
    tl.store(VC + ((n * tokens + t) * kv_heads + h) * DP + j, byte.to(tl.uint8), mask=j < DP)


@triton.jit
def _dequantize_kernel(
    KS,
    KZ,
    VS,
    VZ,
    KC,
    VC,
    OUT,
    tokens,
    kv_heads,
    kg,
    HEAD_DIM: tl.constexpr,
    BITS: tl.constexpr,
    GK: tl.constexpr,
    GV: tl.constexpr,
    VG: tl.constexpr,
    TT: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program: (stretch n, kv head, token tile) -> K and V rows [TT, head_dim]."""
    PER: tl.constexpr = 8 // BITS
    DP: tl.constexpr = HEAD_DIM // PER
    n = tl.program_id(0)
    h = tl.program_id(1)
    t = tl.program_id(2) * TT + tl.arange(0, TT)
    d = tl.arange(0, BLOCK_D)
    m = (t < tokens)[:, None] & (d < HEAD_DIM)[None, :]
    row = (n * tokens + t[:, None]) * kv_heads + h
    shift = ((d % PER) * BITS)[None, :]
    kb = tl.load(KC + row * DP + (d // PER)[None, :], mask=m, other=0).to(tl.int32)
    vb = tl.load(VC + row * DP + (d // PER)[None, :], mask=m, other=0).to(tl.int32)
    koff = ((n * kg + t[:, None] // GK) * kv_heads + h) * HEAD_DIM + d[None, :]
    voff = row * VG + (d // GV)[None, :]
    k = ((kb >> shift) & ((1 << BITS) - 1)).to(tl.float32) * tl.load(
        KS + koff, mask=m, other=0.0
    ).to(tl.float32) + tl.load(KZ + koff, mask=m, other=0.0).to(tl.float32)
    v = ((vb >> shift) & ((1 << BITS) - 1)).to(tl.float32) * tl.load(
        VS + voff, mask=m, other=0.0
    ).to(tl.float32) + tl.load(VZ + voff, mask=m, other=0.0).to(tl.float32)
    kout = OUT + ((n * 2 * tokens + t[:, None]) * kv_heads + h) * HEAD_DIM + d[None, :]
    tl.store(kout, k.to(OUT.dtype.element_ty), mask=m)
    tl.store(kout + tokens * kv_heads * HEAD_DIM, v.to(OUT.dtype.element_ty), mask=m)


def kivi_quantize_triton(kv: torch.Tensor, bits: int, group_size: int = 32) -> KiviPacked:
    """Triton twin of `kivi_quantize_torch` (kv [..., 2, tokens, kv_heads, head_dim])."""
    tokens, kv_heads, head_dim = kv.shape[-3:]
    _check(tokens, kv_heads, head_dim, bits, group_size)
    lead = kv.shape[:-4]
    x = kv.reshape(-1, 2, tokens, kv_heads, head_dim).contiguous()
    n = x.shape[0]
    shapes = kivi_field_shapes(tokens, kv_heads, head_dim, bits, group_size)
    dtypes = (torch.float16,) * 4 + (torch.uint8,) * 2
    p = KiviPacked(
        *(torch.empty((n, *s), dtype=d, device=kv.device) for s, d in zip(shapes, dtypes))
    )
    kg, gk = kivi_groups(tokens, group_size)
    vg, gv = kivi_groups(head_dim, group_size)
    dp_p = triton.next_power_of_2(head_dim * bits // 8)
    if n:
        _quantize_keys_kernel[(n, kv_heads, kg)](
            x,
            p.k_scale,
            p.k_zero,
            p.k_codes,
            tokens,
            kv_heads,
            HEAD_DIM=head_dim,
            BITS=bits,
            GK=gk,
            GK_P=triton.next_power_of_2(gk),
            DP_P=dp_p,
        )
        _quantize_values_kernel[(n, tokens, kv_heads)](
            x,
            p.v_scale,
            p.v_zero,
            p.v_codes,
            tokens,
            kv_heads,
            HEAD_DIM=head_dim,
            BITS=bits,
            GV=gv,
            GV_P=triton.next_power_of_2(gv),
            VG=vg,
            DP_P=dp_p,
        )
    return KiviPacked(*(f.view(*lead, *f.shape[1:]) for f in p))


def kivi_dequantize_triton(p: KiviPacked, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Triton twin of `kivi_dequantize_blocks_torch` -> [..., 2, tokens, kv_heads, head_dim]."""
    tokens, kv_heads, head_dim, bits, gk, gv = kivi_layout(p)
    lead = p.k_codes.shape[:-3]
    f = KiviPacked(*(x.reshape(-1, *x.shape[-3:]).contiguous() for x in p))
    n = f.k_codes.shape[0]
    out = torch.empty((n, 2, tokens, kv_heads, head_dim), dtype=dtype, device=p.k_codes.device)
    tt = min(16, triton.next_power_of_2(tokens))
    if n:
        _dequantize_kernel[(n, kv_heads, triton.cdiv(tokens, tt))](
            f.k_scale,
            f.k_zero,
            f.v_scale,
            f.v_zero,
            f.k_codes,
            f.v_codes,
            out,
            tokens,
            kv_heads,
            f.k_scale.shape[1],
            HEAD_DIM=head_dim,
            BITS=bits,
            GK=gk,
            GV=gv,
            VG=f.v_scale.shape[-1],
            TT=tt,
            BLOCK_D=triton.next_power_of_2(head_dim),
        )
    return out.view(*lead, 2, tokens, kv_heads, head_dim)
