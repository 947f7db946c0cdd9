"""Paged decode attention over MLA latent blocks (DeepSeek-V2 family), absorbed form, in torch.

Absorbed MLA decode turns every head's attention into attention over the cached latent rows
themselves: the model folds the key up-projection into the query (`q_latent = q_nope @ W_uk`,
[heads, kv_lora_rank]) and applies the value up-projection after attention, so the kernel sees
one shared "KV head" whose key is a whole row `[c_kv | k_rope]` and whose value is its `c_kv`:

    score[h, t] = scale * (q_latent[h] . c_kv[t] + q_rope[h] . k_rope[t])
    out[h]      = sum_t softmax(score[h])[t] * c_kv[t]

That is grouped-query attention with all heads on one KV head, query `[q_latent | q_rope]`, key
and value the same row; so this reuses the split-KV machinery of paged_attention_torch (each
split's own softmax, merged by log-sum-exp), gathering each row once and using it as both key and
value. The value's rope columns come along and are dropped from the output: one row read once
beats a second gather of its first kv_lora_rank columns.
"""

from __future__ import annotations

import torch

from kernels.paged_attention_torch import _run_splits, _split_plan


def check_mla_shapes(q_latent, q_rope, latent_cache, block_tables, seq_lens) -> None:
    """ValueError unless the queries, the latent pool and the tables fit together."""
    if q_latent.dim() != 3 or q_rope.shape[:2] != q_latent.shape[:2] or q_rope.dim() != 3:
        raise ValueError(
            f"q_latent {tuple(q_latent.shape)} and q_rope {tuple(q_rope.shape)} must be "
            "[batch, heads, kv_lora_rank] and [batch, heads, rope_dim]"
        )
    if latent_cache.dim() != 3 or latent_cache.shape[2] != q_latent.shape[2] + q_rope.shape[2]:
        raise ValueError(
            f"latent cache {tuple(latent_cache.shape)} is not [num_blocks, block_size, "
            f"{q_latent.shape[2]} + {q_rope.shape[2]}]"
        )
    batch = q_latent.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != batch or seq_lens.shape != (batch,):
        raise ValueError(
            f"block_tables {tuple(block_tables.shape)} and seq_lens {tuple(seq_lens.shape)} do not "
            f"fit a batch of {batch}"
        )


def paged_mla_decode_attention_torch(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    split_bytes: int | None = None,
    *,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One absorbed MLA decode step over paged latent rows.

    q_latent [B, H, kv_lora_rank] (the no-rope query with the key up-projection folded in),
    q_rope [B, H, rope_dim] (the rotated rope query), latent_cache [num_blocks, block_size,
    kv_lora_rank + rope_dim] (one layer of an MlaKVLayout pool), block_tables [B, max_blocks]
    int, seq_lens [B] int: sequence b attends over its first seq_lens[b] tokens. `scale` is the
    softmax scale of the full query-key dot (the checkpoint's, YaRN correction included).

    Returns out_latent [B, H, kv_lora_rank] fp32 (the attention-weighted c_kv; 0 for a sequence
    of length 0); with return_lse also the log-sum-exp fp32 [B, H] of each head's scaled scores
    (-inf for an empty sequence), for an exact merge with attention over other rows.
    """
    check_mla_shapes(q_latent, q_rope, latent_cache, block_tables, seq_lens)
    batch, heads, rank = q_latent.shape
    _, block_size, width = latent_cache.shape
    q = torch.cat([q_latent.float(), q_rope.float()], dim=-1)  # [B, H, width]
    need_convert = latent_cache.dtype != torch.float32
    per_col = (
        batch * block_size * width * (4 + (latent_cache.element_size() if need_convert else 0))
    )
    table, lens, n_blocks, chunk = _split_plan(
        block_tables, seq_lens, block_size, per_col, split_bytes
    )
    # Staging buffers allocated once per call and reused by every split, as the full-KV twin.
    shape = (batch * chunk, block_size, width)
    raw = torch.empty(shape, dtype=latent_cache.dtype, device=q.device)
    rows = torch.empty(shape, device=q.device) if need_convert else raw

    def load_chunk(idx: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        m = idx.numel()
        torch.index_select(latent_cache, 0, idx, out=raw[:m])
        if need_convert:
            rows[:m].copy_(raw[:m])
        kv = rows[:m].view(batch, n * block_size, 1, width)
        return kv, kv  # one row is the key and (its c_kv part) the value

    out, lse = _run_splits(
        q, table, lens, n_blocks, chunk, block_size, 1, width, float(scale), load_chunk
    )
    out = out[..., :rank]
    return (out, lse) if return_lse else out


def mla_decode_attention_reference(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The same contract, one sequence at a time with a plain softmax (the tests' oracle)."""
    check_mla_shapes(q_latent, q_rope, latent_cache, block_tables, seq_lens)
    batch, heads, rank = q_latent.shape
    block_size = latent_cache.shape[1]
    out = torch.zeros(batch, heads, rank)
    for b in range(batch):
        n = int(seq_lens[b])
        if n == 0:
            continue
        blocks = block_tables[b, : -(-n // block_size)].long()
        rows = latent_cache[blocks].reshape(-1, latent_cache.shape[2])[:n].float()
        scores = q_latent[b].float() @ rows[:, :rank].T + q_rope[b].float() @ rows[:, rank:].T
        out[b] = torch.softmax(scores * scale, dim=-1) @ rows[:, :rank]
    return out
