"""Triton kernels, their torch reference twins, and the dispatch between them."""

from kernels.dispatch import (
    BACKENDS,
    HAS_TRITON,
    available_backends,
    gather_blocks,
    kivi_dequantize,
    kivi_quantize,
    paged_decode_attention,
    paged_decode_attention_kivi,
    paged_decode_attention_kivi_window,
    paged_mla_decode_attention,
    scatter_blocks,
)
from kernels.kivi import (
    KIVI_BITS,
    KiviPacked,
    kivi_field_shapes,
    kivi_from_bytes,
    kivi_groups,
    kivi_layout,
    kivi_packed_nbytes,
    kivi_to_bytes,
)
from kernels.layout import KV_LAYOUTS, FullKVLayout, KiviKVLayout, KVLayout, MlaKVLayout
from kernels.linear import (
    PACK_FORMS,
    is_packed,
    linear,
    prepack,
    prepack_supported,
    tensor_nbytes,
    unpack,
)
from kernels.native import NativeStatus, native_status
from kernels.paged_attention_ref import paged_decode_attention_ref
from kernels.paged_attention_torch import merge_attention

__all__ = [
    "PACK_FORMS",
    "BACKENDS",
    "HAS_TRITON",
    "KIVI_BITS",
    "KV_LAYOUTS",
    "FullKVLayout",
    "KVLayout",
    "KiviKVLayout",
    "KiviPacked",
    "MlaKVLayout",
    "NativeStatus",
    "available_backends",
    "gather_blocks",
    "is_packed",
    "kivi_dequantize",
    "kivi_field_shapes",
    "kivi_from_bytes",
    "kivi_groups",
    "kivi_layout",
    "kivi_packed_nbytes",
    "kivi_quantize",
    "kivi_to_bytes",
    "linear",
    "merge_attention",
    "native_status",
    "paged_decode_attention",
    "paged_decode_attention_kivi",
    "paged_decode_attention_kivi_window",
    "paged_decode_attention_ref",
    "paged_mla_decode_attention",
    "prepack",
    "prepack_supported",
    "scatter_blocks",
    "tensor_nbytes",
    "unpack",
]
