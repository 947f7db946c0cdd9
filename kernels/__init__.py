"""Triton kernels, their torch reference twins, and the dispatch between them.

Every name but the layout ids is loaded on first use: the ids are what a process that only
computes block keys (the conductor) needs, and importing torch alone costs a process ~170 MB."""

import importlib

from kernels.layout_id import dtype_name, full_layout_id, kivi_layout_id, mla_layout_id

# public name -> the module that defines it (all of them import torch)
_LAZY = {
    **dict.fromkeys(
        (
            "BACKENDS",
            "HAS_TRITON",
            "available_backends",
            "gather_blocks",
            "kivi_dequantize",
            "kivi_quantize",
            "paged_decode_attention",
            "paged_decode_attention_kivi",
            "paged_decode_attention_kivi_window",
            "paged_mla_decode_attention",
            "scatter_blocks",
        ),
        "kernels.dispatch",
    ),
    **dict.fromkeys(
        (
            "DecodeLayers",
            "KiviBlocks",
            "LayerWeights",
        ),
        "kernels.decode_step",
    ),
    **dict.fromkeys(
        (
            "KIVI_BITS",
            "KiviPacked",
            "kivi_field_shapes",
            "kivi_from_bytes",
            "kivi_groups",
            "kivi_layout",
            "kivi_packed_nbytes",
            "kivi_to_bytes",
        ),
        "kernels.kivi",
    ),
    **dict.fromkeys(
        ("HUGE_PAGE", "advise_huge_pages", "empty_on_huge_pages", "zeros_on_huge_pages"),
        "kernels.pages",
    ),
    **dict.fromkeys(
        (
            "FullKVLayout",
            "KVLayout",
            "KV_LAYOUTS",
            "KiviKVLayout",
            "MlaKVLayout",
        ),
        "kernels.layout",
    ),
    **dict.fromkeys(
        (
            "CopyChecked",
            "NativeStatus",
            "argmax_rows",
            "ReleasingThreadPool",
            "copy_checked",
            "copy_hashed",
            "copy_hashed_available",
            "native_status",
            "release_threads",
            "seal_headers",
        ),
        "kernels.native",
    ),
    **dict.fromkeys(
        ("paged_decode_attention_ref",),
        "kernels.paged_attention_ref",
    ),
    **dict.fromkeys(
        ("merge_attention",),
        "kernels.paged_attention_torch",
    ),
    **dict.fromkeys(
        (
            "PACK_FORMS",
            "is_packed",
            "linear",
            "linear_add_",
            "linear_silu_mul",
            "prepack",
            "prepack_many",
            "prepack_supported",
            "rms_norm",
            "rope_",
            "silu_mul",
            "tensor_nbytes",
            "unpack",
            "weight_rows",
        ),
        "kernels.packed_linear",
    ),
    **dict.fromkeys(
        ("prefill_attention",),
        "kernels.prefill_attn",
    ),
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'kernels' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # looked up once
    return value


__all__ = [
    "HUGE_PAGE",
    "advise_huge_pages",
    "empty_on_huge_pages",
    "zeros_on_huge_pages",
    "dtype_name",
    "full_layout_id",
    "kivi_layout_id",
    "mla_layout_id",
    "PACK_FORMS",
    "BACKENDS",
    "HAS_TRITON",
    "KIVI_BITS",
    "KV_LAYOUTS",
    "FullKVLayout",
    "KVLayout",
    "KiviKVLayout",
    "KiviPacked",
    "DecodeLayers",
    "KiviBlocks",
    "LayerWeights",
    "MlaKVLayout",
    "CopyChecked",
    "NativeStatus",
    "ReleasingThreadPool",
    "argmax_rows",
    "available_backends",
    "copy_checked",
    "copy_hashed",
    "copy_hashed_available",
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
    "linear_add_",
    "linear_silu_mul",
    "merge_attention",
    "native_status",
    "paged_decode_attention",
    "paged_decode_attention_kivi",
    "paged_decode_attention_kivi_window",
    "paged_decode_attention_ref",
    "paged_mla_decode_attention",
    "prefill_attention",
    "prepack",
    "prepack_many",
    "prepack_supported",
    "release_threads",
    "seal_headers",
    "rms_norm",
    "rope_",
    "scatter_blocks",
    "silu_mul",
    "tensor_nbytes",
    "unpack",
    "weight_rows",
]
