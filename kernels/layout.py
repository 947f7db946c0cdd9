"""KV layouts: what one block of a paged KV pool holds, and how to see one layer of it.

A layout is the contract between the pool that allocates blocks, the store connector that moves
them (its codec, its byte counts) and the attention dispatch that reads them. Every layout is
layer-major, as DESIGN.md's block contract says: `block_shape[0]` is the layer, so one layer of a
block is a contiguous slice that can travel before the next layer is computed.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from typing import ClassVar

import torch


class KVLayout(abc.ABC):
    """What one block of a paged KV pool holds; pools are `[num_blocks, *block_shape]`."""

    name: ClassVar[str]  # the key in KV_LAYOUTS
    store_codec: ClassVar[str]  # the kvstore codec blocks of this layout are stored with
    block_size: int  # tokens per block
    num_layers: int
    dtype: torch.dtype  # storage dtype of the pool tensor

    @property
    @abc.abstractmethod
    def block_shape(self) -> tuple[int, ...]:
        """Shape of one block, num_layers first."""
        ...

    @property
    @abc.abstractmethod
    def fingerprint_id(self) -> str:
        """Short stable id of everything that changes the bytes of a block (goes into keys)."""
        ...

    @abc.abstractmethod
    def layer_views(self, kv: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) views of one layer of pool `kv`, as attention kernels read them."""
        ...

    @property
    def block_bytes(self) -> int:
        return math.prod(self.block_shape) * self.dtype.itemsize

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer of one block (layer-major: block_bytes split evenly by layer)."""
        return self.block_bytes // self.num_layers

    def empty_blocks(self, num_blocks: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """A zero-filled pool `[num_blocks, *block_shape]`; zeros so unwritten KV is inert."""
        return torch.zeros((num_blocks, *self.block_shape), dtype=self.dtype, device=device)


@dataclass(frozen=True)
class FullKVLayout(KVLayout):
    """Full-precision K and V: a block is `[num_layers, 2 (k|v), block_size, heads, head_dim]`."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    name: ClassVar[str] = "full"
    store_codec: ClassVar[str] = "raw"

    def __post_init__(self) -> None:
        for field_name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"FullKVLayout: {field_name} must be positive, not {value!r}")
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ValueError(f"FullKVLayout: dtype must be a float torch.dtype, not {self.dtype!r}")

    @property
    def block_shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def fingerprint_id(self) -> str:
        dtype_name = str(self.dtype).removeprefix("torch.")
        return (
            f"{self.name}/{dtype_name}/L{self.num_layers}/H{self.num_kv_heads}"
            f"/D{self.head_dim}/B{self.block_size}"
        )

    def layer_views(self, kv: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views [num_blocks, block_size, num_kv_heads, head_dim]: writes go to the pool."""
        return kv[:, layer, 0], kv[:, layer, 1]


# registry name -> layout class; KIVI-packed and MLA-latent layouts join it as subclasses
KV_LAYOUTS: dict[str, type[KVLayout]] = {"full": FullKVLayout}
