"""KV layouts: what one block of a paged KV pool holds, and how to see one layer of it.

A layout is the contract between the pool that allocates blocks, the store connector that moves
them (its codec, its byte counts) and the attention dispatch that reads them. Every layout is
layer-major, as DESIGN.md's block contract says: `block_shape[0]` is the layer, so one layer of a
block is a contiguous slice that can travel before the next layer is computed.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kernels.dispatch import kivi_dequantize, kivi_quantize
from kernels.kivi import (
    KIVI_FIELD_DTYPES,
    KiviPacked,
    kivi_field_shapes,
    kivi_packed_nbytes,
)
from kernels.layout_id import dtype_name, full_layout_id, kivi_layout_id, mla_layout_id
from kernels.pages import zeros_on_huge_pages


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
    def layer_views(self, kv: torch.Tensor, layer: int):
        """Views of one layer of pool `kv`, as this layout's attention kernels read them
        ((k_cache, v_cache) for full precision, a KiviPacked for KIVI, the latent rows for
        MLA)."""
        ...

    @property
    def block_bytes(self) -> int:
        return math.prod(self.block_shape) * self.dtype.itemsize

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer of one block (layer-major: block_bytes split evenly by layer)."""
        return self.block_bytes // self.num_layers

    def empty_blocks(self, num_blocks: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """A zero-filled pool `[num_blocks, *block_shape]`; zeros so unwritten KV is inert. On the
        CPU on huge pages (kernels/pages.py: a decode step's block reads miss the TLB less)."""
        return zeros_on_huge_pages((num_blocks, *self.block_shape), self.dtype, device)


@dataclass(frozen=True)
class FullKVLayout(KVLayout):
    """Full-precision K and V: a block is `[num_layers, 2 (k|v), block_size, heads, head_dim]`."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    # the kvstore codec blocks travel and rest in: "raw", or "int8" (one fp32 scale per token and
    # head; kv_cache_dtype int8) to halve what a 16-bit block moves, at a measured quality cost
    store_codec: str = "raw"

    name: ClassVar[str] = "full"

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
        return full_layout_id(
            dtype_name(self.dtype),
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
            self.block_size,
            self.store_codec,
        )

    def layer_views(self, kv: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views [num_blocks, block_size, num_kv_heads, head_dim]: writes go to the pool."""
        return kv[:, layer, 0], kv[:, layer, 1]


@dataclass(frozen=True)
class KiviKVLayout(KVLayout):
    """KIVI-packed K and V (kernels/kivi.py): a block is `[num_layers, layer_bytes]` uint8, each
    layer the serialised KiviPacked of its `[2, block_size, heads, head_dim]` (keys per channel,
    values per token, `bits` bits, float16 scales and zero points first, then the codes).

    KIVI keeps each sequence's most recent `residual` tokens in full precision (`window_dtype`)
    beside its packed blocks; `window_layout` describes that window's blocks. Packed blocks
    travel to the store as they are (raw bytes): they are never widened on the way.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    bits: int
    group_size: int = 32
    residual: int = 32
    window_dtype: torch.dtype = torch.float16
    dtype: torch.dtype = field(default=torch.uint8, init=False)

    name: ClassVar[str] = "kivi"
    store_codec: ClassVar[str] = "raw"

    def __post_init__(self) -> None:
        # kivi_field_shapes checks bits, head_dim packing and sizes
        kivi_field_shapes(
            self.block_size, self.num_kv_heads, self.head_dim, self.bits, self.group_size
        )
        if self.residual < 0 or self.residual % self.block_size:
            raise ValueError(
                f"KiviKVLayout: residual ({self.residual}) must be a multiple of the block size "
                f"({self.block_size})"
            )

    @property
    def packed_layer_bytes(self) -> int:
        """Bytes of one layer of one block, K and V packed."""
        return kivi_packed_nbytes(
            self.block_size, self.num_kv_heads, self.head_dim, self.bits, self.group_size
        )

    @property
    def block_shape(self) -> tuple[int, ...]:
        return (self.num_layers, self.packed_layer_bytes)

    @property
    def fingerprint_id(self) -> str:
        return kivi_layout_id(
            self.bits,
            self.group_size,
            self.residual,
            dtype_name(self.window_dtype),
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
            self.block_size,
        )

    @property
    def window_layout(self) -> FullKVLayout:
        """The full-precision blocks that hold each sequence's residual window."""
        return FullKVLayout(
            self.num_layers, self.num_kv_heads, self.head_dim, self.block_size, self.window_dtype
        )

    def layer_views(self, kv: torch.Tensor, layer: int) -> KiviPacked:
        """One layer of packed pool `kv` as a KiviPacked whose fields carry a leading num_blocks
        dim (views: writes go to the pool), as `paged_decode_attention_kivi` reads it."""
        shapes = kivi_field_shapes(
            self.block_size, self.num_kv_heads, self.head_dim, self.bits, self.group_size
        )
        raw = kv[:, layer]
        fields, off = [], 0
        for shape, dtype in zip(shapes, KIVI_FIELD_DTYPES):
            n = math.prod(shape) * dtype.itemsize
            fields.append(raw[:, off : off + n].view(dtype).view(raw.shape[0], *shape))
            off += n
        return KiviPacked(*fields)

    def pack_layer(self, layer_blocks: torch.Tensor) -> torch.Tensor:
        """One layer of full-precision blocks `[n, 2, block_size, heads, head_dim]` packed:
        `[n, block_shape[1]]` uint8 (what a layer-wise publisher sends)."""
        n = layer_blocks.shape[0]
        packed = kivi_quantize(layer_blocks, self.bits, self.group_size)
        return torch.cat([f.contiguous().view(torch.uint8).reshape(n, -1) for f in packed], 1)

    def pack(self, blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Full-precision blocks `[n, num_layers, 2, block_size, heads, head_dim]` packed into
        `out` (or a new `[n, *block_shape]` uint8 tensor), which is returned."""
        n = blocks.shape[0]
        if out is None:
            out = torch.empty((n, *self.block_shape), dtype=torch.uint8, device=blocks.device)
        # one quantize call over every block and layer: fields lead with [n, num_layers]
        packed = kivi_quantize(blocks, self.bits, self.group_size)
        off = 0
        for f in packed:
            b = f.contiguous().view(torch.uint8).reshape(n, self.num_layers, -1)
            out[:, :, off : off + b.shape[-1]] = b
            off += b.shape[-1]
        return out

    def unpack(self, packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Packed blocks `[n, *block_shape]` back to `[n, num_layers, 2, block_size, heads,
        head_dim]` in `dtype` (lossy: what attention over them sees)."""
        views = [self.layer_views(packed, layer) for layer in range(self.num_layers)]
        fields = KiviPacked(*(torch.stack([v[i] for v in views], dim=1) for i in range(6)))
        return kivi_dequantize(fields, dtype)

    def bytes_per_token(self, context_tokens: int) -> float:
        """KV bytes a sequence of `context_tokens` holds per token: its packed blocks plus its
        full-precision window, amortised over the context."""
        window = min(self.residual, context_tokens)
        packed_tokens = context_tokens - window
        per_packed = self.block_bytes / self.block_size
        per_window = self.window_layout.block_bytes / self.block_size
        return (packed_tokens * per_packed + window * per_window) / max(1, context_tokens)


@dataclass(frozen=True)
class MlaKVLayout(KVLayout):
    """Multi-head latent attention (DeepSeek-V2 family): a block is `[num_layers, block_size,
    kv_lora_rank + rope_dim]`, each token's row the normalised latent `c_kv` then the rotated key
    shared by every head. There is no per-head K/V and no K|V split: attention up-projects (or
    absorbs into the query) the latent, so one row serves as key and value of all heads."""

    num_layers: int
    kv_lora_rank: int
    rope_dim: int  # qk_rope_head_dim
    block_size: int
    dtype: torch.dtype
    store_codec: str = "raw"  # as FullKVLayout's: int8 scales each token's latent row

    name: ClassVar[str] = "mla"

    def __post_init__(self) -> None:
        for field_name in ("num_layers", "kv_lora_rank", "rope_dim", "block_size"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"MlaKVLayout: {field_name} must be positive, not {value!r}")
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ValueError(f"MlaKVLayout: dtype must be a float torch.dtype, not {self.dtype!r}")

    @property
    def latent_dim(self) -> int:
        """Width of one token's row: kv_lora_rank + rope_dim."""
        return self.kv_lora_rank + self.rope_dim

    @property
    def block_shape(self) -> tuple[int, ...]:
        return (self.num_layers, self.block_size, self.latent_dim)

    @property
    def fingerprint_id(self) -> str:
        return mla_layout_id(
            dtype_name(self.dtype),
            self.num_layers,
            self.kv_lora_rank,
            self.rope_dim,
            self.block_size,
            self.store_codec,
        )

    def layer_views(self, kv: torch.Tensor, layer: int) -> torch.Tensor:
        """The latent rows of one layer, [num_blocks, block_size, latent_dim] (a view: writes go
        to the pool), as `paged_mla_decode_attention` reads them."""
        return kv[:, layer]


# registry name -> layout class
KV_LAYOUTS: dict[str, type[KVLayout]] = {
    "full": FullKVLayout,
    "kivi": KiviKVLayout,
    "mla": MlaKVLayout,
}
