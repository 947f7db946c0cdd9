"""Linear layers whose weights are prepacked for oneDNN's CPU matmul.

Why: torch's dense `F.linear` on CPU goes to MKL's sgemm, which on this kind of AVX2 CPU runs far
below the memory bandwidth at the few rows of a decode step. Measured on SmolLM2-135M's shapes, 2
threads, fp32 (`bench/model_speed.py` has the whole-model figures): the LM head (49,152 x 576)
at 16 rows takes 41 ms dense and 15 ms packed, gate/up (3,072 x 576) 1.7 ms and 1.1 ms, and at
4 rows the layers' projections are 2.5-3x faster packed. oneDNN's kernels read a weight that was
reordered once, at load, into the blocked layout they stream best.

A packed weight is an opaque tensor (`is_mkldnn`): it has a shape and dtype but no strides or
storage, so what needs the plain values (exporting the weights, comparing them) goes through
`unpack`, which gives them back exactly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# The row count oneDNN tunes the packed layout for. The layout is chosen once, at load, for every
# batch that follows; 16 rows is the decode batch that matters, and the packed kernels measured
# as fast as a layout chosen per row count from 1 row up to 256-row prefill chunks.
PACK_ROWS = 16


def prepack_supported(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether weights of this dtype on this device have a packed oneDNN path: fp32 on any CPU,
    bf16 only where the CPU has native bf16 (elsewhere oneDNN emulates it, slower than dense)."""
    if torch.device(device).type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def prepack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] reordered into oneDNN's packed layout (a new, opaque tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_ROWS)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ weight.T, whether the weight is packed or plain."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
    return F.linear(x, weight)


def unpack(weight: torch.Tensor) -> torch.Tensor:
    """A plain tensor with the weight's values (the weight itself when it is not packed)."""
    return weight.to_dense() if weight.is_mkldnn else weight


def tensor_nbytes(t: torch.Tensor) -> int:
    """Bytes a tensor's values take, packed or not (a packed tensor has no storage to ask)."""
    return t.numel() * t.element_size()
