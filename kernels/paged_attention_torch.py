"""Vectorised torch paged decode attention: the CPU fast path and the Triton kernel's twin.

Same algorithm as the Triton flash-decoding kernel: each sequence's KV is cut into splits
(`chunk_blocks` block-table columns at a time, for the whole batch at once), each split is attended
with its own softmax and returns (output, log-sum-exp), and the splits are merged by log-sum-exp.
A split gathers its blocks into a small staging buffer that stays in cache, so every byte of KV
is read from memory once, instead of gathering the whole KV into a second full-size copy.
"""

from __future__ import annotations

import torch

from kernels.kivi import KiviPacked, kivi_dequantize_keys, kivi_dequantize_values

# Bytes of staged K+V per split. Small splits stay cache-resident (6 MiB measured best on an idle
# 2-core EPYC), but every split costs a few parallel regions, and on a shared machine each region
# can wait a scheduler time slice for its second thread: 16 MiB (inside a 32 MiB L3) keeps them
# few.
SPLIT_BYTES = 16 * 2**20

_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _attend(
    q4: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of q4 [B, QH, 1, D] over k, v [B, KH, T, D] (fp32) -> (out, lse [B, QH,
    1])."""
    if _FLASH_CPU is not None and q4.device.type == "cpu":
        return _FLASH_CPU(q4, k, v, attn_mask=mask, scale=scale)
    return _attend_matmul(q4, k, v, mask, scale)


def _attend_matmul(q4, k, v, mask, scale):
    """Portable twin of `_attend` (other devices, or a torch without the CPU flash op)."""
    b, qh, _, d = q4.shape
    kh = k.shape[1]
    qg = q4.reshape(b, kh, qh // kh, d)
    s = torch.matmul(qg, k.transpose(-1, -2)) * scale  # [B, KH, G, T]
    if mask is not None:
        s = s + mask  # [B, 1, 1, T] additive
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    p = torch.exp(s - lse.nan_to_num(neginf=0.0))
    out = torch.matmul(p, v)
    return out.reshape(b, qh, 1, d), lse.reshape(b, qh, 1)


def merge_splits(outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """Merge split outputs [S, ..., D] by their log-sum-exps [S, ...] (-inf: empty split, finite
    output)."""
    w = torch.softmax(
        lses, dim=0
    )  # exp(lse_s - logsumexp(lses)): each split's share of the softmax mass
    return (outs * w[..., None]).sum(dim=0)


def _split_plan(block_tables, seq_lens, block_size, bytes_per_block_column, split_bytes):
    """(table [B, n_blocks] long, lens list, n_blocks, chunk_blocks) for one call."""
    lens = [int(x) for x in seq_lens.tolist()]
    n_blocks = (max(lens) + block_size - 1) // block_size
    table = block_tables[:, :n_blocks].long()
    most = max(1, (split_bytes or SPLIT_BYTES) // max(1, bytes_per_block_column))
    splits = -(-n_blocks // most)
    return table, lens, n_blocks, -(-n_blocks // splits)  # equal splits, none a straggler


def _run_splits(q, table, lens, n_blocks, chunk, block_size, kv_heads, head_dim, scale, load_chunk):
    """Attend over table's columns `chunk` at a time; load_chunk(idx, n) -> (k, v) fp32 [B, n*bs,
    KH, D]."""
    batch, q_heads, _ = q.shape
    q4 = q.reshape(batch, q_heads, 1, head_dim).float()
    lens_t = torch.tensor(lens, device=q.device)
    min_len = min(lens)
    outs, lses = [], []
    for c0 in range(0, n_blocks, chunk):
        n = min(chunk, n_blocks - c0)
        t0, t1 = c0 * block_size, (c0 + n) * block_size
        idx = table[:, c0 : c0 + n].reshape(-1)
        ragged = min_len < t1
        if ragged:
            valid = torch.arange(t0, t1, device=q.device)[None, :] < lens_t[:, None]  # [B, T]
            # Block-table entries past a sequence's end may be anything: read block 0 instead.
            idx = torch.where(valid[:, ::block_size].reshape(-1), idx, 0)
        k, v = load_chunk(idx, n)
        mask = None
        if ragged:
            # Unwritten slots may hold NaN: zero them so that 0-weight * slot stays 0.
            k.masked_fill_(~valid[:, :, None, None], 0.0)
            v.masked_fill_(~valid[:, :, None, None], 0.0)
            mask = torch.zeros(batch, 1, 1, t1 - t0, device=q.device)
            mask.masked_fill_(~valid[:, None, None, :], float("-inf"))
        o, lse = _attend(q4, k.transpose(1, 2), v.transpose(1, 2), mask, scale)
        if min_len <= t0:
            lse = lse.masked_fill((lens_t <= t0)[:, None, None], float("-inf"))
        outs.append(o.reshape(batch, q_heads, head_dim))
        lses.append(lse.reshape(batch, q_heads))
    if len(outs) == 1:
        return outs[0]
    return merge_splits(torch.stack(outs), torch.stack(lses))


def paged_decode_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    split_bytes: int | None = None,
) -> torch.Tensor:
    """Split-KV paged decode attention in torch (same contract as `paged_decode_attention_ref`)."""
    batch, q_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    scale = head_dim**-0.5 if scale is None else float(scale)
    need_convert = k_cache.dtype != torch.float32
    per_col = (
        batch
        * block_size
        * kv_heads
        * head_dim
        * 2
        * (4 + (k_cache.element_size() if need_convert else 0))
    )
    table, lens, n_blocks, chunk = _split_plan(
        block_tables, seq_lens, block_size, per_col, split_bytes
    )
    shape = (batch * chunk, block_size, kv_heads, head_dim)
    # Staging buffers allocated once per call and reused by every split (fresh multi-MiB
    # allocations cost page faults that are as slow as the copy itself).
    kbuf = torch.empty(shape, dtype=k_cache.dtype, device=q.device)
    vbuf = torch.empty(shape, dtype=v_cache.dtype, device=q.device)
    kf, vf = (
        (torch.empty(shape, device=q.device), torch.empty(shape, device=q.device))
        if need_convert
        else (kbuf, vbuf)
    )

    def load_chunk(idx, n):
        rows = idx.numel()
        torch.index_select(k_cache, 0, idx, out=kbuf[:rows])
        torch.index_select(v_cache, 0, idx, out=vbuf[:rows])
        if need_convert:
            kf[:rows].copy_(kbuf[:rows])
            vf[:rows].copy_(vbuf[:rows])
        view = (batch, n * block_size, kv_heads, head_dim)
        return kf[:rows].view(view), vf[:rows].view(view)

    out = _run_splits(
        q, table, lens, n_blocks, chunk, block_size, kv_heads, head_dim, scale, load_chunk
    )
    return out.to(q.dtype)


def paged_decode_attention_kivi_torch(
    q: torch.Tensor,
    kv_pool: KiviPacked,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    split_bytes: int | None = None,
) -> torch.Tensor:
    """Split-KV paged decode attention over KIVI blocks (fields with a leading num_blocks dim)."""
    batch, q_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = kv_pool.k_codes.shape
    scale = head_dim**-0.5 if scale is None else float(scale)
    per_col = batch * block_size * kv_heads * head_dim * 2 * 5
    table, lens, n_blocks, chunk = _split_plan(
        block_tables, seq_lens, block_size, per_col, split_bytes
    )

    def load_chunk(idx, n):
        blocks = KiviPacked(*(f.index_select(0, idx) for f in kv_pool))
        view = (batch, n * block_size, kv_heads, head_dim)
        return kivi_dequantize_keys(blocks).view(view), kivi_dequantize_values(blocks).view(view)

    out = _run_splits(
        q, table, lens, n_blocks, chunk, block_size, kv_heads, head_dim, scale, load_chunk
    )
    return out.to(q.dtype)
