"""The kernels' C ABI as kernels/csrc/hm_kernels.h declares it, read from the header's text, and
the Python side compared with it: the ctypes signature table (kernels/native_abi.py) and the
ctypes structs the fused decode step passes (kernels/decode_step.py). Used by
test_kernels_abi.py, which also plants mismatches to show the checker catches them.

The header is plain C of one shape (no macros in declarations): typedef'd structs, function
pointer typedefs, and function declarations. That is all this reads; anything else in it is an
error here, so a construct this does not know cannot pass unread."""

from __future__ import annotations

import ctypes
import re
from typing import NamedTuple

# C scalar type -> the ctypes type it is passed as (on this ABI int32_t is c_int, int64_t c_long)
C_SCALARS: dict[str, type] = {
    "int": ctypes.c_int,
    "int32_t": ctypes.c_int32,
    "int64_t": ctypes.c_int64,
    "uint8_t": ctypes.c_uint8,
    "uint16_t": ctypes.c_uint16,
    "uint64_t": ctypes.c_uint64,
    "size_t": ctypes.c_size_t,
    "float": ctypes.c_float,
    "double": ctypes.c_double,
}


class CParam(NamedTuple):
    text: str  # the parameter as written, e.g. "const float *x"
    ctype: type  # the ctypes type it is passed as (c_void_p for every pointer)


class CFunction(NamedTuple):
    name: str
    restype: type | None  # the ctypes type of the return value; None for void
    params: tuple[CParam, ...]


class CHeader(NamedTuple):
    functions: dict[str, CFunction]  # every declared function, by name
    structs: dict[str, tuple[tuple[str, type], ...]]  # typedef'd struct -> (field, ctypes type)


def _strip(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    return re.sub(r"^\s*#[^\n]*(\\\n[^\n]*)*", " ", text, flags=re.M)  # the preprocessor's lines


def _ctype(decl: str, pointer_types: set[str], where: str) -> type:
    """The ctypes type of one declaration without its name ("const int64_t *", "float")."""
    words = decl.replace("*", " * ").split()
    if "*" in words or any(w in pointer_types for w in words):
        return ctypes.c_void_p
    base = [w for w in words if w not in ("const", "volatile")]
    if len(base) != 1 or base[0] not in C_SCALARS:
        raise ValueError(f"{where}: a C type this checker does not know: {decl!r}")
    return C_SCALARS[base[0]]


def _split_name(decl: str) -> tuple[str, str]:
    """("const float *", "x") from "const float *x"."""
    m = re.fullmatch(r"(.*?)(\w+)\s*", decl, flags=re.S)
    if m is None:
        raise ValueError(f"cannot read the declaration {decl!r}")
    return m.group(1), m.group(2)


def parse_header(text: str) -> CHeader:
    text = _strip(text)
    pointer_types: set[str] = set()
    for m in re.finditer(r"typedef[^;{]*?\(\s*\*\s*(\w+)\s*\)\s*\([^;]*\)\s*;", text):
        pointer_types.add(m.group(1))
    text = re.sub(r"typedef[^;{]*?\(\s*\*\s*\w+\s*\)\s*\([^;]*\)\s*;", " ", text)
    structs = {}
    for m in re.finditer(r"typedef\s+struct\s*\{(.*?)\}\s*(\w+)\s*;", text, flags=re.S):
        fields = []
        for member in filter(str.strip, m.group(1).split(";")):
            first, *rest = member.split(",")
            base, name = _split_name(first)
            base_type = base.replace("*", "")  # `void *h, *qkv`: each declarator its own stars
            for decl, field in [(base, name)] + [_split_name(base_type + r) for r in rest]:
                fields.append((field, _ctype(decl, pointer_types, f"{m.group(2)}.{field}")))
        structs[m.group(2)] = tuple(fields)
    text = re.sub(r"typedef\s+struct\s*\{.*?\}\s*\w+\s*;", " ", text, flags=re.S)
    functions = {}
    for statement in filter(str.strip, text.split(";")):
        m = re.fullmatch(r"\s*([\w\s\*]+?)\s*\b(\w+)\s*\(([^()]*)\)\s*", statement)
        if m is None:
            raise ValueError(f"not a declaration this checker reads: {statement.strip()!r}")
        ret, name, args = m.groups()
        params = []
        if args.strip() not in ("", "void"):
            for arg in args.split(","):
                decl, _ = _split_name(arg)
                params.append(CParam(" ".join(arg.split()), _ctype(decl, pointer_types, name)))
        restype = None if ret.split() == ["void"] else _ctype(ret, pointer_types, name)
        functions[name] = CFunction(name, restype, tuple(params))
    return CHeader(functions, structs)


def _name(t: type | None) -> str:
    return "void" if t is None else t.__name__


def signature_mismatches(header: CHeader, signatures: dict) -> list[str]:
    """What differs between the header's functions and a {name: (restype, argtypes)} table."""
    out = []
    for name in sorted(set(header.functions) - set(signatures)):
        out.append(f"{name}: declared in hm_kernels.h, missing from the ctypes table")
    for name in sorted(set(signatures) - set(header.functions)):
        out.append(f"{name}: in the ctypes table, not declared in hm_kernels.h")
    for name in sorted(set(header.functions) & set(signatures)):
        fn, (restype, argtypes) = header.functions[name], signatures[name]
        if fn.restype is not restype:
            out.append(f"{name}: returns {_name(fn.restype)} in C, {_name(restype)} in the table")
        if len(fn.params) != len(argtypes):
            out.append(f"{name}: {len(fn.params)} parameters in C, {len(argtypes)} in the table")
            continue
        for i, (param, t) in enumerate(zip(fn.params, argtypes)):
            if param.ctype is not t:
                out.append(
                    f"{name}: parameter {i + 1} ({param.text}) is {_name(param.ctype)} in C, "
                    f"{_name(t)} in the table"
                )
    return out


def struct_mismatches(header: CHeader, mirrors: dict[str, type]) -> list[str]:
    """What differs between the header's structs and the ctypes.Structure mirroring each."""
    out = []
    for cname, mirror in sorted(mirrors.items()):
        if cname not in header.structs:
            out.append(f"{cname}: no such struct in hm_kernels.h")
            continue
        c_fields = list(header.structs[cname])
        py_fields = [(f[0], f[1]) for f in mirror._fields_]
        if [f for f, _ in c_fields] != [f for f, _ in py_fields]:
            out.append(f"{cname}: fields {[f for f, _ in c_fields]} in C, "
                       f"{[f for f, _ in py_fields]} in {mirror.__name__}")  # fmt: skip
            continue
        for (field, ct), (_, pt) in zip(c_fields, py_fields):
            if ct is not pt:
                out.append(f"{cname}.{field}: {_name(ct)} in C, {_name(pt)} in {mirror.__name__}")
    return out


def defined_functions(source: str) -> set[str]:
    """The non-static functions a C source file defines (their definitions start a line)."""
    text = _strip(source)
    found = re.finditer(r"^(?!static\b)[A-Za-z_][\w\s\*]*?\b(hm_\w+)\s*\([^;{]*\)\s*\{", text,
                        flags=re.M)  # fmt: skip
    return {m.group(1) for m in found}
