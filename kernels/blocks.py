"""Block movement between the paged pool and a contiguous staging buffer (what the store moves).

A block is pool_kv[i]: everything under the leading num_blocks dim, which must be contiguous
(e.g. the pool `[num_blocks, num_layers, 2, block_size, kv_heads, head_dim]`, or one layer's view
of it); the block stride itself may be anything.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # torch-only installs: the torch twins still work
    triton = None


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


_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as [n, row] integers of the same width (bit-exact copies, any float dtype)."""
    flat = t.view(_INT_OF_SIZE[t.element_size()]) if t.dtype.is_floating_point else t
    inner = flat[0] if flat.shape[0] else flat.new_empty(flat.shape[1:])
    if not inner.is_contiguous():
        raise ValueError("each block (all dims after the first) must be contiguous")
    return flat.as_strided((flat.shape[0], inner.numel()), (flat.stride(0), 1))


if triton is not None:

    @triton.jit
    def _copy_rows_kernel(
        SRC, DST, IDS, row_elems, src_stride, dst_stride, GATHER: tl.constexpr, BLOCK: tl.constexpr
    ):
        j = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < row_elems
        pid = tl.load(IDS + j).to(tl.int64)
        src_row = pid if GATHER else j
        dst_row = j if GATHER else pid
        x = tl.load(SRC + src_row * src_stride + offs, mask=mask)
        tl.store(DST + dst_row * dst_stride + offs, x, mask=mask)


def _copy_triton(src: torch.Tensor, dst: torch.Tensor, ids: torch.Tensor, gather: bool) -> None:
    if triton is None:
        raise RuntimeError("the triton backend needs the triton package")
    s, d = _rows(src), _rows(dst)
    n, row = ids.numel(), s.shape[1]
    if n == 0 or row == 0:
        return
    block = 1024
    _copy_rows_kernel[(n, triton.cdiv(row, block))](
        s, d, ids, row, s.stride(0), d.stride(0), GATHER=gather, BLOCK=block
    )


def gather_blocks_triton(pool_kv, block_ids, out=None):
    """Triton twin of `gather_blocks_torch`."""
    ids = _ids(block_ids, pool_kv)
    if out is None:
        out = torch.empty(
            (ids.numel(), *pool_kv.shape[1:]), dtype=pool_kv.dtype, device=pool_kv.device
        )
    _check_block(pool_kv, out, ids.numel(), "out")
    _copy_triton(pool_kv, out, ids, gather=True)
    return out


def scatter_blocks_triton(src, pool_kv, block_ids) -> None:
    """Triton twin of `scatter_blocks_torch`."""
    ids = _ids(block_ids, pool_kv)
    _check_block(pool_kv, src, ids.numel(), "src")
    _copy_triton(src, pool_kv, ids, gather=False)
