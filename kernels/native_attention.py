"""Decode attention on the fused CPU kernels (csrc/decode_attention.c) over the paged KV pool:
full-precision blocks, absorbed-MLA latent rows, KIVI blocks, and KIVI blocks with their
full-precision window in one online softmax; and the dispatch's "native" backend on them, each
with its torch twin's contract, that twin where the kernels are not built or the shapes do not
fit them.
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import torch

from kernels import native
from kernels.kivi import KiviPacked
from kernels.native_build import _library, _warn_once, native_status
from kernels.paged_attention_torch import (
    check_window_shapes,
    merge_attention,
    paged_decode_attention_kivi_torch,
    paged_decode_attention_torch,
)

# The C kernel's per-block arrays (csrc/decode_attention.c HM_MAX_BS)
MAX_BLOCK_SIZE = 256
# KV dtype -> the code the C kernels take it as
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def supports(q: torch.Tensor, kv_heads: int, block_size: int) -> bool:
    """True when q is on the CPU and these shapes fit the kernel."""
    return (
        q.device.type == "cpu"
        and block_size <= MAX_BLOCK_SIZE
        and kv_heads > 0
        and q.shape[1] % kv_heads == 0
    )


def _common(q, block_tables, seq_lens, block_size, scale, out_dim: int | None = None):
    """(q fp32 contiguous, tables int32, lens int32, scale, out, lse) with the table checked to
    cover every length; out [B, QH, out_dim], head_dim wide by default."""
    batch, q_heads, head_dim = q.shape
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    if lens.numel() != batch or tables.shape[0] != batch:
        raise ValueError(f"{batch} queries, {lens.numel()} lengths, {tables.shape[0]} tables")
    longest = int(lens.max()) if batch else 0
    if longest > tables.shape[1] * block_size or (batch and int(lens.min()) < 0):
        raise ValueError(
            f"sequence lengths up to {longest} need {-(-longest // block_size)} table columns, "
            f"have {tables.shape[1]}"
        )
    scale = head_dim**-0.5 if scale is None else float(scale)
    out = torch.empty(batch, q_heads, out_dim or head_dim)
    lse = torch.empty(batch, q_heads)
    return q.float().contiguous(), tables, lens, scale, out, lse


def _check_bad(bad: int) -> None:
    if bad < 0:
        raise MemoryError("fused CPU attention could not allocate its per-sequence state")
    if bad:
        raise IndexError(f"block table of sequence {bad - 1} names a block outside the pool")


def paged_attention_full(q, k_cache, v_cache, block_tables, seq_lens, scale=None):
    """(out fp32 [B, QH, D], lse fp32 [B, QH]) of decode attention over full-precision blocks
    k_cache/v_cache [num_blocks, block_size, kv_heads, head_dim] (fp32, bf16 or fp16; strided
    views of a pool are read in place)."""
    lib, _ = _library()
    num_blocks, block_size, kv_heads, head_dim = k_cache.shape
    if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1:
        raise ValueError("K and V views need equal strides and a contiguous head_dim")
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in _DTYPE_CODES:
        raise ValueError(f"unsupported KV dtype {k_cache.dtype}/{v_cache.dtype}")
    qf, tables, lens, scale, out, lse = _common(q, block_tables, seq_lens, block_size, scale)
    s = k_cache.stride()
    bad = lib.hm_paged_attention_full(
        qf.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), _DTYPE_CODES[k_cache.dtype],
        num_blocks, s[0], s[1], s[2], tables.data_ptr(), tables.stride(0), lens.data_ptr(),
        q.shape[0], q.shape[1], kv_heads, head_dim, block_size, scale,
        torch.get_num_threads(), out.data_ptr(), lse.data_ptr(),
    )  # fmt: skip
    _check_bad(bad)
    return out, lse


def paged_attention_latent(q, latent_cache, block_tables, seq_lens, scale, value_dim: int):
    """(out fp32 [B, QH, value_dim], lse fp32 [B, QH]) of absorbed MLA decode attention: every
    query row q [B, QH, D] attends over its sequence's latent rows latent_cache [num_blocks,
    block_size, D] (fp32, bf16 or fp16, contiguous rows) as keys, and over their first
    value_dim columns as values (each row read once for both)."""
    lib, _ = _library()
    num_blocks, block_size, head_dim = latent_cache.shape
    if latent_cache.stride(2) != 1 or latent_cache.dtype not in _DTYPE_CODES:
        raise ValueError(f"unsupported latent rows {latent_cache.dtype}, strides "
                         f"{latent_cache.stride()}")  # fmt: skip
    if not 0 < value_dim <= head_dim:
        raise ValueError(f"value_dim {value_dim} outside a row of {head_dim}")
    qf, tables, lens, scale, out, lse = _common(
        q, block_tables, seq_lens, block_size, scale, value_dim
    )
    s = latent_cache.stride()
    bad = lib.hm_paged_attention_latent(
        qf.data_ptr(), latent_cache.data_ptr(), _DTYPE_CODES[latent_cache.dtype], num_blocks,
        s[0], s[1], tables.data_ptr(), tables.stride(0), lens.data_ptr(), q.shape[0],
        q.shape[1], head_dim, value_dim, block_size, scale, torch.get_num_threads(),
        out.data_ptr(), lse.data_ptr(),
    )  # fmt: skip
    _check_bad(bad)
    return out, lse


class _KiviArgs(NamedTuple):
    """A KIVI pool layer as the C kernel takes it."""

    num_blocks: int
    block_size: int
    kv_heads: int
    head_dim: int
    bits: int
    gk: int  # tokens per key group
    vg: int  # value groups per row
    gv: int  # channels per value group
    ptrs: ctypes.Array  # each field's base pointer
    strides: ctypes.Array  # each field's bytes from one block to the next


def kivi_args(pool: KiviPacked) -> _KiviArgs:
    """The C kernel's view of `pool`, read from shapes and strides alone (no tensor ops: this
    runs once per layer per step); ValueError unless every field is contiguous within a block."""
    num_blocks, block_size, kv_heads, packed = pool.k_codes.shape
    kg, head_dim, vg = pool.k_scale.shape[1], pool.k_scale.shape[-1], pool.v_scale.shape[-1]
    bits = packed * 8 // head_dim
    for f in pool:
        inner, want = f.stride()[1:], []
        size = 1
        for dim in reversed(f.shape[1:]):
            want.insert(0, size)
            size *= dim
        if f.shape[0] != num_blocks or list(inner) != want:
            raise ValueError("each KIVI field needs num_blocks rows, contiguous within a block")
    if bits not in (2, 4, 8) or packed * 8 != bits * head_dim:
        raise ValueError(f"kivi codes of {packed} bytes do not fit head_dim {head_dim}")
    return _KiviArgs(
        num_blocks,
        block_size,
        kv_heads,
        head_dim,
        bits,
        -(-block_size // kg),
        vg,
        -(-head_dim // vg),
        (ctypes.c_void_p * 6)(*(f.data_ptr() for f in pool)),
        (ctypes.c_int64 * 6)(*(f.stride(0) * f.element_size() for f in pool)),
    )


def paged_attention_kivi(q, pool: KiviPacked, block_tables, seq_lens, scale=None):
    """(out fp32 [B, QH, D], lse fp32 [B, QH]) of decode attention over KIVI blocks: pool's
    fields carry a leading num_blocks dim and may be strided views of a packed pool (each field
    contiguous within a block)."""
    lib, _ = _library()
    a = kivi_args(pool)
    qf, tables, lens, scale, out, lse = _common(q, block_tables, seq_lens, a.block_size, scale)
    bad = lib.hm_paged_attention_kivi(
        qf.data_ptr(), a.ptrs, a.strides, a.num_blocks, a.bits, a.gk, a.vg, a.gv,
        tables.data_ptr(), tables.stride(0), lens.data_ptr(),
        q.shape[0], q.shape[1], a.kv_heads, a.head_dim, a.block_size, scale,
        torch.get_num_threads(), out.data_ptr(), lse.data_ptr(),
    )  # fmt: skip
    _check_bad(bad)
    return out, lse


def paged_attention_kivi_window(
    q, pool: KiviPacked, tables, lens, k_window, v_window, window_tables, window_lens, scale=None
):
    """(out fp32, lse fp32) of attention over each sequence's KIVI blocks and then its
    full-precision window blocks, in one online softmax (the exact merge of the two parts)."""
    lib, _ = _library()
    a = kivi_args(pool)
    if k_window.stride() != v_window.stride() or k_window.stride(3) != 1:
        raise ValueError("window K and V views need equal strides and a contiguous head_dim")
    if k_window.dtype != v_window.dtype or k_window.dtype not in _DTYPE_CODES:
        raise ValueError(f"unsupported window dtype {k_window.dtype}/{v_window.dtype}")
    w_block = k_window.shape[1]
    if w_block > MAX_BLOCK_SIZE:
        raise ValueError(f"window blocks of {w_block} tokens exceed {MAX_BLOCK_SIZE}")
    qf, tables, lens, scale, out, lse = _common(q, tables, lens, a.block_size, scale)
    _, wtables, wlens, _, _, _ = _common(q, window_tables, window_lens, w_block, scale)
    w = k_window.stride()
    bad = lib.hm_paged_attention_kivi_window(
        qf.data_ptr(), a.ptrs, a.strides, a.num_blocks, a.bits, a.gk, a.vg, a.gv,
        tables.data_ptr(), tables.stride(0), lens.data_ptr(),
        k_window.data_ptr(), v_window.data_ptr(), _DTYPE_CODES[k_window.dtype],
        k_window.shape[0], w[0], w[1], w[2], wtables.data_ptr(), wtables.stride(0),
        wlens.data_ptr(), w_block,
        q.shape[0], q.shape[1], a.kv_heads, a.head_dim, a.block_size, scale,
        torch.get_num_threads(), out.data_ptr(), lse.data_ptr(),
    )  # fmt: skip
    _check_bad(bad)
    return out, lse


# ---- the dispatch's "native" backend: the torch twins' contracts ----


def paged_decode_attention_native(
    q, k_cache, v_cache, block_tables, seq_lens, scale=None, split_bytes=None, *, return_lse=False
):
    """`paged_decode_attention_torch`'s contract on the fused kernel (the twin where the kernel
    is not built or the shapes do not fit it)."""
    _, block_size, kv_heads, _ = k_cache.shape
    fits = supports(q, kv_heads, block_size) and k_cache.stride(3) == 1
    if not (native_status().available and fits and k_cache.stride() == v_cache.stride()):
        if native_status().available:
            _warn_once(f"KV views {tuple(k_cache.stride())} / block size {block_size} not fused")
        return paged_decode_attention_torch(
            q, k_cache, v_cache, block_tables, seq_lens, scale, split_bytes, return_lse=return_lse
        )
    out, lse = paged_attention_full(q, k_cache, v_cache, block_tables, seq_lens, scale)
    return (out.to(q.dtype), lse) if return_lse else out.to(q.dtype)


def paged_decode_attention_kivi_native(
    q, kv_pool: KiviPacked, block_tables, seq_lens, scale=None, split_bytes=None, *,
    return_lse=False,
):  # fmt: skip
    """`paged_decode_attention_kivi_torch`'s contract on the fused kernel."""
    _, block_size, kv_heads, _ = kv_pool.k_codes.shape
    if not (native_status().available and supports(q, kv_heads, block_size)):
        return paged_decode_attention_kivi_torch(
            q, kv_pool, block_tables, seq_lens, scale, split_bytes, return_lse=return_lse
        )
    out, lse = paged_attention_kivi(q, kv_pool, block_tables, seq_lens, scale)
    return (out.to(q.dtype), lse) if return_lse else out.to(q.dtype)


