"""Causal prefill attention over the paged KV pool in bf16 and fp32 on the fused CPU kernels
(csrc/prefill_attention.c); kernels/prefill_attn.py checks the arguments and picks it or torch.
"""

from __future__ import annotations

import torch

from kernels import native
from kernels.native_build import _library

# dtype -> the library's prefill attention for it (and `<name>_available`)
_PREFILL_ATTENTION = {
    torch.bfloat16: "hm_prefill_attention_bf16",
    torch.float32: "hm_prefill_attention_f32",
}


def prefill_attention_available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether the library has its prefill attention for `dtype`: bf16 on AVX-512 BF16, fp32 on
    AVX2 + FMA."""
    lib, _ = _library()
    name = _PREFILL_ATTENTION.get(dtype)
    return lib is not None and name is not None and bool(getattr(lib, f"{name}_available")())


def prefill_attention(q, k_blocks, v_blocks, table, start, scale, out) -> None:
    """Write into `out` [T, QH, D] (q's dtype, contiguous) the causal attention of q [T, QH, D]
    at positions start.. over the keys in k_blocks/v_blocks [num_blocks, bs, KVH, D] named by
    `table` (int64, contiguous, ids checked by the caller); all bf16 or all fp32, unit stride
    along D, K and V with equal strides (kernels/prefill_attn.py checks)."""
    lib, _ = _library()
    t, q_heads, d = q.shape
    _, block_size, kv_heads, _ = k_blocks.shape
    s = k_blocks.stride()
    amx = (int(native.PREFILL_AMX),) if q.dtype == torch.bfloat16 else ()
    failed = getattr(lib, _PREFILL_ATTENTION[q.dtype])(
        q.data_ptr(), q.stride(0), q.stride(1), k_blocks.data_ptr(), v_blocks.data_ptr(),
        s[0], s[1], s[2], table.data_ptr(), block_size, t, start, q_heads, kv_heads, d, scale,
        out.data_ptr(), out.stride(0), torch.get_num_threads(), *amx,
    )  # fmt: skip
    if failed == -1:
        raise MemoryError("prefill attention could not allocate its packed keys")
    if failed:
        raise ValueError(f"prefill attention refused its arguments (code {failed})")
