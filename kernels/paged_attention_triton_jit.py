"""The Triton device code of paged flash-decoding (kernels/paged_attention_triton.py plans and
launches it): the tile loaders of full-precision and KIVI blocks, the split kernel, and the
log-sum-exp merge of the splits (which MLA's kernels share, kernels/mla_attention_triton.py).

One split program handles (sequence, KV head, split): it loads the whole group of query heads
that share that KV head (GQA tile, padded to a power of two), so each KV byte is read once per
group, and runs an online softmax over its split of the sequence, TILE_N tokens at a time (each
token finds its block through the block table, so any block size works). KIVI blocks
dequantize in the inner loop. The merge kernel combines every split of a row by LSE, and can
write the row's own LSE.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _load_kv_tile(
    base,
    phys,
    slot,
    head,
    offs_d,
    tmask,
    stride_n,
    stride_t,
    stride_h,
    HEAD_DIM: tl.constexpr,
    AS_STORED: tl.constexpr,
):
    """A [tokens, head_dim] tile of full-precision rows: in fp32, or as stored (AS_STORED)."""
    ptr = (
        base
        + phys[:, None] * stride_n
        + slot[:, None] * stride_t
        + head * stride_h
        + offs_d[None, :]
    )
    tile = tl.load(ptr, mask=tmask[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    if AS_STORED:
        return tile
    return tile.to(tl.float32)


@triton.jit
def _load_kivi_tile(
    codes,
    scale,
    zero,
    phys,
    slot,
    group_idx,
    head,
    offs_d,
    tmask,
    c_n,
    c_t,
    c_h,
    s_n,
    s_g,
    s_h,
    s_c,
    group_ch,
    HEAD_DIM: tl.constexpr,
    BITS: tl.constexpr,
):
    """Dequantize a [tokens, head_dim] tile: code * scale + zero, scale/zero indexed by group_ch."""
    PER: tl.constexpr = 8 // BITS
    m = tmask[:, None] & (offs_d[None, :] < HEAD_DIM)
    byte = tl.load(
        codes + phys[:, None] * c_n + slot[:, None] * c_t + head * c_h + (offs_d // PER)[None, :],
        mask=m,
        other=0,
    ).to(tl.int32)
    code = (byte >> ((offs_d % PER) * BITS)[None, :]) & ((1 << BITS) - 1)
    soff = phys[:, None] * s_n + group_idx[:, None] * s_g + head * s_h + group_ch[None, :] * s_c
    sc = tl.load(scale + soff, mask=m, other=0.0).to(tl.float32)
    zp = tl.load(zero + soff, mask=m, other=0.0).to(tl.float32)
    return code.to(tl.float32) * sc + zp


@triton.jit
def _paged_split_kernel(
    Q,
    K,
    V,
    KS,
    KZ,
    VS,
    VZ,
    BT,
    SL,
    OP,
    LP,
    stride_qb,
    stride_qh,
    stride_kn,
    stride_kt,
    stride_kh,
    stride_vn,
    stride_vt,
    stride_vh,
    ks_n,
    ks_g,
    ks_h,
    vs_n,
    vs_t,
    vs_h,
    stride_btb,
    split_tokens,
    split_base,
    scale,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    TILE_N: tl.constexpr,
    ROW_SPLITS: tl.constexpr,
    KIVI_BITS: tl.constexpr,
    KEY_GROUP: tl.constexpr,
    VAL_GROUP: tl.constexpr,
    DOT: tl.constexpr,
):
    """One (sequence, KV head, split)'s partial output rows and LSEs. Its two products are
    broadcast reductions in fp32 registers, or with DOT (full-precision blocks only) tensor-core
    matmuls: the group's query rows (padded to GROUP_P >= 16, tl.dot's least) against a tile of
    keys as stored, then the probabilities, rounded to the KV dtype as flash attention does,
    against its values; fp32 accumulation, and IEEE fp32 products for fp32 blocks."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SL + b)
    start = split * split_tokens
    end = tl.minimum(seq_len, start + split_tokens)

    offs_g = tl.arange(0, GROUP_P)
    offs_d = tl.arange(0, BLOCK_D)
    gmask = offs_g < GROUP
    dmask = offs_d < HEAD_DIM
    qh = kvh * GROUP + offs_g
    q = tl.load(
        Q + b * stride_qb + qh[:, None] * stride_qh + offs_d[None, :],
        mask=gmask[:, None] & dmask[None, :],
        other=0.0,
    )
    if DOT:
        # as the keys' dtype (a 16-bit model's rows are that already); the scale goes on the
        # scores, 1/sqrt(head_dim) being no power of two at every head_dim
        q = q.to(K.dtype.element_ty)
    else:
        q = q.to(tl.float32) * scale

    m_i = tl.full([GROUP_P], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([GROUP_P, BLOCK_D], tl.float32)
    offs_t = tl.arange(0, TILE_N)
    for t0 in range(start, end, TILE_N):
        tok = t0 + offs_t
        tmask = tok < end
        phys = tl.load(BT + b * stride_btb + tok // BLOCK_SIZE, mask=tmask, other=0).to(tl.int64)
        slot = tok % BLOCK_SIZE
        if KIVI_BITS == 0:
            k = _load_kv_tile(
                K, phys, slot, kvh, offs_d, tmask, stride_kn, stride_kt, stride_kh, HEAD_DIM, DOT
            )
            v = _load_kv_tile(
                V, phys, slot, kvh, offs_d, tmask, stride_vn, stride_vt, stride_vh, HEAD_DIM, DOT
            )
        else:
            # Keys: scale/zero per (token group of the block, channel);
            # values: per (token, channel group).
            k = _load_kivi_tile(
                K,
                KS,
                KZ,
                phys,
                slot,
                slot // KEY_GROUP,
                kvh,
                offs_d,
                tmask,
                stride_kn,
                stride_kt,
                stride_kh,
                ks_n,
                ks_g,
                ks_h,
                1,
                offs_d,
                HEAD_DIM,
                KIVI_BITS,
            )
            v = _load_kivi_tile(
                V,
                VS,
                VZ,
                phys,
                slot,
                slot,
                kvh,
                offs_d,
                tmask,
                stride_vn,
                stride_vt,
                stride_vh,
                vs_n,
                vs_t,
                vs_h,
                1,
                offs_d // VAL_GROUP,
                HEAD_DIM,
                KIVI_BITS,
            )
        if DOT:
            if K.dtype.element_ty == tl.float32:
                s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            else:
                s = tl.dot(q, tl.trans(k)) * scale
        else:
            # [GROUP_P, TILE_N] scores as a broadcast reduction: fp32 accuracy without tl.dot's
            # 16-row minimum for small GQA groups
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)
        s = tl.where(tmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if DOT:
            if V.dtype.element_ty == tl.float32:
                pv = tl.dot(p, v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(V.dtype.element_ty), v)
        else:
            pv = tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log(l_safe))
    # This launch's splits sit at [split_base, split_base + splits) of the row's ROW_SPLITS.
    row = (b * (GROUP * tl.num_programs(1)) + qh) * ROW_SPLITS + split_base + split
    tl.store(
        OP + row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=gmask[:, None] & dmask[None, :]
    )
    tl.store(LP + row, lse, mask=gmask)


@triton.jit
def _merge_kernel(
    OP,
    LP,
    OUT,
    LSE,
    stride_ob,
    stride_oh,
    q_heads,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_P: tl.constexpr,
    RETURN_LSE: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_P)
    offs_d = tl.arange(0, BLOCK_D)
    smask = offs_s < NUM_SPLITS
    row = (b * q_heads + h) * NUM_SPLITS
    lse = tl.load(LP + row + offs_s, mask=smask, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)  # every split empty: no -inf - -inf
    w = tl.where(lse == float("-inf"), 0.0, tl.exp(lse - m))
    part = tl.load(
        OP + (row + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
        mask=smask[:, None] & (offs_d[None, :] < HEAD_DIM),
        other=0.0,
    )
    den = tl.sum(w, axis=0)
    # Every split empty (a sequence of length 0): den 0, and the output is 0 (empty parts are 0).
    out = tl.sum(part * w[:, None], axis=0) / tl.where(den > 0.0, den, 1.0)
    tl.store(
        OUT + b * stride_ob + h * stride_oh + offs_d,
        out.to(OUT.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )
    if RETURN_LSE:
        lse_all = m + tl.log(tl.where(den > 0.0, den, 1.0))
        tl.store(LSE + b * q_heads + h, tl.where(den > 0.0, lse_all, float("-inf")))
