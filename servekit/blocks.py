"""Block arithmetic the conductor's policies and the workers must agree on."""

from __future__ import annotations


def blocks_needed(num_tokens: int, max_tokens: int, block_size: int) -> int:
    """KV blocks a sequence holds at its longest (prompt + all new tokens)."""
    return -(-(num_tokens + max_tokens) // block_size)


def reusable_blocks(blocks: int, num_tokens: int, block_size: int) -> int:
    """Cached blocks a prefill may reuse: at least one prompt token must be computed for the
    logits."""
    return max(0, min(blocks, (num_tokens - 1) // block_size))
