"""Dispatch: each operation has a small registry of implementations chosen by name.

`backend=None` picks Triton for CUDA tensors; on the CPU it picks the fused C kernels
(kernels/native.py, "native") where an op has them and they are built, else the torch twin.
Tests force `backend="triton"` on CPU tensors to run the kernels under TRITON_INTERPRET=1, and
`backend="torch"` to run the twin.
"""

from __future__ import annotations

import importlib
import importlib.util

import torch

from kernels.blocks import gather_blocks_torch, scatter_blocks_torch
from kernels.kivi import KiviPacked, kivi_dequantize_blocks_torch, kivi_quantize_torch
from kernels.mla_attention import paged_mla_decode_attention_torch
from kernels.native import (
    native_status,
    paged_decode_attention_kivi_native,
    paged_decode_attention_kivi_window_native,
    paged_decode_attention_native,
    paged_mla_decode_attention_native,
)
from kernels.paged_attention_ref import paged_decode_attention_ref
from kernels.paged_attention_torch import (
    paged_decode_attention_kivi_torch,
    paged_decode_attention_kivi_window_torch,
    paged_decode_attention_torch,
)

# Triton is looked up, not imported: importing it costs a CPU server ~80 MB of resident memory
# for kernels it never runs. Its twins load on first use.
HAS_TRITON = importlib.util.find_spec("triton") is not None


class _TritonTwin:
    """A triton implementation that imports its module (and triton) on first call."""

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name
        self._impl = None

    def __call__(self, *args, **kwargs):
        if self._impl is None:
            self._impl = getattr(importlib.import_module(self.module), self.name)
        return self._impl(*args, **kwargs)


BACKENDS = ("torch", "triton", "native")
_IMPLS: dict[str, dict[str, object]] = {
    "paged_decode_attention": {
        "torch": paged_decode_attention_torch,
        "ref": paged_decode_attention_ref,
        "native": paged_decode_attention_native,
    },
    "paged_decode_attention_kivi": {
        "torch": paged_decode_attention_kivi_torch,
        "native": paged_decode_attention_kivi_native,
    },
    "paged_decode_attention_kivi_window": {
        "torch": paged_decode_attention_kivi_window_torch,
        "native": paged_decode_attention_kivi_window_native,
    },
    "paged_mla_decode_attention": {
        "torch": paged_mla_decode_attention_torch,
        "native": paged_mla_decode_attention_native,
    },
    "kivi_quantize": {"torch": kivi_quantize_torch},
    "kivi_dequantize": {"torch": kivi_dequantize_blocks_torch},
    "gather_blocks": {"torch": gather_blocks_torch},
    "scatter_blocks": {"torch": scatter_blocks_torch},
}
_TRITON_TWINS = {
    "paged_decode_attention": ("paged_attention_triton", "paged_decode_attention_triton"),
    "paged_decode_attention_kivi": (
        "paged_attention_triton",
        "paged_decode_attention_kivi_triton",
    ),
    "paged_decode_attention_kivi_window": (
        "paged_attention_triton",
        "paged_decode_attention_kivi_window_triton",
    ),
    "paged_mla_decode_attention": ("mla_attention_triton", "paged_mla_decode_attention_triton"),
    "kivi_quantize": ("kivi_triton", "kivi_quantize_triton"),
    "kivi_dequantize": ("kivi_triton", "kivi_dequantize_triton"),
    "gather_blocks": ("blocks_triton", "gather_blocks_triton"),
    "scatter_blocks": ("blocks_triton", "scatter_blocks_triton"),
}
if HAS_TRITON:
    for _op, (_module, _name) in _TRITON_TWINS.items():
        _IMPLS[_op]["triton"] = _TritonTwin(f"kernels.{_module}", _name)


def available_backends(op: str) -> list[str]:
    """Names registered for `op` on this install."""
    return sorted(_IMPLS[op])


def pick(op: str, device: torch.device, backend: str | None = None):
    """The implementation of `op` for tensors on `device` (or the named backend)."""
    impls = _IMPLS[op]
    if backend is None:
        if device.type == "cuda" and "triton" in impls:
            backend = "triton"
        elif device.type == "cpu" and "native" in impls and native_status().available:
            backend = "native"
        else:
            backend = "torch"
    if backend not in impls:
        raise ValueError(f"unknown backend {backend!r} for {op}; have {sorted(impls)}")
    return impls[backend]


