"""Causal prefill attention of one sequence over keys held in KV blocks: the fused C kernel
(csrc/prefill_attention.c; bf16 on AVX-512 BF16, fp32 on AVX2 + FMA) where it applies, else
torch's scaled_dot_product_attention over the gathered keys (its CPU flash kernel when nothing
is cached before the new tokens).

Why a kernel of our own: torch's CPU flash attention takes bf16 in and computes in fp32 GEMMs, so
on a CPU with AVX-512 BF16 a 1,024-token prefill of SmolLM2 spent a third of its time in
attention at a fifth of the projections' arithmetic rate; the kernel does both products on
`vdpbf16ps`, reads the cached prefix where it lies in the pool (no gather), and rounds the
softmax weights to bf16 before P.V as flash attention on GPUs does. In fp32 on an AVX2 CPU
torch's kernel ran at about half the projections' rate (58 against ~108 GFLOP/s on 2 vCPUs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import native

# The kernel's shapes by dtype: head_dim a multiple of 32 in bf16 (its 16-lane pairs), of 16 in
# fp32 (two 8-lane halves), at most 256.
_HEAD_DIMS = {torch.bfloat16: range(32, 257, 32), torch.float32: range(16, 257, 16)}


def prefill_attention(
    q: torch.Tensor,
    k_blocks: torch.Tensor,
    v_blocks: torch.Tensor,
    table: torch.Tensor,
    start: int,
    scale: float,
    backend: str | None = None,
) -> torch.Tensor:
    """Attention [T, QH, D] (q's dtype) of queries q [T, QH, D] at positions start..start+T-1,
    each over keys 0..its position, the keys and values lying in blocks k_blocks/v_blocks
    [num_blocks, block_size, KVH, D] in the order `table` (int64 block ids) names: a fresh,
    contiguous K of T tokens is k[None] with table [0]. `backend`: None picks the C kernel
    where it fits, "torch" forces SDPA, "native" requires the kernel (ValueError if it does not
    fit)."""
    fits = _native_fits(q, k_blocks, v_blocks, table, start)
    if backend == "native" and not fits:
        raise ValueError("the fused prefill attention does not take these tensors")
    if fits and backend != "torch":
        return _native(q, k_blocks, v_blocks, table, start, scale)
    return prefill_attention_torch(q, k_blocks, v_blocks, table, start, scale)


def prefill_attention_torch(q, k_blocks, v_blocks, table, start, scale) -> torch.Tensor:
    """`prefill_attention` on SDPA: the keys gathered (a view where one block holds them)."""
    t, _, d = q.shape
    end = start + t
    kv_heads = k_blocks.shape[2]
    if table.numel() == 1:
        ks, vs = k_blocks[int(table[0])][:end], v_blocks[int(table[0])][:end]
    else:
        n = table.numel() * k_blocks.shape[1]
        ks = k_blocks[table].reshape(n, kv_heads, d)[:end]
        vs = v_blocks[table].reshape(n, kv_heads, d)[:end]
    ks, vs = ks.to(q.dtype), vs.to(q.dtype)
    mask = None
    if start:  # causal over the cached prefix + the new tokens
        positions = torch.arange(start, end, device=q.device)
        mask = torch.arange(end, device=q.device)[None, :] <= positions[:, None]
    heads_first = lambda x: x.transpose(0, 1)[None]  # noqa: E731 - SDPA's flash kernel: 4-D
    out = F.scaled_dot_product_attention(
        heads_first(q),
        heads_first(ks),
        heads_first(vs),
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def _native_fits(q, k_blocks, v_blocks, table, start) -> bool:
    t, q_heads, d = q.shape
    kv_heads = k_blocks.shape[2]
    return (
        q.dtype == k_blocks.dtype == v_blocks.dtype
        and q.dtype in _HEAD_DIMS
        and q.device.type == k_blocks.device.type == "cpu"
        and d in _HEAD_DIMS[q.dtype]
        and t > 0
        and q_heads % kv_heads == 0
        and q.stride(2) == 1
        and k_blocks.stride(3) == 1
        and k_blocks.stride() == v_blocks.stride()
        and table.dtype == torch.int64
        and table.is_contiguous()
        and table.numel() * k_blocks.shape[1] >= start + t
        and native.prefill_attention_available(q.dtype)
    )


def _native(q, k_blocks, v_blocks, table, start, scale) -> torch.Tensor:
    t, q_heads, d = q.shape
    if table.numel() and (int(table.min()) < 0 or int(table.max()) >= k_blocks.shape[0]):
        raise IndexError("prefill attention: the block table names a block outside the pool")
    out = torch.empty(t, q_heads, d, dtype=q.dtype)
    native.prefill_attention(q, k_blocks, v_blocks, table, start, scale, out)
    return out