def paged_decode_attention_kivi_window_native(
    q, packed_pool, packed_tables, packed_lens, k_window, v_window, window_tables, window_lens,
    scale=None, split_bytes=None,
):  # fmt: skip
    """`paged_decode_attention_kivi_window_torch`'s contract on one fused kernel call: each
    sequence's packed blocks, then its window, in one online softmax."""
    check_window_shapes(q, packed_pool, k_window, v_window)
    _, block_size, kv_heads, _ = packed_pool.k_codes.shape
    fits = (
        native_status().available
        and supports(q, kv_heads, max(block_size, k_window.shape[1]))
        and k_window.stride() == v_window.stride()
        and k_window.stride(3) == 1
    )
    if not fits:
        out, _ = merge_attention(
            *paged_decode_attention_kivi_native(
                q, packed_pool, packed_tables, packed_lens, scale, split_bytes, return_lse=True
            ),
            *paged_decode_attention_native(
                q, k_window, v_window, window_tables, window_lens, scale, split_bytes,
                return_lse=True,
            ),
        )  # fmt: skip
        return out.to(q.dtype)
    out, _ = paged_attention_kivi_window(
        q, packed_pool, packed_tables, packed_lens, k_window, v_window, window_tables,
        window_lens, scale,
    )  # fmt: skip
    return out.to(q.dtype)