def paged_decode_attention(
    q, k_cache, v_cache, block_tables, seq_lens, scale=None, *, backend=None, return_lse=False
):
    """One decode step over the paged KV cache; see `paged_decode_attention_ref` for the
    contract. return_lse=True -> (out, lse): lse fp32 [batch, q_heads], the log-sum-exp of each
    query head's scaled scores (-inf for a sequence of length 0, whose out is 0), for an exact
    merge with attention over other tokens (`merge_attention`). The "ref" backend has no lse."""
    impl = pick("paged_decode_attention", q.device, backend)
    if not return_lse:
        return impl(q, k_cache, v_cache, block_tables, seq_lens, scale)
    return impl(q, k_cache, v_cache, block_tables, seq_lens, scale, return_lse=True)


def paged_decode_attention_kivi(
    q, kv_pool: KiviPacked, block_tables, seq_lens, scale=None, *, backend=None, return_lse=False
):
    """Decode attention over a KIVI pool: `kivi_quantize` of
    [num_blocks, 2, block_size, kv_heads, head_dim] (each field with a leading num_blocks dim;
    fields may be strided views of a layer-major pool). return_lse as `paged_decode_attention`."""
    impl = pick("paged_decode_attention_kivi", q.device, backend)
    if not return_lse:
        return impl(q, kv_pool, block_tables, seq_lens, scale)
    return impl(q, kv_pool, block_tables, seq_lens, scale, return_lse=True)


def paged_decode_attention_kivi_window(
    q,
    packed_pool: KiviPacked,
    packed_tables,
    packed_lens,
    k_window,
    v_window,
    window_tables,
    window_lens,
    scale=None,
    *,
    backend=None,
):
    """KIVI decode attention: each query over its quantized tokens [0, packed_lens[b]) (KIVI
    blocks of `packed_pool` named by packed_tables[b]) and its full-precision window of recent
    tokens (window_lens[b] tokens in the k_window/v_window blocks
    [num_blocks, block_size, kv_heads, head_dim] named by window_tables[b]), merged exactly by
    the two parts' log-sum-exps. Either part may be empty; with both empty the output is 0.
    Returns [batch, q_heads, head_dim] in q's dtype."""
    return pick("paged_decode_attention_kivi_window", q.device, backend)(
        q,
        packed_pool,
        packed_tables,
        packed_lens,
        k_window,
        v_window,
        window_tables,
        window_lens,
        scale,
    )


def paged_mla_decode_attention(
    q_latent,
    q_rope,
    latent_cache,
    block_tables,
    seq_lens,
    scale,
    *,
    backend=None,
    return_lse=False,
):
    """Absorbed MLA decode attention over paged latent rows (kernels/mla_attention.py):
    q_latent [B, H, kv_lora_rank], q_rope [B, H, rope_dim], latent_cache [num_blocks, block_size,
    kv_lora_rank + rope_dim] -> out_latent [B, H, kv_lora_rank] fp32 (0 for an empty sequence).
    return_lse=True -> (out, lse fp32 [B, H]), as `paged_decode_attention`."""
    impl = pick("paged_mla_decode_attention", q_latent.device, backend)
    args = (q_latent, q_rope, latent_cache, block_tables, seq_lens, scale)
    return impl(*args, return_lse=True) if return_lse else impl(*args)


def kivi_quantize(kv: torch.Tensor, bits: int, group_size: int = 32, *, backend=None) -> KiviPacked:
    """KIVI-quantize kv [..., 2, tokens, kv_heads, head_dim]; fields keep the leading dims."""
    return pick("kivi_quantize", kv.device, backend)(kv, bits, group_size)


def kivi_dequantize(
    p: KiviPacked, dtype: torch.dtype = torch.float32, *, backend=None
) -> torch.Tensor:
    """Inverse of `kivi_quantize` -> [..., 2, tokens, kv_heads, head_dim] in `dtype`."""
    return pick("kivi_dequantize", p.k_codes.device, backend)(p, dtype)


def gather_blocks(pool_kv, block_ids, out=None, *, backend=None) -> torch.Tensor:
    """Copy pool_kv[block_ids] into a contiguous [n, ...] buffer (`out` if given) and return it."""
    return pick("gather_blocks", pool_kv.device, backend)(pool_kv, block_ids, out)


def scatter_blocks(src, pool_kv, block_ids, *, backend=None) -> None:
    """Copy src[j] into pool_kv[block_ids[j]] for every j."""
    pick("scatter_blocks", pool_kv.device, backend)(src, pool_kv, block_ids)
