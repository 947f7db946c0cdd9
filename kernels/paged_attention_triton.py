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

This module plans the launches; the kernels themselves are paged_attention_triton_jit.py.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch
import triton

from kernels.kivi import KiviPacked, kivi_layout
from kernels.paged_attention_torch import check_window_shapes
from kernels.paged_attention_triton_jit import _merge_kernel, _paged_split_kernel

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


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
