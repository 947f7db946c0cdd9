"""Triton twins of kernels/blocks.py's block copies (gather into / scatter from a staging
buffer). Imported on first use by kernels/dispatch.py, so that a CPU server never loads triton."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.blocks import _check_block, _ids

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as [n, row] integers of the same width (bit-exact copies, any float dtype)."""
    flat = t.view(_INT_OF_SIZE[t.element_size()]) if t.dtype.is_floating_point else t
    inner = flat[0] if flat.shape[0] else flat.new_empty(flat.shape[1:])
    if not inner.is_contiguous():
        raise ValueError("each block (all dims after the first) must be contiguous")
    return flat.as_strided((flat.shape[0], inner.numel()), (flat.stride(0), 1))


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
