"""DeepSeek's feed-forward: a dense SwiGLU MLP, or DeepSeekMoE (routed experts chosen per token
by the checkpoint's gating, plus shared experts every token runs)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from model.config import ModelConfig
from model.ops import rms_norm

if TYPE_CHECKING:
    from model.deepseek import DeepseekLayer


def route(
    h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: ModelConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """The checkpoint's gating of hidden states h [N, hidden]: (weights fp32 [N, k], expert ids
    [N, k]), with scoring (softmax or sigmoid), the score-correction bias that only chooses
    (V3), group-limited choice (the best `topk_group` of `n_group` groups, a group scored by its
    best expert, or its best two for noaux_tc), renormalisation and the routed scaling factor."""
    c = config
    logits = F.linear(h.float(), weight.float())
    scores = logits.softmax(dim=-1) if c.scoring_func == "softmax" else logits.sigmoid()
    choice = scores if bias is None else scores + bias.float()
    if c.topk_method != "greedy" and c.n_group > 1:
        grouped = choice.view(h.shape[0], c.n_group, -1)
        if c.topk_method == "noaux_tc":
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        else:
            group_scores = grouped.max(dim=-1).values
        kept = group_scores.topk(c.topk_group, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        choice = grouped.masked_fill(~keep[..., None], float("-inf")).view_as(choice)
    ids = choice.topk(c.num_experts_per_tok, dim=-1).indices
    weights = scores.gather(1, ids)
    if c.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * c.routed_scaling_factor, ids


def swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down)


def ffn(c: ModelConfig, layer: DeepseekLayer, x: torch.Tensor) -> torch.Tensor:
    """The residual stream x after the layer's feed-forward (dense or MoE)."""
    h = rms_norm(x, layer.post_norm, c.rms_norm_eps)
    if not layer.is_moe:
        return x + swiglu(h, layer.gate_up_proj, layer.down_proj)
    out = _routed_experts(c, layer, h)
    if layer.shared_gate_up is not None:
        out = out + swiglu(h, layer.shared_gate_up, layer.shared_down)
    return x + out


def _routed_experts(c: ModelConfig, layer: DeepseekLayer, h: torch.Tensor) -> torch.Tensor:
    """Sum over each token's top-k experts of weight * expert(h); each expert runs once over
    the tokens routed to it."""
    weights, ids = route(h, layer.router, layer.router_bias, c)
    k = ids.shape[1]
    flat = ids.reshape(-1)
    order = flat.argsort(stable=True)
    token = order // k
    weight = weights.reshape(-1)[order]
    # the host reads each expert's count here: why a MoE decode is not graph-safe
    counts = torch.bincount(flat, minlength=c.n_routed_experts).tolist()
    out = torch.zeros_like(h)
    start = 0
    for e, count in enumerate(counts):
        if not count:
            continue
        rows = token[start : start + count]
        y = swiglu(h[rows], layer.experts_gate_up[e], layer.experts_down[e])
        out.index_add_(0, rows, (y * weight[start : start + count, None]).to(out.dtype))
        start += count
    return out
