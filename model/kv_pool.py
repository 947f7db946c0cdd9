"""The paged KV cache: a pool of fixed-size blocks in the layer-major layout of DESIGN.md."""

from __future__ import annotations

import torch

from kernels import KVLayout
from model.config import ModelConfig


class PoolExhausted(MemoryError):
    """Fewer free blocks than asked for."""


class KVPool:
    """`kv[block, *layout.block_shape]`: one block's bytes are contiguous, layer by layer.

    With the default full layout that is `kv[block, layer, k|v, slot, kv_head, head_dim]`.
    """

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        *,
        layout: KVLayout | None = None,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(
                f"KVPool needs num_blocks > 0 and block_size > 0, got {num_blocks}, {block_size}"
            )
        if layout is None:
            layout = config.kv_layout(block_size, dtype)
        elif (layout.block_size, layout.dtype, layout.num_layers) != (
            block_size,
            dtype,
            config.num_layers,
        ):
            # Callers size tables with pool.block_size and cast with pool.dtype: they must agree.
            raise ValueError(
                f"KVPool: layout {layout.fingerprint_id} disagrees with block_size={block_size}, "
                f"dtype={dtype}, num_layers={config.num_layers}"
            )
        self.config = config
        self.layout = layout
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.device = torch.device(device)
        self.kv = layout.empty_blocks(num_blocks, self.device)
        # Popped from the end: low ids are handed out first.
        self._free = list(range(num_blocks - 1, -1, -1))
        self._used = bytearray(num_blocks)

    @property
    def block_shape(self) -> tuple[int, ...]:
        """One block's shape; [num_layers, 2, block_size, num_kv_heads, head_dim] when full."""
        return self.layout.block_shape

    @property
    def block_bytes(self) -> int:
        return self.layout.block_bytes

    def bytes(self) -> int:
        """Bytes the pool holds."""
        return self.kv.numel() * self.kv.element_size()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) views of one layer, as the layout shapes them."""
        return self.layout.layer_views(self.kv, layer)

    def allocate(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise PoolExhausted(
                f"KV pool exhausted: {n} blocks asked, {len(self._free)} of {self.num_blocks} free"
            )
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
