"""LlamaModel's prefill forwards over the paged KV pool: one sequence, or several in one forward
(projections and MLP over all new tokens at once, attention per sequence)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

import kernels
from model.kv_pool import KVPool
from model.prefill_plan import SeqPlan, plan_sequence

if TYPE_CHECKING:
    from model.llama import LlamaModel

# The table of a fresh K/V passed as one block
_ONE_BLOCK = torch.zeros(1, dtype=torch.long)


def attend(
    model: LlamaModel,
    plan: SeqPlan,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> torch.Tensor:
    """One sequence's attention output [T, q_size], its new KV being in the pool already:
    over the fresh K/V when nothing precedes them (and the pool keeps the model's dtype),
    else over the pool's blocks of the sequence."""
    t = q.shape[0]
    if plan.mask is None:
        keys, values, table = k[None], v[None], _ONE_BLOCK
    else:
        keys, values, table = k_cache, v_cache, plan.table
    attn = kernels.prefill_attention(q, keys, values, table, plan.end - t, model.scale)
    return attn.reshape(t, model.config.q_size)


def prefill(
    model: LlamaModel,
    token_ids: torch.Tensor,
    pool: KVPool,
    block_table: list[int],
    start_pos: int,
    on_layer_done: Callable[[int], None] | None,
    last_only: bool,
) -> torch.Tensor:
    """LlamaModel.prefill: one sequence's new positions, fp32 logits [T or 1, vocab]."""
    plan = plan_sequence(model, token_ids, pool, block_table, start_pos)
    rope = model._rope_table(plan.positions)
    x = model.embed(plan.token_ids)
    for li, layer in enumerate(model.layers):
        q, k, v = layer.qkv(x, rope)
        k_cache, v_cache = pool.layer_kv(li)
        k_cache[plan.slot_block, plan.slot_off] = k.to(pool.dtype)
        v_cache[plan.slot_block, plan.slot_off] = v.to(pool.dtype)
        if on_layer_done is not None:
            on_layer_done(li)
        kernels.linear_add_(x, attend(model, plan, q, k, v, k_cache, v_cache), layer.o_proj)
        x = layer.mlp(x)
    if last_only:
        x = x[-1:]
    return model._logits(x)


def prefill_batch(
    model: LlamaModel,
    seqs: Sequence[tuple[torch.Tensor, list[int], int]],
    pool: KVPool,
    on_layer_done: Callable[[int], None] | None,
) -> list[torch.Tensor]:
    """LlamaModel.prefill_batch: last-position fp32 logits [1, vocab] per sequence."""
    plans = [plan_sequence(model, ids, pool, table, start) for ids, table, start in seqs]
    if not plans:
        return []
    bounds = torch.tensor([0] + [p.token_ids.numel() for p in plans]).cumsum(0).tolist()
    positions = torch.cat([p.positions for p in plans])
    slot_block = torch.cat([p.slot_block for p in plans])
    slot_off = torch.cat([p.slot_off for p in plans])
    rope = model._rope_table(positions)
    x = model.embed(torch.cat([p.token_ids for p in plans]))
    for li, layer in enumerate(model.layers):
        q, k, v = layer.qkv(x, rope)
        k_cache, v_cache = pool.layer_kv(li)
        k_cache[slot_block, slot_off] = k.to(pool.dtype)
        v_cache[slot_block, slot_off] = v.to(pool.dtype)
        if on_layer_done is not None:
            on_layer_done(li)
        attns = [
            attend(model, p, q[s:e], k[s:e], v[s:e], k_cache, v_cache)
            for p, s, e in zip(plans, bounds[:-1], bounds[1:])
        ]
        # one sequence (a long prompt's forward): its output as it is, not copied by cat
        attn = attns[0] if len(attns) == 1 else torch.cat(attns)
        kernels.linear_add_(x, attn, layer.o_proj)
        x = layer.mlp(x)
    logits = model._logits(x[torch.tensor(bounds[1:]) - 1])
    return list(logits.split(1))
