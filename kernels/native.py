"""The fused CPU kernels of kernels/csrc/, called through ctypes: where callers reach them
(`from kernels import native`, then `native.linear_panels(...)`), and where the library's
tunables live.

The kernels live in a module per family, all imported here:
- native_attention.py: decode attention over full-precision, latent (MLA) and KIVI blocks, and
  the dispatch's "native" backend on it;
- native_linear.py: the linear over packed weight panels, RMSNorm, SiLU-and-mul, RoPE, argmax;
- native_prefill.py: causal prefill attention;
- native_copy.py: a KV block's copy with its layers' checksums, the checked copy, the headers.
The library itself (build, cache, load, status, thread release) is native_build.py, and the
ctypes signature of each C entry point native_abi.py, checked against the C declarations by
tests/test_kernels_abi.py.
"""

from __future__ import annotations

from kernels.native_build import (
    CFLAGS,
    HEADERS,
    SOURCES,
    NativeStatus,
    ReleasingThreadPool,
    native_status,
    release_threads,
)

# the loader's internals that tests and kernels/decode_step.py reach through this module
from kernels.native_build import _compiler as _compiler
from kernels.native_build import _library as _library
from kernels.native_build import _library_path as _library_path
from kernels.native_build import _native_target as _native_target

# ---- tunables: the family modules read them from here at each call, so that a test or bench
# that sets `native.X` reaches every kernel that takes X ----

# bf16 panels go through AMX tiles from this many rows up (where the CPU has them): below it the
# `vdpbf16ps` path is as fast, and the tiles' fixed cost is not paid (bench/model_speed.py).
AMX_MIN_ROWS = 1

# bf16 prefill attention on AMX tiles where the CPU has them (tests turn it off to check the
# `vdpbf16ps` path on the same CPU)
PREFILL_AMX = True

# A work item of the C kernel is one (sequence, KV head), and MLA has one KV head: below a
# sequence a thread, sequences this long are split among the idle threads (shorter ones gain less
# than the split and merge cost).
_MLA_SPLIT_TOKENS = 1024

# The families, after the tunables they read (each reaches them as `native.X` at call time).
# They import torch: a process that needs only the library's status imports native_build.
from kernels.native_attention import (  # noqa: E402
    MAX_BLOCK_SIZE,
    paged_attention_full,
    paged_attention_kivi,
    paged_attention_kivi_window,
    paged_attention_latent,
    paged_decode_attention_kivi_native,
    paged_decode_attention_kivi_window_native,
    paged_decode_attention_native,
    paged_mla_decode_attention_native,
    supports,
)
from kernels.native_copy import (  # noqa: E402
    CopyChecked,
    copy_checked,
    copy_hashed,
    copy_hashed_available,
    seal_headers,
)
from kernels.native_linear import (  # noqa: E402
    PANEL,
    amx_supported,
    argmax_rows,
    bf16_rows_supported,
    linear_panels,
    linear_silu_panels,
    pack_panels,
    panel_rows,
    panels_layout,
    panels_shape,
    panels_supported,
    rms_norm,
    rope_,
    silu_mul,
    unpack_panels,
)
from kernels.native_prefill import prefill_attention, prefill_attention_available  # noqa: E402

__all__ = [
    "AMX_MIN_ROWS",
    "CFLAGS",
    "HEADERS",
    "MAX_BLOCK_SIZE",
    "PANEL",
    "PREFILL_AMX",
    "SOURCES",
    "CopyChecked",
    "NativeStatus",
    "ReleasingThreadPool",
    "amx_supported",
    "argmax_rows",
    "bf16_rows_supported",
    "copy_checked",
    "copy_hashed",
    "copy_hashed_available",
    "linear_panels",
    "linear_silu_panels",
    "native_status",
    "pack_panels",
    "paged_attention_full",
    "paged_attention_kivi",
    "paged_attention_kivi_window",
    "paged_attention_latent",
    "paged_decode_attention_kivi_native",
    "paged_decode_attention_kivi_window_native",
    "paged_decode_attention_native",
    "paged_mla_decode_attention_native",
    "panel_rows",
    "panels_layout",
    "panels_shape",
    "panels_supported",
    "prefill_attention",
    "prefill_attention_available",
    "release_threads",
    "rms_norm",
    "rope_",
    "seal_headers",
    "silu_mul",
    "supports",
    "unpack_panels",
]
