"""The ctypes signature of every entry point of the kernels' C library (kernels/csrc/): the one
table the loader (native_build.py) declares them from, and the one that tests/test_kernels_abi.py
checks against the C declarations (kernels/csrc/hm_kernels.h, and the definitions in the
sources for the functions that header does not declare).

The convention: every pointer, whatever it points to (arrays, structs, a function), is passed as
`c_void_p` (callers pass `tensor.data_ptr()`, `array.ctypes.data`, `ctypes.byref(...)` or
bytes); a scalar as the ctypes type of its C type (`int` c_int, `int64_t` c_int64, `float`
c_float); a function returning `void` has restype None.
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple


class Signature(NamedTuple):
    """One C function as ctypes calls it."""

    restype: type | None  # the ctypes type of its return value; None for `void`
    argtypes: tuple[type, ...]  # the ctypes type of each argument, in order


def _fn(restype: type | None, *argtypes: type) -> Signature:
    return Signature(restype, argtypes)


_int, _i64, _f32, _ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p

# The prefill attention's arguments (csrc/prefill_attention.c); bf16 takes `amx` after them.
_PREFILL = (
    _ptr, _i64, _i64, _ptr, _ptr, _i64, _i64, _i64, _ptr, _i64,
    _int, _int, _int, _int, _int, _f32, _ptr, _i64, _int,
)  # fmt: skip

# C function name -> its signature, grouped by the source file that defines it.
# fmt: off
SIGNATURES: dict[str, Signature] = {
    # csrc/decode_attention.c
    "hm_paged_attention_full": _fn(
        _int, _ptr, _ptr, _ptr, _int, _i64, _i64, _i64, _i64, _ptr, _i64, _ptr,
        _int, _int, _int, _int, _int, _f32, _int, _ptr, _ptr,
    ),
    "hm_paged_attention_latent": _fn(
        _int, _ptr, _ptr, _int, _i64, _i64, _i64, _ptr, _i64, _ptr,
        _int, _int, _int, _int, _int, _f32, _int, _ptr, _ptr,
    ),
    "hm_paged_attention_kivi": _fn(
        _int, _ptr, _ptr, _ptr, _i64, _int, _int, _int, _int, _ptr, _i64, _ptr,
        _int, _int, _int, _int, _int, _f32, _int, _ptr, _ptr,
    ),
    "hm_paged_attention_kivi_window": _fn(
        _int, _ptr, _ptr, _ptr, _i64, _int, _int, _int, _int, _ptr, _i64, _ptr,
        _ptr, _ptr, _int, _i64, _i64, _i64, _i64, _ptr, _i64, _ptr, _int,
        _int, _int, _int, _int, _int, _f32, _int, _ptr, _ptr,
    ),
    # csrc/linear.c
    "hm_linear": _fn(_int, _ptr, _i64, _int, _ptr, _int, _int, _ptr, _i64, _int, _int),
    "hm_linear_pack": _fn(None, _ptr, _int, _int, _ptr, _int),
    "hm_linear_available": _fn(_int),
    "hm_rms_norm": _fn(None, _ptr, _i64, _int, _int, _ptr, _f32, _ptr, _i64, _int),
    "hm_silu_mul": _fn(None, _ptr, _i64, _int, _int, _ptr, _i64, _int),
    # csrc/linear_bf16.c
    "hm_linear_bf16": _fn(_int, _ptr, _i64, _int, _ptr, _int, _int, _ptr, _i64, _int, _int, _int),
    "hm_linear_silu_bf16": _fn(_int, _ptr, _i64, _int, _ptr, _int, _int, _ptr, _i64, _int, _int),
    "hm_linear_bf16_pack": _fn(None, _ptr, _int, _int, _ptr, _int),
    "hm_linear_bf16_available": _fn(_int),
    "hm_linear_bf16_amx_available": _fn(_int),
    "hm_rms_norm_bf16": _fn(None, _ptr, _i64, _int, _int, _ptr, _f32, _ptr, _i64, _int),
    "hm_silu_mul_bf16": _fn(None, _ptr, _i64, _int, _int, _ptr, _i64, _int),
    # csrc/rope.c (hm_rope_row is decode_step.c's, declared so that the table covers the header)
    "hm_rope": _fn(None, _ptr, _i64, _i64, _int, _int, _int, _ptr, _ptr, _int, _int),
    "hm_rope_row": _fn(None, _ptr, _i64, _i64, _int, _int, _int, _ptr, _ptr, _int),
    # csrc/argmax.c
    "hm_argmax_f32": _fn(None, _ptr, _i64, _int, _i64, _ptr, _int),
    # csrc/threads.c
    "hm_release_threads": _fn(_int),
    # csrc/copy_hashed.c
    "hm_copy_hashed": _fn(None, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _ptr, _ptr, _int),
    "hm_copy_checked": _fn(_i64, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, *[_i64] * 6, _ptr, _ptr),
    "hm_seal_headers": _fn(None, _ptr, _ptr, _i64, _ptr, _i64, _ptr, _i64, _i64, _ptr),
    # csrc/prefill_attention.c
    "hm_prefill_attention_bf16": _fn(_int, *_PREFILL, _int),
    "hm_prefill_attention_bf16_available": _fn(_int),
    "hm_prefill_attention_f32": _fn(_int, *_PREFILL),
    "hm_prefill_attention_f32_available": _fn(_int),
    # csrc/decode_step.c
    "hm_llama_decode_layers": _fn(
        _int, _int, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _int, _ptr, _ptr, _ptr, _ptr, _ptr,
        _int, _int,
    ),
}
# fmt: on


def declare(lib: ctypes.CDLL) -> None:
    """Give each of `lib`'s entry points its signature from SIGNATURES (AttributeError where the
    library lacks one)."""
    for name, sig in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype = sig.restype
        fn.argtypes = sig.argtypes
