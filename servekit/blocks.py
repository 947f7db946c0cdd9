"""Block arithmetic the conductor's policies and the workers must agree on."""

from __future__ import annotations


def blocks_needed(
    num_tokens: int, max_tokens: int, block_size: int, window_tokens: int = 0
) -> int:
    """Pool blocks a sequence holds at its longest (prompt + all new tokens). With
    `window_tokens` (KIVI's full-precision window, kept apart from the pool), its last
    window_tokens or more tokens never reach the pool: it packs whole blocks of the rest only."""
    total = num_tokens + max_tokens
    if window_tokens:
        return max(0, (total - window_tokens) // block_size)
    return -(-total // block_size)


def reusable_blocks(blocks: int, num_tokens: int, block_size: int) -> int:
    """Cached blocks a prefill may reuse: at least one prompt token must be computed for the
    logits."""
    return max(0, min(blocks, (num_tokens - 1) // block_size))