def paged_mla_decode_attention_native(
    q_latent, q_rope, latent_cache, block_tables, seq_lens, scale, split_bytes=None, *,
    return_lse=False,
):  # fmt: skip
    """`paged_mla_decode_attention_torch`'s contract on the fused full-precision kernel: absorbed
    MLA is attention with every head on one KV head whose key is the row [c_kv | k_rope] and
    whose value is the same row (the output's rope columns are dropped)."""
    from kernels.mla_attention import check_mla_shapes, paged_mla_decode_attention_torch

    check_mla_shapes(q_latent, q_rope, latent_cache, block_tables, seq_lens)
    fits = supports(q_latent, 1, latent_cache.shape[1]) and latent_cache.stride(2) == 1
    if not (native_status().available and fits and latent_cache.dtype in _DTYPE_CODES):
        return paged_mla_decode_attention_torch(
            q_latent, q_rope, latent_cache, block_tables, seq_lens, scale, split_bytes,
            return_lse=return_lse,
        )  # fmt: skip
    q = torch.cat([q_latent.float(), q_rope.float()], dim=-1)
    rank = q_latent.shape[-1]
    parts = torch.get_num_threads() // q.shape[0]
    if parts > 1 and int(seq_lens.max()) >= native._MLA_SPLIT_TOKENS:
        out, lse = _split_sequences(q, latent_cache, block_tables, seq_lens, scale, parts, rank)
    else:
        out, lse = paged_attention_latent(q, latent_cache, block_tables, seq_lens, scale, rank)
    return (out, lse) if return_lse else out


