"""Triton flash-decoding over MLA latent blocks (absorbed form): the twin of
kernels/mla_attention.py's `paged_mla_decode_attention_torch`.

Every head attends over the same latent rows `[c_kv | k_rope]`, so one program handles
(sequence, tile of HEAD_TILE heads, split): it reads each row of its split once for the whole
tile of heads, scores it with two dots (`q_latent . c_kv + q_rope . k_rope`), and accumulates
`p @ c_kv` with an online softmax, TILE_N tokens at a time (each token finds its block through
the block table, so any block size works). The splits are merged by log-sum-exp with the
full-KV kernel's merge (`_merge_kernel`). Unlike the full-KV kernel's broadcast reductions
(sized for small GQA groups), the scores and the accumulation are `tl.dot`s: a tile of 16+ heads
against 16+ tokens of a kv_lora_rank-wide row is what dots are for.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.mla_attention import check_mla_shapes
from kernels.paged_attention_triton import INTERPRET, _merge_kernel, _num_splits

# tl.dot needs at least 16 rows and columns; the head tile is also the dot's M dimension.
MIN_DOT = 16


@triton.jit
def _mla_split_kernel(
    QL,
    QR,
    C,
    BT,
    SL,
    OP,
    LP,
    stride_qlb,
    stride_qlh,
    stride_qrb,
    stride_qrh,
    stride_cn,
    stride_ct,
    stride_btb,
    q_heads,
    split_tokens,
    scale,
    RANK: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_TILE: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    b = tl.program_id(0)
    heads = tl.program_id(1) * HEAD_TILE + tl.arange(0, HEAD_TILE)
    split = tl.program_id(2)
    seq_len = tl.load(SL + b)
    start = split * split_tokens
    end = tl.minimum(seq_len, start + split_tokens)

    offs_r = tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_P)
    hmask = heads < q_heads
    rmask = offs_r < RANK
    pmask = offs_p < ROPE
    q_lat = tl.load(
        QL + b * stride_qlb + heads[:, None] * stride_qlh + offs_r[None, :],
        mask=hmask[:, None] & rmask[None, :],
        other=0.0,
    ).to(tl.float32)
    q_rope = tl.load(
        QR + b * stride_qrb + heads[:, None] * stride_qrh + offs_p[None, :],
        mask=hmask[:, None] & pmask[None, :],
        other=0.0,
    ).to(tl.float32)

    m_i = tl.full([HEAD_TILE], float("-inf"), tl.float32)
    l_i = tl.zeros([HEAD_TILE], tl.float32)
    acc = tl.zeros([HEAD_TILE, BLOCK_R], tl.float32)
    offs_t = tl.arange(0, TILE_N)
    for t0 in range(start, end, TILE_N):
        tok = t0 + offs_t
        tmask = tok < end
        phys = tl.load(BT + b * stride_btb + tok // BLOCK_SIZE, mask=tmask, other=0).to(tl.int64)
        row = C + phys[:, None] * stride_cn + (tok % BLOCK_SIZE)[:, None] * stride_ct
        # Rows past the sequence's end may hold anything (NaN): masked loads read them as 0.
        lat = tl.load(row + offs_r[None, :], mask=tmask[:, None] & rmask[None, :], other=0.0)
        rope = tl.load(
            row + RANK + offs_p[None, :], mask=tmask[:, None] & pmask[None, :], other=0.0
        )
        if DOT_F32:  # an fp32 pool (or the interpreter): exact fp32 dots
            lat = lat.to(tl.float32)
            s = tl.dot(q_lat, tl.trans(lat), input_precision="ieee")
            s += tl.dot(q_rope, tl.trans(rope.to(tl.float32)), input_precision="ieee")
        else:  # a 16-bit pool: dots in its dtype, accumulated in fp32 (as flash attention)
            s = tl.dot(q_lat.to(lat.dtype), tl.trans(lat))
            s += tl.dot(q_rope.to(rope.dtype), tl.trans(rope))
        s = tl.where(tmask[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if DOT_F32:
            acc = acc * alpha[:, None] + tl.dot(p, lat, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(lat.dtype), lat)
        m_i = m_new

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log(l_safe))
    rows = (b * q_heads + heads) * NUM_SPLITS + split
    tl.store(OP + rows[:, None] * RANK + offs_r[None, :], out, mask=hmask[:, None] & rmask[None, :])
    tl.store(LP + rows, lse, mask=hmask)


def paged_mla_decode_attention_triton(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Flash-decoding absorbed MLA attention: the contract of
    `paged_mla_decode_attention_torch` (out_latent [B, H, kv_lora_rank] fp32; with return_lse
    also lse fp32 [B, H], -inf where seq_lens is 0, whose out is 0)."""
    check_mla_shapes(q_latent, q_rope, latent_cache, block_tables, seq_lens)
    if latent_cache.stride(-1) != 1:
        raise ValueError("MLA attention needs the latent pool to have unit stride along its rows")
    q_latent = q_latent if q_latent.stride(-1) == 1 else q_latent.contiguous()
    q_rope = q_rope if q_rope.stride(-1) == 1 else q_rope.contiguous()
    batch, heads, rank = q_latent.shape
    rope_dim = q_rope.shape[2]
    block_size = latent_cache.shape[1]
    head_tile = max(MIN_DOT, min(64, triton.next_power_of_2(heads)))
    head_tiles = -(-heads // head_tile)
    tile_n = MIN_DOT if INTERPRET else 32
    out = torch.zeros(batch, heads, rank, device=q_latent.device, dtype=torch.float32)
    lse = torch.full((batch, heads), float("-inf"), device=q_latent.device)
    # The block table bounds every sequence: no host sync on seq_lens.
    max_tokens = block_tables.shape[1] * block_size
    if max_tokens == 0 or batch == 0:
        return (out, lse) if return_lse else out
    splits = _num_splits(q_latent, batch, head_tiles, max_tokens, tile_n)
    per_split = -(-max_tokens // splits)  # ceiling division
    split_tokens = -(-per_split // tile_n) * tile_n  # whole tiles
    splits = -(-max_tokens // split_tokens)
    op = torch.empty(batch * heads * splits, rank, device=q_latent.device, dtype=torch.float32)
    lp = torch.empty(batch * heads * splits, device=q_latent.device, dtype=torch.float32)
    bt = block_tables if block_tables.dtype == torch.int32 else block_tables.to(torch.int32)
    sl = seq_lens if seq_lens.dtype == torch.int32 else seq_lens.to(torch.int32)
    _mla_split_kernel[(batch, head_tiles, splits)](
        q_latent,
        q_rope,
        latent_cache,
        bt,
        sl,
        op,
        lp,
        q_latent.stride(0),
        q_latent.stride(1),
        q_rope.stride(0),
        q_rope.stride(1),
        latent_cache.stride(0),
        latent_cache.stride(1),
        bt.stride(0),
        heads,
        split_tokens,
        float(scale),
        RANK=rank,
        ROPE=rope_dim,
        BLOCK_R=max(MIN_DOT, triton.next_power_of_2(rank)),
        BLOCK_P=max(MIN_DOT, triton.next_power_of_2(rope_dim)),
        BLOCK_SIZE=block_size,
        HEAD_TILE=head_tile,
        TILE_N=tile_n,
        NUM_SPLITS=splits,
        # bf16 tl.dot is broken in the interpreter: it dots in fp32 there
        DOT_F32=latent_cache.dtype == torch.float32
        or (INTERPRET and latent_cache.dtype != torch.float16),
    )
    _merge_kernel[(batch, heads)](
        op,
        lp,
        out,
        lse,
        out.stride(0),
        out.stride(1),
        heads,
        HEAD_DIM=rank,
        BLOCK_D=triton.next_power_of_2(rank),
        NUM_SPLITS=splits,
        SPLITS_P=triton.next_power_of_2(splits),
        RETURN_LSE=return_lse,
    )
    return (out, lse) if return_lse else out
