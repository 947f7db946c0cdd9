"""Block movement between the paged pool and a contiguous staging buffer (what the store moves).

A block is pool_kv[i]: everything under the leading num_blocks dim, which must be contiguous
(e.g. the pool `[num_blocks, num_layers, 2, block_size, kv_heads, head_dim]`, or one layer's view
of it); the block stride itself may be anything.
"""

from __future__ import annotations

import torch


def _ids(block_ids, pool_kv: torch.Tensor) -> torch.Tensor:
    ids = torch.as_tensor(block_ids, dtype=torch.int64, device=pool_kv.device).reshape(-1)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= pool_kv.shape[0]):
        raise IndexError(
            f"block ids must lie in [0, {pool_kv.shape[0]}), "
            f"got {ids.min().item()}..{ids.max().item()}"
        )
    return ids


def _check_block(pool_kv: torch.Tensor, other: torch.Tensor, n: int, name: str) -> None:
    if other.shape[1:] != pool_kv.shape[1:] or other.shape[0] != n:
        raise ValueError(
            f"{name} has shape {tuple(other.shape)}, expected {(n, *pool_kv.shape[1:])}"
        )
    if other.dtype != pool_kv.dtype:
        raise ValueError(f"{name} dtype {other.dtype} differs from the pool's {pool_kv.dtype}")


def gather_blocks_torch(pool_kv, block_ids, out=None):
    """out[j] = pool_kv[block_ids[j]]."""
    ids = _ids(block_ids, pool_kv)
    if out is None:
        out = torch.empty(
            (ids.numel(), *pool_kv.shape[1:]), dtype=pool_kv.dtype, device=pool_kv.device
        )
    _check_block(pool_kv, out, ids.numel(), "out")
    return torch.index_select(pool_kv, 0, ids, out=out)


def scatter_blocks_torch(src, pool_kv, block_ids) -> None:
    """pool_kv[block_ids[j]] = src[j]."""
    ids = _ids(block_ids, pool_kv)
    _check_block(pool_kv, src, ids.numel(), "src")
    pool_kv.index_copy_(0, ids, src)
