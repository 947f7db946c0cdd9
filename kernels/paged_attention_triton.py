"""Triton flash-decoding over the paged KV pool: split-KV partial kernel + log-sum-exp merge kernel.

One program handles (sequence, KV head, split): it loads the whole group of query heads that share
that KV head (GQA tile, padded to a power of two), so each KV byte is read once per group, and runs
an online softmax over its split of the sequence, TILE_N tokens at a time (each token finds its
block through the block table, so any block size works). A second kernel merges the splits by LSE.
Full-precision blocks and KIVI blocks share the kernel; KIVI dequantizes in the inner loop.

The merge can also return each (sequence, query head)'s log-sum-exp (`return_lse=True`), and it
merges splits of more than one source at once: KIVI attention over packed blocks plus the
full-precision window of recent tokens (`paged_decode_attention_kivi_window_triton`) launches the
split kernel once per source into one buffer of partial results and merges them all in one pass.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.kivi import KiviPacked, kivi_layout
from kernels.paged_attention_torch import check_window_shapes

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


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


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _num_splits(
    q: torch.Tensor, batch: int, kv_heads: int, max_tokens: int, tile_n: int, per_sm: int = 4
) -> int:
    """Enough (sequence, head, split) programs to fill the GPU (`per_sm` a multiprocessor), each
    with at least one tile."""
    if q.device.type == "cuda":
        target = per_sm * _sm_count(
            q.device.index if q.device.index is not None else torch.cuda.current_device()
        )
    else:
        target = 4  # the interpreter: few programs, but still more than one split to merge
    splits = max(1, -(-target // (batch * kv_heads)))
    return max(1, min(splits, -(-max_tokens // tile_n)))


class _Source(NamedTuple):
    """One set of paged blocks to attend over: full precision (stats None) or KIVI."""

    k: torch.Tensor
    v: torch.Tensor
    stats: tuple | None  # KIVI (k_scale, k_zero, v_scale, v_zero)
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    block_size: int
    kivi_bits: int = 0
    key_group: int = 1
    val_group: int = 1


def _full_source(k_cache, v_cache, block_tables, seq_lens) -> _Source:
    return _Source(k_cache, v_cache, None, block_tables, seq_lens, k_cache.shape[1])


def _kivi_source(kv_pool: KiviPacked, block_tables, seq_lens) -> _Source:
    block_size, _, _, bits, gk, gv = kivi_layout(kv_pool)
    for f in kv_pool:
        if f.stride(-1) != 1:
            raise ValueError("kivi pool fields need unit stride along their last dim")
    stats = (kv_pool.k_scale, kv_pool.k_zero, kv_pool.v_scale, kv_pool.v_zero)
    return _Source(
        kv_pool.k_codes, kv_pool.v_codes, stats, block_tables, seq_lens, block_size, bits, gk, gv
    )


def _launch(
    q,
    sources,
    scale,
    kv_heads,
    head_dim,
    return_lse=False,
    tile_n=None,
    per_sm=4,
    num_warps=None,
    form="reduce",
):
    """Attention of q over the union of `sources`' tokens: each source's split kernel writes its
    partial (output, LSE) rows into one buffer, and one merge kernel combines them all.
    `tile_n`, `per_sm` (split programs a multiprocessor), `num_warps` (the split kernel's;
    None: Triton's default) and `form` are the tuning bench/decode_attn_sweep.py searches on a
    GPU. `form`: "reduce", products as broadcast reductions in fp32 registers; "dot", products
    as tl.dot on tensor cores (full-precision sources only, KIVI's stay "reduce"). Not yet
    measured on a GPU: "reduce" stays the default."""
    if form not in ("reduce", "dot"):
        raise ValueError(f"form is 'reduce' or 'dot', not {form!r}")
    batch, q_heads, _ = q.shape
    if q_heads % kv_heads:
        raise ValueError(f"q_heads {q_heads} is not a multiple of kv_heads {kv_heads}")
    for src in sources:
        if src.k.stride(-1) != 1 or src.v.stride(-1) != 1:
            raise ValueError("paged attention needs the KV pool to have unit stride along head_dim")
    if q.stride(-1) != 1:
        q = q.contiguous()
    group = q_heads // kv_heads
    scale = head_dim**-0.5 if scale is None else float(scale)
    block_d = triton.next_power_of_2(head_dim)
    group_p = triton.next_power_of_2(group)
    # The [group, tile, head_dim] product lives in registers: keep it near 8K fp32 values a program.
    tile_n = tile_n or (16 if INTERPRET or group_p * block_d > 256 else 32)
    if form == "dot":
        tile_n = max(16, tile_n)  # tl.dot's least
    plans = []
    for src in sources:
        # The block table bounds every sequence: no host sync on seq_lens.
        max_tokens = src.block_tables.shape[1] * src.block_size
        if max_tokens == 0:
            continue  # no block-table columns: nothing to attend to in this source
        splits = _num_splits(q, batch, kv_heads, max_tokens, tile_n, per_sm)
        per_split = -(-max_tokens // splits)
        split_tokens = -(-per_split // tile_n) * tile_n  # whole tiles
        plans.append((src, -(-max_tokens // split_tokens), split_tokens))
    out = torch.empty_like(q)
    lse = torch.empty(batch, q_heads, device=q.device, dtype=torch.float32) if return_lse else out
    row_splits = sum(splits for _, splits, _ in plans)
    if row_splits == 0:
        out.zero_()
        if return_lse:
            lse.fill_(float("-inf"))
            return out, lse
        return out
    op = torch.empty(batch * q_heads * row_splits, head_dim, device=q.device, dtype=torch.float32)
    lp = torch.empty(batch * q_heads * row_splits, device=q.device, dtype=torch.float32)
    split_base = 0
    for src, splits, split_tokens in plans:
        k, v = src.k, src.v
        ks, kz, vs, vz = src.stats if src.stats is not None else (k, k, v, v)
        bt = src.block_tables
        bt = bt if bt.dtype == torch.int32 else bt.to(torch.int32)
        sl = src.seq_lens if src.seq_lens.dtype == torch.int32 else src.seq_lens.to(torch.int32)
        dot = form == "dot" and src.stats is None  # KIVI sources: reductions
        _paged_split_kernel[(batch, kv_heads, splits)](
            q,
            k,
            v,
            ks,
            kz,
            vs,
            vz,
            bt,
            sl,
            op,
            lp,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            k.stride(2),
            v.stride(0),
            v.stride(1),
            v.stride(2),
            ks.stride(0),
            ks.stride(1),
            ks.stride(2),
            vs.stride(0),
            vs.stride(1),
            vs.stride(2),
            bt.stride(0),
            split_tokens,
            split_base,
            scale,
            BLOCK_SIZE=src.block_size,
            HEAD_DIM=head_dim,
            BLOCK_D=max(16, block_d) if dot else block_d,
            GROUP=group,
            GROUP_P=max(16, group_p) if dot else group_p,
            TILE_N=tile_n,
            ROW_SPLITS=row_splits,
            KIVI_BITS=src.kivi_bits,
            KEY_GROUP=src.key_group,
            VAL_GROUP=src.val_group,
            DOT=dot,
            **({"num_warps": num_warps} if num_warps else {}),
        )
        split_base += splits
    _merge_kernel[(batch, q_heads)](
        op,
        lp,
        out,
        lse,
        out.stride(0),
        out.stride(1),
        q_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        NUM_SPLITS=row_splits,
        SPLITS_P=triton.next_power_of_2(row_splits),
        RETURN_LSE=return_lse,
    )
    return (out, lse) if return_lse else out


def paged_decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    *,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Flash-decoding paged attention (same contract as `paged_decode_attention_ref`); with
    return_lse, (out, lse fp32 [batch, q_heads]; -inf where seq_lens is 0, whose out is 0)."""
    _, _, kv_heads, head_dim = k_cache.shape
    source = _full_source(k_cache, v_cache, block_tables, seq_lens)
    return _launch(q, [source], scale, kv_heads, head_dim, return_lse)


def paged_decode_attention_kivi_triton(
    q: torch.Tensor,
    kv_pool: KiviPacked,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    *,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Flash-decoding over KIVI blocks (KiviPacked fields with a leading num_blocks dim); with
    return_lse, (out, lse fp32 [batch, q_heads])."""
    _, kv_heads, head_dim, _, _, _ = kivi_layout(kv_pool)
    source = _kivi_source(kv_pool, block_tables, seq_lens)
    return _launch(q, [source], scale, kv_heads, head_dim, return_lse)


def paged_decode_attention_kivi_window_triton(
    q: torch.Tensor,
    packed_pool: KiviPacked,
    packed_tables: torch.Tensor,
    packed_lens: torch.Tensor,
    k_window: torch.Tensor,
    v_window: torch.Tensor,
    window_tables: torch.Tensor,
    window_lens: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """KIVI decode attention over packed blocks plus the full-precision window (the contract of
    `paged_decode_attention_kivi_window_torch`): both sources' splits merged in one LSE pass."""
    check_window_shapes(q, packed_pool, k_window, v_window)
    _, _, kv_heads, head_dim = k_window.shape
    sources = [
        _kivi_source(packed_pool, packed_tables, packed_lens),
        _full_source(k_window, v_window, window_tables, window_lens),
    ]
    return _launch(q, sources, scale, kv_heads, head_dim)
