"""The Python side of the kernels' C ABI against kernels/csrc/hm_kernels.h: every entry point's
return and argument types in the ctypes table, the structs the fused decode step passes, every
exported function declared, and the built library exporting each. A C signature changed without
its binding fails here instead of corrupting memory at run time; the planted mismatches below
show that each kind is caught."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from c_abi import (
    defined_functions,
    parse_header,
    signature_mismatches,
    struct_mismatches,
)

from kernels import decode_step, native_abi
from kernels.native_build import _library, native_status

CSRC = Path(__file__).resolve().parent.parent / "kernels" / "csrc"
HEADER_TEXT = (CSRC / "hm_kernels.h").read_text()
# the ctypes structs decode_step.py builds for hm_llama_decode_layers
MIRRORS = {
    "hm_llama_shape": decode_step._Shape,
    "hm_llama_pool": decode_step._Pool,
    "hm_llama_kivi": decode_step._Kivi,
    "hm_llama_scratch": decode_step._Scratch,
}


def test_the_ctypes_table_matches_every_declaration_in_the_header():
    header = parse_header(HEADER_TEXT)
    assert len(header.functions) >= 25  # the whole library (28 today), not a parse that found none
    assert signature_mismatches(header, native_abi.SIGNATURES) == []


def test_the_decode_steps_structs_match_the_header():
    assert struct_mismatches(parse_header(HEADER_TEXT), MIRRORS) == []


def test_every_function_a_source_defines_is_declared_in_the_header():
    declared = set(parse_header(HEADER_TEXT).functions)
    defined = set().union(*(defined_functions(p.read_text()) for p in CSRC.glob("*.c")))
    assert defined and defined - declared == set()
    assert declared - defined == set()  # nor a declaration that nothing defines


@pytest.mark.skipif(not native_status().available, reason=native_status().detail)
def test_the_built_library_exports_exactly_the_declared_functions():
    lib, path = _library()
    declared = set(parse_header(HEADER_TEXT).functions)
    for name in declared:
        assert getattr(lib, name) is not None  # ctypes raises AttributeError where it is absent
    if shutil.which("nm") is None:
        pytest.skip("no nm binary to list the library's exports")
    listing = subprocess.run(
        ["nm", "-D", "--defined-only", path], capture_output=True, text=True, check=True
    ).stdout
    exported = {line.split()[-1] for line in listing.splitlines() if " T hm_" in line}
    assert exported == declared


# ---- the checker catches each kind of mismatch ----


def _planted(old: str, new: str) -> str:
    assert HEADER_TEXT.count(old) == 1, old
    return HEADER_TEXT.replace(old, new)


@pytest.mark.parametrize(
    "old, new, expected",
    [
        (  # an argument's type changed
            "int hm_linear(const float *x, int64_t ldx,",
            "int hm_linear(const float *x, int ldx,",
            "hm_linear: parameter 2 (int ldx) is c_int in C, c_long in the table",
        ),
        (  # an argument added
            "int hm_release_threads(void);",
            "int hm_release_threads(int how);",
            "hm_release_threads: 1 parameters in C, 0 in the table",
        ),
        (  # the return type changed
            "int64_t hm_copy_checked(",
            "int hm_copy_checked(",
            "hm_copy_checked: returns c_int in C, c_long in the table",
        ),
        (  # a new entry point without a binding
            "int hm_release_threads(void);",
            "int hm_release_threads(void);\nfloat hm_new_kernel(const float *x, int n);",
            "hm_new_kernel: declared in hm_kernels.h, missing from the ctypes table",
        ),
        (  # an entry point removed from C but still bound
            "int hm_release_threads(void);",
            "",
            "hm_release_threads: in the ctypes table, not declared in hm_kernels.h",
        ),
    ],
)
def test_a_planted_signature_mismatch_is_caught(old, new, expected):
    assert signature_mismatches(parse_header(_planted(old, new)), native_abi.SIGNATURES) == [
        expected
    ]


def test_a_planted_struct_mismatch_is_caught():
    header = parse_header(_planted("  float eps, scale;", "  double eps, scale;"))
    assert struct_mismatches(header, MIRRORS) == [
        "hm_llama_shape.eps: c_double in C, c_float in _Shape",
        "hm_llama_shape.scale: c_double in C, c_float in _Shape",
    ]
    header = parse_header(_planted("  int32_t block_size;\n} hm_llama_pool;", "} hm_llama_pool;"))
    assert struct_mismatches(header, MIRRORS)[0].startswith("hm_llama_pool: fields")


def test_an_undeclared_definition_and_an_unknown_type_are_caught():
    source = "static int helper(int x) { return x; }\nint hm_secret(int x) {\n  return x;\n}\n"
    assert defined_functions(source) == {"hm_secret"}
    with pytest.raises(ValueError, match="does not know"):
        parse_header(_planted("int hm_release_threads(void);", "long hm_release_threads(void);"))
