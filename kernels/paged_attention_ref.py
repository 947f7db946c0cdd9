"""Torch reference for paged decode attention (the CPU path and the tests' oracle)."""

from __future__ import annotations

import torch


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """One decode step of attention over a paged KV cache.

    q: [batch, q_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size, kv_heads, head_dim]
    (views into the layer-major pool, any strides); block_tables: [batch, max_blocks] int32;
    seq_lens: [batch] int32, the tokens each sequence attends to (the current one included).
    Returns [batch, q_heads, head_dim] in q's dtype.
    """
    batch, q_heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q_heads // kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    max_len = int(seq_lens.max())
    n_blocks = (max_len + block_size - 1) // block_size
    table = block_tables[:, :n_blocks].long()
    # Gather each sequence's blocks into [batch, n_blocks*block_size, kv_heads, head_dim].
    k = k_cache[table].reshape(batch, n_blocks * block_size, kv_heads, head_dim).float()
    v = v_cache[table].reshape(batch, n_blocks * block_size, kv_heads, head_dim).float()
    qg = q.float().view(batch, kv_heads, group, head_dim)
    scores = torch.einsum("bhgd,bthd->bhgt", qg, k) * scale
    pos = torch.arange(n_blocks * block_size, device=q.device)
    mask = pos[None, :] >= seq_lens.to(q.device).long()[:, None]
    scores.masked_fill_(mask[:, None, None, :], float("-inf"))
    out = torch.einsum("bhgt,bthd->bhgd", scores.softmax(dim=-1), v)
    return out.reshape(batch, q_heads, head_dim).to(q.dtype)
