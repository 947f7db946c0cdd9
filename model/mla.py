"""Multi-head latent attention (DeepSeek-V2's MLA) over the paged latent cache: the projections
of a layer's hidden states to queries and latent rows, prefill's attention in the non-absorbed
form (the latent up-projected to per-head keys and values) and decode's in the absorbed form
(reading only the latent rows)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

import kernels
from model.config import ModelConfig
from model.ops import heads_first, rms_norm
from model.prefill_plan import SeqPlan

if TYPE_CHECKING:
    from model.deepseek import DeepseekLayer

# q_a_layernorm and kv_a_layernorm use RMSNorm's default eps, not rms_norm_eps, in DeepSeek's own
# code and in transformers.
LATENT_NORM_EPS = 1e-6


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Rotate x [N, heads, rope_dim]. Interleaved checkpoints pair (x0, x1), (x2, x3), ...;
    the result is laid out de-interleaved (every pair's first then every pair's second), the
    same permutation for queries and keys, so their dot products are the checkpoint's."""
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def project(
    c: ModelConfig, layer: DeepseekLayer, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q_nope [N, H, qk_nope], q_rope [N, H, rope_dim] rotated, latent rows [N, kv_lora_rank
    + rope_dim]: c_kv normalised, then the rotated shared key) of hidden states x [N, hidden].
    """
    n = x.shape[0]
    a = F.linear(rms_norm(x, layer.input_norm, c.rms_norm_eps), layer.qkv_a_proj)
    q, c_kv, k_rope = a.split(
        [a.shape[1] - c.kv_lora_rank - c.qk_rope_head_dim, c.kv_lora_rank, c.qk_rope_head_dim],
        dim=-1,
    )
    if c.q_lora_rank:
        q = F.linear(rms_norm(q, layer.q_a_norm, LATENT_NORM_EPS), layer.q_b_proj)
    q_nope, q_rope = q.reshape(n, c.num_heads, c.head_dim).split(
        [c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1
    )
    c_kv = rms_norm(c_kv.contiguous(), layer.kv_a_norm, LATENT_NORM_EPS)
    k_rope = rotate(k_rope[:, None, :], *rope, c.rope_interleave)[:, 0]
    return q_nope, rotate(q_rope, *rope, c.rope_interleave), torch.cat([c_kv, k_rope], dim=-1)


def _expand(
    c: ModelConfig, layer: DeepseekLayer, rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Latent rows [N, kv_lora_rank + rope_dim] up-projected: (keys [N, H, qk_nope + rope_dim]
    with the shared rope key in every head, values [N, H, v_head_dim])."""
    n = rows.shape[0]
    kv = F.linear(rows[:, : c.kv_lora_rank], layer.kv_b_proj)
    k_nope, v = kv.view(n, c.num_heads, -1).split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
    k_rope = rows[:, None, c.kv_lora_rank :].expand(n, c.num_heads, c.qk_rope_head_dim)
    return torch.cat([k_nope, k_rope], dim=-1), v


def attend(
    c: ModelConfig,
    scale: float,
    layer: DeepseekLayer,
    plan: SeqPlan,
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    latent: torch.Tensor,
    cache: torch.Tensor,
) -> torch.Tensor:
    """One sequence's attention output [T, H * v_head_dim] in the non-absorbed form, its new
    latent rows being in the pool already (read back from it when a prefix is cached)."""
    if plan.mask is None:
        rows = latent
    else:
        n = plan.table.numel() * cache.shape[1]
        rows = cache[plan.table].reshape(n, -1)[: plan.end].to(q_nope.dtype)
    k, v = _expand(c, layer, rows)
    q = torch.cat([q_nope, q_rope], dim=-1)
    attn = F.scaled_dot_product_attention(
        heads_first(q),
        heads_first(k),
        heads_first(v),
        attn_mask=plan.mask,
        is_causal=plan.mask is None,
        scale=scale,
    )
    return attn[0].transpose(0, 1).reshape(q.shape[0], c.num_heads * c.v_head_dim)


def absorbed_decode_attention(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    kv_b_proj: torch.Tensor,
    v_head_dim: int,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One decode step's MLA attention [B, H, v_head_dim] reading only latent rows: the key
    up-projection W_uk folded into the query (q_latent = q_nope W_uk, per head), attention over
    the rows (kernels.paged_mla_decode_attention), then the value up-projection W_uv applied to
    the attended latent. kv_b_proj [H * (qk_nope + v_head_dim), kv_lora_rank], rows per head:
    the key's, then the value's (the checkpoint's layout)."""
    heads, nope = q_nope.shape[1], q_nope.shape[2]
    w = kv_b_proj.view(heads, nope + v_head_dim, kv_b_proj.shape[1])
    w_uk, w_uv = w[:, :nope], w[:, nope:]
    q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [B, H, rank]
    out_latent = kernels.paged_mla_decode_attention(
        q_latent, q_rope, cache, block_tables, seq_lens, scale
    )
    o = out_latent.to(q_nope.dtype)
    if o.dtype == torch.float32:
        return torch.bmm(o.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)
    # W_uv (x) o^T, the weight as it lies: torch's 16-bit CPU bmm of o by W_uv's transpose (a
    # strided view of kv_b_proj) took 0.54 ms at DeepSeek-V2-Lite's shapes (16 heads, 512 x
    # 128), this 0.15 ms, the same numbers; in fp32 this is the slower of the two
    return torch.bmm(w_uv, o.permute(1, 2, 0)).permute(2, 0, 1)