def _split_sequences(q, rows, block_tables, seq_lens, scale, parts: int, value_dim: int):
    """paged_attention_latent with each sequence's blocks cut into `parts` runs, each run a
    sequence of its own (its own work item), merged back by their log-sum-exps (exact)."""
    batch, bs = q.shape[0], rows.shape[1]
    per = -(-block_tables.shape[1] // parts)  # blocks a run
    tables = torch.zeros(batch, parts * per, dtype=block_tables.dtype)
    tables[:, : block_tables.shape[1]] = block_tables
    starts = torch.arange(parts, dtype=seq_lens.dtype) * (per * bs)
    lens = (seq_lens.view(-1, 1) - starts).clamp(0, per * bs)
    out, lse = paged_attention_latent(
        q.repeat_interleave(parts, 0), rows, tables.view(batch * parts, per), lens.reshape(-1),
        scale, value_dim,
    )  # fmt: skip
    out, lse = out.view(batch, parts, *out.shape[1:]), lse.view(batch, parts, -1)
    top = lse.amax(1, keepdim=True)
    w = torch.where(lse.isfinite(), torch.exp(lse - top), 0.0)  # an empty run weighs nothing
    mass = w.sum(1)
    merged = (out * w.unsqueeze(-1)).sum(1) / mass.clamp_min(1e-30).unsqueeze(-1)
    return merged, torch.where(mass > 0, top.squeeze(1) + mass.log(), float("-inf"))
