"""A KV block's copy with its layers' XXH3-64 checksums hashed as it is copied, the checked
copy of self-checking blocks, and the sealing of their headers (csrc/copy_hashed.c), on flat
uint8 numpy arrays: the KV store's data path (kvstore/) where the library is built and its XXH3
agrees with the `xxhash` package's.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from typing import NamedTuple

import numpy as np

from kernels.native_build import _library

log = logging.getLogger("halfmoon.kernels")


@functools.cache
def _xxh3_64() -> int | None:
    """The address of XXH3-64 in the `xxhash` package's extension (its runtime-dispatched
    build where it exports one), or None where it exports neither."""
    try:
        from xxhash import _xxhash

        ext = ctypes.CDLL(_xxhash.__file__)
    except (ImportError, OSError):
        return None
    for name in ("XXH3_64bits_dispatch", "XXH3_64bits"):
        fn = getattr(ext, name, None)
        if fn is not None:
            return ctypes.cast(fn, ctypes.c_void_p).value
    return None


def copy_hashed_available() -> bool:
    lib, _ = _library()
    return lib is not None and _xxh3_64() is not None and _fused_hash_agrees()


@functools.cache
def _fused_hash_agrees() -> bool:
    """Whether the copy's own XXH3 (csrc/hm_xxh3.h, for layers over 240 bytes) gives the
    `xxhash` package's sums; checked once, at lengths around its block and stripe boundaries.
    Where it does not (an xxHash that changed its algorithm), blocks would all read as corrupt:
    the copy kernels are then not used (logged), and the store's Python path hashes instead."""
    import xxhash

    src = np.frombuffer(np.random.default_rng(0).bytes(4096), dtype=np.uint8)
    dst = np.empty_like(src)
    lib, _ = _library()
    for n in (241, 1024, 1025, 1087, 4096):
        sums = np.empty((1, 1), dtype=np.uint64)
        lib.hm_copy_hashed(
            dst.ctypes.data, np.zeros(1, np.int64).ctypes.data, src.ctypes.data,
            np.zeros(1, np.int64).ctypes.data, 1, n, n, _xxh3_64(), sums.ctypes.data, 1,
        )  # fmt: skip
        if int(sums[0, 0]) != xxhash.xxh3_64_intdigest(src[:n].tobytes()):
            log.warning(
                "the copy kernels' XXH3 differs from xxhash %s's at %d bytes: not used",
                xxhash.XXHASH_VERSION, n,
            )  # fmt: skip
            return False
    return True


def _offsets_in(name: str, array: np.ndarray, offsets, span: int) -> np.ndarray:
    """`offsets` as int64, after checking that `array` is a flat contiguous uint8 array and that
    every [offset, offset + span) lies inside it: the copy kernels' argument checks, made before
    anything is written."""
    if array.dtype != np.uint8 or array.ndim != 1 or not array.flags.c_contiguous:
        raise ValueError(f"{name}: flat contiguous uint8 arrays, one offset each per block")
    off = np.asarray(offsets, dtype=np.int64)
    if len(off) and (off.min() < 0 or off.max() + span > len(array)):
        raise ValueError(f"{name}: a block lies outside its array")
    return off


