"""Triton kernels, their torch reference twins, and the dispatch between them.

The layout ids load at once; the names under TYPE_CHECKING load on first use (kernels/lazy.py):
the ids are what a process that only computes block keys (the conductor) needs, and importing
torch alone costs a process ~170 MB."""

from typing import TYPE_CHECKING

from kernels.layout_id import dtype_name, full_layout_id, kivi_layout_id, mla_layout_id
from kernels.lazy import deferred

if TYPE_CHECKING:  # loaded on first use (kernels.lazy): each of these modules imports torch
    from kernels.decode_step import DecodeLayers, KiviBlocks, LayerWeights
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
    from kernels.native import (
        CopyChecked,
        NativeStatus,
        ReleasingThreadPool,
        argmax_rows,
        copy_checked,
        copy_hashed,
        copy_hashed_available,
        native_status,
        release_threads,
        seal_headers,
    )
    from kernels.packed_linear import (
        PACK_FORMS,
        is_packed,
        linear,
        linear_add_,
        linear_silu_mul,
        prepack,
        prepack_many,
        prepack_supported,
        rms_norm,
        rope_,
        silu_mul,
        tensor_nbytes,
        unpack,
        weight_rows,
    )
    from kernels.paged_attention_ref import paged_decode_attention_ref
    from kernels.paged_attention_torch import merge_attention
    from kernels.pages import HUGE_PAGE, advise_huge_pages, empty_on_huge_pages, zeros_on_huge_pages
    from kernels.prefill_attn import prefill_attention

__getattr__ = deferred(__name__, __file__, globals())


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
