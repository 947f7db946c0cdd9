"""A prefill's plan per sequence, the same for both decoders (one pool, one block-table rule):
its arguments checked, its positions and KV slots worked out, its attention mode chosen."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from model.config import ModelConfig
from model.kv_pool import KVPool

if TYPE_CHECKING:
    from model.deepseek import DeepseekModel
    from model.llama import LlamaModel


class SeqPlan(NamedTuple):
    """One sequence's part of a prefill forward."""

    token_ids: torch.Tensor  # [T] new tokens
    positions: torch.Tensor  # [T] their positions, start_pos.. start_pos+T-1
    table: torch.Tensor  # [n_blocks] pool blocks covering [0, end)
    slot_block: torch.Tensor  # [T] pool block each new token's KV goes to
    slot_off: torch.Tensor  # [T] offset in that block
    end: int  # positions attended: start_pos + T
    mask: (
        torch.Tensor | None
    )  # [T, end] causal mask over the pool's prefix + new KV; None = causal SDPA on fresh K/V


def check_tokens(config: ModelConfig, token_ids: torch.Tensor) -> None:
    if token_ids.numel() and (
        int(token_ids.min()) < 0 or int(token_ids.max()) >= config.vocab_size
    ):
        raise ValueError(f"token id out of range [0, {config.vocab_size})")


def plan_sequence(
    model: LlamaModel | DeepseekModel,
    token_ids: torch.Tensor,
    pool: KVPool,
    block_table: list[int],
    start_pos: int,
) -> SeqPlan:
    """Validate one sequence's prefill arguments and work out its positions, slots and attention
    mode, on `model`'s device."""
    c, bs, device = model.config, pool.block_size, model.device
    token_ids = torch.as_tensor(token_ids, dtype=torch.long, device=device).reshape(-1)
    t = token_ids.numel()
    end = start_pos + t
    if t == 0:
        raise ValueError("prefill needs at least one token")
    if start_pos < 0:
        raise ValueError(f"start_pos must be >= 0, got {start_pos}")
    if end > c.max_position_embeddings:
        raise ValueError(
            f"positions up to {end} exceed the context window of {c.max_position_embeddings} tokens"
        )
    n_blocks = -(-end // bs)
    if len(block_table) < n_blocks:
        raise ValueError(
            f"block table has {len(block_table)} blocks, {n_blocks} needed for {end} tokens"
        )
    check_tokens(c, token_ids)

    positions = torch.arange(start_pos, end, device=device)
    table = torch.as_tensor(block_table[:n_blocks], dtype=torch.long, device=device)
    direct = (
        start_pos == 0 and pool.dtype == model.dtype
    )  # no cached prefix: attend to the fresh K/V
    mask = None
    if not direct:
        mask = (
            torch.arange(end, device=device)[None, :] <= positions[:, None]
        )  # causal over prefix + new tokens
    return SeqPlan(token_ids, positions, table, table[positions // bs], positions % bs, end, mask)