def copy_hashed(
    dst: np.ndarray,
    dst_offsets: list[int],
    src: np.ndarray,
    src_offsets: list[int],
    nbytes: int,
    layer_bytes: int,
    threads: int = 1,
) -> np.ndarray:
    """For each i: dst[dst_offsets[i]:][:nbytes] = src[src_offsets[i]:][:nbytes] (flat uint8
    arrays), and the XXH3-64 of each `layer_bytes` layer of each copy, hashed while it is in
    cache: uint64 [len(offsets), layers]. A batch of 256 KiB or more is shared among `threads`
    (for a caller whose other threads would only wait: a prefill between two layers). Call only
    where copy_hashed_available()."""
    lib, _ = _library()
    if len(dst_offsets) != len(src_offsets):
        raise ValueError("copy_hashed: flat contiguous uint8 arrays, one offset each per block")
    d_off = _offsets_in("copy_hashed", dst, dst_offsets, nbytes)
    s_off = _offsets_in("copy_hashed", src, src_offsets, nbytes)
    sums = np.empty((len(d_off), -(-nbytes // layer_bytes)), dtype=np.uint64)
    if len(d_off) == 0:
        return sums
    lib.hm_copy_hashed(
        dst.ctypes.data, d_off.ctypes.data, src.ctypes.data, s_off.ctypes.data, len(d_off),
        nbytes, layer_bytes, _xxh3_64(), sums.ctypes.data,
        max(1, threads),
    )  # fmt: skip
    return sums


class CopyChecked(NamedTuple):
    """What copy_checked did with a run of self-checking blocks."""

    passed: int  # blocks from the first that were copied and matched their checksums
    why: int  # 0: all passed; 1: block `passed` has another header; 2: it failed a checksum


def copy_checked(
    dst: np.ndarray,
    dst_offsets: list[int],
    src: np.ndarray,
    header_offsets: list[int],
    template: bytes,
    table_offset: int,
    header_sum_offset: int,
    header_len: int,
    nbytes: int,
    layer_bytes: int,
) -> CopyChecked:
    """Blocks that carry their checksums in a header, copied and checked in one call (flat uint8
    arrays). Block i's header is at src[header_offsets[i]:]: its first len(template) bytes must
    be `template`, the XXH3-64 of its bytes before `header_sum_offset` the u64 there, and the
    u64 table at `table_offset` each layer's checksum. Its `nbytes` of payload, `header_len` on,
    go to dst[dst_offsets[i]:], each `layer_bytes` layer hashed from the copy against the table.
    Stops at the first block that fails (see CopyChecked). Call only where
    copy_hashed_available()."""
    lib, _ = _library()
    if len(dst_offsets) != len(header_offsets):
        raise ValueError("copy_checked: flat contiguous uint8 arrays, one offset each per block")
    layers = -(-nbytes // layer_bytes)
    if not len(template) <= table_offset <= header_sum_offset - 8 * layers < header_len - 8:
        raise ValueError("copy_checked: the header's fields overlap or run past its length")
    d_off = _offsets_in("copy_checked", dst, dst_offsets, nbytes)
    h_off = _offsets_in("copy_checked", src, header_offsets, header_len + nbytes)
    if len(d_off) == 0:
        return CopyChecked(0, 0)
    why = ctypes.c_int32(0)
    passed = lib.hm_copy_checked(
        dst.ctypes.data, d_off.ctypes.data, src.ctypes.data, h_off.ctypes.data, len(d_off),
        template, len(template), table_offset, header_sum_offset, header_len, nbytes,
        layer_bytes, _xxh3_64(), ctypes.byref(why),
    )  # fmt: skip
    return CopyChecked(int(passed), why.value)


def seal_headers(
    dst: np.ndarray, offsets: list[int], fixed: bytes, sums: np.ndarray, header_len: int
) -> None:
    """Headers of the block format written at dst[offsets[i]:] (a flat uint8 array): the
    layout's `fixed` fields, block i's layer checksums sums[i] (uint64 [blocks, layers]), the
    XXH3-64 of those two, zeros to `header_len`. Call only where copy_hashed_available()."""
    lib, _ = _library()
    sums = np.ascontiguousarray(sums, dtype=np.uint64)
    if sums.ndim != 2 or sums.shape[0] != len(offsets):
        raise ValueError("seal_headers: one row of layer checksums per header")
    if len(fixed) + 8 * sums.shape[1] + 8 > header_len:
        raise ValueError("seal_headers: the fields overrun header_len")
    off = _offsets_in("seal_headers", dst, offsets, header_len)
    lib.hm_seal_headers(
        dst.ctypes.data, off.ctypes.data, len(off), fixed, len(fixed), sums.ctypes.data,
        sums.shape[1], header_len, _xxh3_64(),
    )  # fmt: skip
