"""The decode pool of a KIVI KV cache: packed blocks for each sequence's quantized part, and
full-precision blocks for its residual window (its most recent tokens)."""

from __future__ import annotations

import torch

from kernels import KiviKVLayout
from model.config import ModelConfig
from model.kv_pool import KVPool


class KiviPool:
    """Two block pools with one layout: `packed` ([num_blocks, *layout.block_shape] uint8) and
    `window` (full precision in layout.window_dtype). A sequence holds packed blocks for the
    tokens that left its window and `window_blocks_per_seq` window blocks."""

    def __init__(
        self,
        config: ModelConfig,
        layout: KiviKVLayout,
        num_blocks: int,
        window_blocks: int,
        device: torch.device | str = "cpu",
    ):
        self.layout = layout
        self.block_size = layout.block_size
        self.packed = KVPool(
            config, num_blocks, layout.block_size, torch.uint8, device, layout=layout
        )
        self.window = KVPool(
            config,
            window_blocks,
            layout.block_size,
            layout.window_dtype,
            device,
            layout=layout.window_layout,
        )
        self.device = self.packed.device
        # per layer, the packed pool's fields as views (what attention reads each step)
        self.packed_layers = [
            layout.layer_views(self.packed.kv, layer) for layer in range(layout.num_layers)
        ]

    @property
    def window_blocks_per_seq(self) -> int:
        """Window blocks one sequence holds: its window peaks at residual + block_size tokens,
        just before its oldest full window block is packed."""
        return self.layout.residual // self.block_size + 1

    @property
    def num_blocks(self) -> int:
        return self.packed.num_blocks

    @property
    def num_free(self) -> int:
        return self.packed.num_free

    @property
    def block_bytes(self) -> int:
        return self.packed.block_bytes

    def bytes(self) -> int:
        """Bytes the two pools hold."""
        return self.packed.kv.numel() + self.window.kv.numel() * self.window.kv.element_size()
