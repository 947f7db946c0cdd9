"""Vectorised torch paged decode attention: the CPU fast path and the Triton kernel's twin.

Same algorithm as the Triton flash-decoding kernel: each sequence's KV is cut into splits
(`chunk_blocks` block-table columns at a time, for the whole batch at once), each split is attended
with its own softmax and returns (output, log-sum-exp), and the splits are merged by log-sum-exp.
A split gathers its blocks into a small staging buffer that stays in cache, so every byte of KV
is read from memory once, instead of gathering the whole KV into a second full-size copy.

`return_lse=True` also returns each (sequence, query head)'s log-sum-exp of its scaled scores
(fp32, -inf for a sequence of length 0, whose output is 0), so that attention over disjoint token
sets can be merged exactly (`merge_attention`): KIVI's packed blocks plus its full-precision window
of recent tokens is one such pair (`paged_decode_attention_kivi_window_torch`).
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


def merge_splits(
    outs: torch.Tensor, lses: torch.Tensor, return_lse: bool = False
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Merge split outputs [S, ..., D] by their log-sum-exps [S, ...] (-inf: empty split, finite
    output); with return_lse also the merged log-sum-exp [...]. A row whose splits are all empty
    merges to NaN here: the caller zeroes it."""
    # exp(lse_s - logsumexp(lses)): each split's share of the softmax mass
    w = torch.softmax(lses, dim=0)
    out = (outs * w[..., None]).sum(dim=0)
    if return_lse:
        return out, torch.logsumexp(lses, dim=0)
    return out


def merge_attention(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact softmax merge of attention over two disjoint token sets: out [..., D] and lse [...]
    of each (lse -inf: that part is empty, its out must be finite) -> (out, lse) in fp32, out =
    (e^lse_a out_a + e^lse_b out_b) / (e^lse_a + e^lse_b), lse = log(e^lse_a + e^lse_b); both parts
    empty -> (0, -inf)."""
    lse_a, lse_b = lse_a.float(), lse_b.float()
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(m == float("-inf"), 0.0, m)  # both empty: exp(-inf - 0) = 0 weights
    wa, wb = torch.exp(lse_a - m), torch.exp(lse_b - m)  # the larger is 1: no overflow
    den = wa + wb
    out = (out_a.float() * wa[..., None] + out_b.float() * wb[..., None]) / torch.where(
        den > 0, den, 1.0
    )[..., None]
    return out, m + torch.log(den)


def _split_plan(block_tables, seq_lens, block_size, bytes_per_block_column, split_bytes):
    """(table [B, n_blocks] long, lens list, n_blocks, chunk_blocks) for one call."""
    lens = [int(x) for x in seq_lens.tolist()]
    n_blocks = (max(lens, default=0) + block_size - 1) // block_size
    table = block_tables[:, :n_blocks].long()
    most = max(1, (split_bytes or SPLIT_BYTES) // max(1, bytes_per_block_column))
    splits = max(1, -(-n_blocks // most))  # n_blocks 0: every sequence empty
    return table, lens, n_blocks, -(-n_blocks // splits)  # equal splits, none a straggler


def _run_splits(q, table, lens, n_blocks, chunk, block_size, kv_heads, head_dim, scale, load_chunk):
    """Attend over table's columns `chunk` at a time; load_chunk(idx, n) -> (k, v) fp32 [B, n*bs,
    KH, D]. Returns (out fp32 [B, QH, D], lse fp32 [B, QH]); a sequence of length 0 gets (0, -inf).
    """
    batch, q_heads, _ = q.shape
    if n_blocks == 0:  # every sequence empty (or no sequences)
        return (
            torch.zeros(batch, q_heads, head_dim, device=q.device),
            torch.full((batch, q_heads), float("-inf"), device=q.device),
        )
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
            # A split wholly past a sequence's end: its (finite, zero) output gets no weight.
            lse = lse.masked_fill((lens_t <= t0)[:, None, None], float("-inf"))
        outs.append(o.reshape(batch, q_heads, head_dim))
        lses.append(lse.reshape(batch, q_heads))
    if len(outs) == 1:
        out, lse = outs[0], lses[0]
    else:
        out, lse = merge_splits(torch.stack(outs), torch.stack(lses), return_lse=True)
    if min_len == 0:  # empty sequences: every split has no weight (a NaN merge): out 0
        out = out.masked_fill((lens_t == 0)[:, None, None], 0.0)
    return out, lse


def _full_parts(q, k_cache, v_cache, block_tables, seq_lens, scale, split_bytes):
    """(out fp32, lse fp32) of attention over full-precision paged blocks."""
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

    return _run_splits(
        q, table, lens, n_blocks, chunk, block_size, kv_heads, head_dim, scale, load_chunk
    )


def _kivi_parts(q, kv_pool, block_tables, seq_lens, scale, split_bytes):
    """(out fp32, lse fp32) of attention over KIVI blocks."""
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

    return _run_splits(
        q, table, lens, n_blocks, chunk, block_size, kv_heads, head_dim, scale, load_chunk
    )


def check_window_shapes(q, packed_pool: KiviPacked, k_window, v_window) -> None:
    """ValueError unless the packed pool and the window blocks hold the same KV heads and head_dim
    and the query heads are a multiple of them."""
    kv_heads, head_dim = k_window.shape[2], k_window.shape[3]
    packed_heads, packed_dim = packed_pool.k_codes.shape[2], packed_pool.k_scale.shape[3]
    if (packed_heads, packed_dim) != (kv_heads, head_dim) or v_window.shape != k_window.shape:
        raise ValueError(
            f"window K/V {tuple(k_window.shape)}/{tuple(v_window.shape)} do not match the packed "
            f"pool's {packed_heads} KV heads of head_dim {packed_dim}"
        )
    if q.shape[2] != head_dim or q.shape[1] % kv_heads:
        raise ValueError(f"query {tuple(q.shape)} does not fit {kv_heads} KV heads of {head_dim}")


def _result(q, parts, return_lse):
    out, lse = parts
    return (out.to(q.dtype), lse) if return_lse else out.to(q.dtype)


def paged_decode_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    split_bytes: int | None = None,
    *,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Split-KV paged decode attention in torch (same contract as `paged_decode_attention_ref`);
    with return_lse, (out, lse fp32 [batch, q_heads])."""
    parts = _full_parts(q, k_cache, v_cache, block_tables, seq_lens, scale, split_bytes)
    return _result(q, parts, return_lse)


