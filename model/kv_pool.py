"""The paged KV cache: a pool of fixed-size blocks in the layer-major layout of DESIGN.md."""

from __future__ import annotations

import torch

from model.config import ModelConfig


class PoolExhausted(MemoryError):
    """Fewer free blocks than asked for."""


class KVPool:
    """`kv[block, layer, k|v, slot, kv_head, head_dim]`: one block's bytes are contiguous, layer by layer."""

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"KVPool needs num_blocks > 0 and block_size > 0, got {num_blocks}, {block_size}")
        self.config = config
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.kv = torch.zeros(
            num_blocks, config.num_layers, 2, block_size, config.num_kv_heads, config.head_dim, dtype=dtype, device=device
        )
        # Popped from the end: low ids are handed out first.
        self._free = list(range(num_blocks - 1, -1, -1))
        self._used = bytearray(num_blocks)

    @property
    def block_shape(self) -> tuple[int, ...]:
        """[num_layers, 2, block_size, num_kv_heads, head_dim]."""
        return tuple(self.kv.shape[1:])

    @property
    def block_bytes(self) -> int:
        return self.kv[0].numel() * self.kv.element_size()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) views [num_blocks, block_size, num_kv_heads, head_dim] of one layer."""
        return self.kv[:, layer, 0], self.kv[:, layer, 1]

    def allocate(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise PoolExhausted(f"KV pool exhausted: {n} blocks asked, {len(self._free)} of {self.num_blocks} free")
        ids = [self._free.pop() for _ in range(n)]
        for i in ids:
            self._used[i] = 1
        return ids

    def free(self, ids: list[int]) -> None:
        for i in ids:
            if not 0 <= i < self.num_blocks or not self._used[i]:
                raise ValueError(f"block {i} is not allocated")
        for i in ids:
            self._used[i] = 0
            self._free.append(i)

    def blocks_for(self, num_tokens: int) -> int:
        """How many blocks hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)
