"""vLLM's paged KV cache, one layer's tensor, as halfmoon's store holds a block: the conversion
both ways. vLLM lays a layer's cache out as its attention backend reads it; the store keeps one
canonical block, [2 (K, V), kv heads, tokens, head size] per layer, so that any two instances of
the same model and dtype share blocks whatever kernel block size each was started with.

Layouts, by name (LAYOUTS):
- "cpu": vLLM's CPU attention (CPU_ATTN): [kernel blocks, kv heads, kernel block size,
  2 * head size], each (block, head) tile its block's K rows then its V rows (the backend views
  it as [blocks, heads, 2 * block size, head size] and splits dim 2 in two).
- "kv_first": [2, kernel blocks, kernel block size, kv heads, head size] (flash-attention's NHD
  order). Written from its definition; not yet run against a GPU build of vLLM.

A vLLM (manager) block may span several kernel blocks ("virtual block splitting"): `ratio`."""

from __future__ import annotations

from typing import NamedTuple

import torch


class CacheLayout(NamedTuple):
    kind: str  # a LAYOUTS name
    num_kv_heads: int
    head_size: int
    block_size: int  # tokens in one vLLM (manager) block: one store block
    ratio: int = 1  # kernel blocks per manager block

    @property
    def kernel_block_size(self) -> int:
        return self.block_size // self.ratio

    def block_shape(self, num_layers: int) -> tuple[int, ...]:
        """One store block: [layers, 2, kv heads, tokens, head size]."""
        return (num_layers, 2, self.num_kv_heads, self.block_size, self.head_size)


def detect_layout(
    kv: torch.Tensor, num_kv_heads: int, head_size: int, block_size: int, num_blocks: int
) -> CacheLayout:
    """The layout of one layer's cache tensor `kv` of a pool of `num_blocks` manager blocks of
    `block_size` tokens; ValueError naming the shape when it is none this module knows."""
    shape = tuple(kv.shape)
    if kv.ndim == 4 and shape[1] == num_kv_heads and shape[3] == 2 * head_size:
        kind, kernel_blocks, kernel_size = "cpu", shape[0], shape[2]
        if kv[0].stride() != (shape[2] * shape[3], shape[3], 1):
            raise ValueError(f"a cpu KV tile of shape {shape} is not contiguous: {kv.stride()}")
    elif kv.ndim == 5 and shape[0] == 2 and shape[3] == num_kv_heads and shape[4] == head_size:
        kind, kernel_blocks, kernel_size = "kv_first", shape[1], shape[2]
    else:
        raise ValueError(
            f"unknown vLLM KV cache layout {shape} (kv heads {num_kv_heads}, head size "
            f"{head_size}); known: {', '.join(LAYOUTS)}"
        )
    if kernel_blocks % num_blocks or block_size % kernel_size:
        raise ValueError(
            f"{kernel_blocks} kernel blocks of {kernel_size} tokens do not tile {num_blocks} "
            f"blocks of {block_size}"
        )
    ratio = block_size // kernel_size
    if kernel_blocks // num_blocks != ratio:
        raise ValueError(f"{kernel_blocks} kernel blocks for {num_blocks} of ratio {ratio}")
    return CacheLayout(kind, num_kv_heads, head_size, block_size, ratio)


def _tiles(kv: torch.Tensor, layout: CacheLayout) -> torch.Tensor:
    """`kv` as [kernel blocks, 2, kv heads, kernel block size, head size] (a view)."""
    n_k, h, c = layout.kernel_block_size, layout.num_kv_heads, layout.head_size
    if layout.kind == "cpu":
        return kv.view(kv.shape[0], h, 2, n_k, c).transpose(1, 2)
    if layout.kind == "kv_first":
        return kv.permute(1, 0, 3, 2, 4)
    raise ValueError(f"unknown layout {layout.kind!r}")


def _kernel_ids(block_ids: torch.Tensor, ratio: int) -> torch.Tensor:
    return (block_ids.view(-1, 1) * ratio + torch.arange(ratio, device=block_ids.device)).view(-1)


def gather_blocks(kv: torch.Tensor, block_ids: list[int], layout: CacheLayout) -> torch.Tensor:
    """A copy of blocks `block_ids` of one layer's cache: [n, 2, kv heads, block size, head
    size], tokens in order across the kernel blocks a block spans."""
    ids = _kernel_ids(torch.tensor(block_ids, dtype=torch.long, device=kv.device), layout.ratio)
    tiles = _tiles(kv, layout)[ids]  # [n * ratio, 2, H, n_k, C]
    n, r = len(block_ids), layout.ratio
    h, n_k, c = layout.num_kv_heads, layout.kernel_block_size, layout.head_size
    return (
        tiles.view(n, r, 2, h, n_k, c)
        .permute(0, 2, 3, 1, 4, 5)
        .reshape(n, 2, h, layout.block_size, c)
    )


def scatter_blocks(
    kv: torch.Tensor, block_ids: list[int], blocks: torch.Tensor, layout: CacheLayout
) -> None:
    """Write `blocks` ([n, 2, kv heads, block size, head size]) into blocks `block_ids` of one
    layer's cache, in place: gather_blocks' inverse."""
    n, r = len(block_ids), layout.ratio
    h, n_k, c = layout.num_kv_heads, layout.kernel_block_size, layout.head_size
    if tuple(blocks.shape) != (n, 2, h, layout.block_size, c):
        raise ValueError(f"blocks {tuple(blocks.shape)} for {n} blocks of layout {layout}")
    ids = _kernel_ids(torch.tensor(block_ids, dtype=torch.long, device=kv.device), r)
    tiles = blocks.to(device=kv.device, dtype=kv.dtype).view(n, 2, h, r, n_k, c)
    _tiles(kv, layout)[ids] = tiles.permute(0, 3, 1, 2, 4, 5).reshape(n * r, 2, h, n_k, c)


LAYOUTS = ("cpu", "kv_first")