def paged_decode_attention_kivi_torch(
    q: torch.Tensor,
    kv_pool: KiviPacked,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    split_bytes: int | None = None,
    *,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Split-KV paged decode attention over KIVI blocks (fields with a leading num_blocks dim);
    with return_lse, (out, lse fp32 [batch, q_heads])."""
    parts = _kivi_parts(q, kv_pool, block_tables, seq_lens, scale, split_bytes)
    return _result(q, parts, return_lse)


def paged_decode_attention_kivi_window_torch(
    q: torch.Tensor,
    packed_pool: KiviPacked,
    packed_tables: torch.Tensor,
    packed_lens: torch.Tensor,
    k_window: torch.Tensor,
    v_window: torch.Tensor,
    window_tables: torch.Tensor,
    window_lens: torch.Tensor,
    scale: float | None = None,
    split_bytes: int | None = None,
) -> torch.Tensor:
    """KIVI decode attention: each query over its packed tokens [0, packed_lens[b]) (KIVI blocks
    of packed_tables[b]) and its full-precision window (window_lens[b] tokens in k_window/v_window
    blocks of window_tables[b]), the two merged exactly by their log-sum-exps. A sequence with no
    tokens at all gets 0. Returns [batch, q_heads, head_dim] in q's dtype."""
    check_window_shapes(q, packed_pool, k_window, v_window)
    packed = _kivi_parts(q, packed_pool, packed_tables, packed_lens, scale, split_bytes)
    window = _full_parts(q, k_window, v_window, window_tables, window_lens, scale, split_bytes)
    out, _ = merge_attention(*packed, *window)
    return out.to(q.dtype)
