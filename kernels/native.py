"""The fused CPU decode-attention kernels (kernels/csrc/decode_attention.c) and the small-batch
linear over packed weight panels (kernels/csrc/linear.c): built on first use with the system C
compiler, cached by source, compiler flags and CPU, called through ctypes.

`native_status()` says whether they are there and, if not, why; the dispatch then falls back to
the torch twin (paged_attention_torch.py), logs the reason once, and a worker reports it as a
metric. `HALFMOON_NATIVE=0` turns them off (to compare against the twin). The compiled library
lives under $HALFMOON_CACHE (default ~/.cache/halfmoon, where models are fetched to) in
`kernels/`, named by a hash of the source, the compiler, the flags and what `-march=native`
means on this CPU, so a changed source or another kind of CPU builds its own; the build writes a
temporary file and renames it, so processes that build at once never load a half-written
library.

The libraries link OpenMP as `libgomp.so.1`, the soname torch's own runtime is loaded under, so
both share one thread pool.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from kernels.kivi import KiviPacked
from kernels.paged_attention_torch import (
    check_window_shapes,
    merge_attention,
    paged_decode_attention_kivi_torch,
    paged_decode_attention_torch,
)

log = logging.getLogger("halfmoon.kernels")

# One library of both: the decode attention, and the small-batch linear of packed panels (with
# the element-wise steps around it); the headers they include count towards the cache key.
_CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = tuple(
    _CSRC / name
    for name in (
        "argmax.c",
        "copy_hashed.c",
        "decode_attention.c",
        "decode_step.c",
        "linear.c",
        "linear_bf16.c",
        "prefill_attention.c",
        "rope.c",
        "threads.c",
    )
)
HEADERS = tuple(sorted(_CSRC.glob("*.h")))
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11")
# The C kernel's per-block arrays (csrc/decode_attention.c HM_MAX_BS)
MAX_BLOCK_SIZE = 256
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

_i64, _i32, _f32, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p


class NativeStatus(NamedTuple):
    """Whether the fused CPU kernels can run in this process."""

    available: bool  # built and loaded
    detail: str  # the library's path, or why it is not available


def _build_dir() -> Path:
    return Path(os.environ.get("HALFMOON_CACHE", Path.home() / ".cache" / "halfmoon")) / "kernels"


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _native_target(cc: str) -> str:
    """What `-march=native` means to this compiler on this CPU: the macros it predefines (the
    instruction sets, __AMX_TILE__ among them, and the CPU's name). Part of the library's cache
    key, so that a cache shared between machines (a home directory on NFS) holds a library per
    kind of CPU, and none is loaded on a CPU without the instructions it was built for."""
    done = subprocess.run(
        [cc, "-march=native", "-dM", "-E", "-"], input="", capture_output=True, text=True
    )
    return done.stdout


def _library_path(cc: str, target: str) -> Path:
    """Where the library for this source, compiler, flags and target lives in the cache."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    sources = b"".join(src.read_bytes() for src in (*SOURCES, *HEADERS))
    salt = (version + " ".join(CFLAGS) + target).encode()
    return _build_dir() / f"decode_attention-{hashlib.sha256(sources + salt).hexdigest()[:16]}.so"


def _build(cc: str) -> Path:
    """The library for this source, compiler, flags and CPU, compiled now unless cached."""
    out = _library_path(cc, _native_target(cc))
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        done = subprocess.run(
            [cc, *CFLAGS, "-o", tmp, *map(str, SOURCES), "-lm"], capture_output=True, text=True
        )
        if done.returncode:
            raise RuntimeError(f"{cc} failed: {done.stderr.strip()[-500:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


@functools.cache
def _library() -> tuple[ctypes.CDLL | None, str]:
    if os.environ.get("HALFMOON_NATIVE", "1") == "0":
        return None, "turned off by HALFMOON_NATIVE=0"
    cc = _compiler()
    if cc is None:
        return None, "no C compiler (cc, gcc or $CC) on PATH"
    try:
        path = _build(cc)
        lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError) as e:
        return None, f"build failed: {e}"
    lib.hm_paged_attention_full.restype = ctypes.c_int
    lib.hm_paged_attention_full.argtypes = [
        _ptr, _ptr, _ptr, _i32, _i64, _i64, _i64, _i64, _ptr, _i64, _ptr,
        _i32, _i32, _i32, _i32, _i32, _f32, _i32, _ptr, _ptr,
    ]  # fmt: skip
    lib.hm_paged_attention_latent.restype = ctypes.c_int
    lib.hm_paged_attention_latent.argtypes = [
        _ptr, _ptr, _i32, _i64, _i64, _i64, _ptr, _i64, _ptr,
        _i32, _i32, _i32, _i32, _i32, _f32, _i32, _ptr, _ptr,
    ]  # fmt: skip
    lib.hm_paged_attention_kivi_window.restype = ctypes.c_int
    lib.hm_paged_attention_kivi_window.argtypes = [
        _ptr, _ptr, _ptr, _i64, _i32, _i32, _i32, _i32, _ptr, _i64, _ptr,
        _ptr, _ptr, _i32, _i64, _i64, _i64, _i64, _ptr, _i64, _ptr, _i32,
        _i32, _i32, _i32, _i32, _i32, _f32, _i32, _ptr, _ptr,
    ]  # fmt: skip
    lib.hm_paged_attention_kivi.restype = ctypes.c_int
    lib.hm_paged_attention_kivi.argtypes = [
        _ptr, _ptr, _ptr, _i64, _i32, _i32, _i32, _i32, _ptr, _i64, _ptr,
        _i32, _i32, _i32, _i32, _i32, _f32, _i32, _ptr, _ptr,
    ]  # fmt: skip
    lib.hm_linear.restype = ctypes.c_int
    lib.hm_linear.argtypes = [_ptr, _i64, _i32, _ptr, _i32, _i32, _ptr, _i64, _i32, _i32]
    lib.hm_rms_norm.restype = None
    lib.hm_rms_norm.argtypes = [_ptr, _i64, _i32, _i32, _ptr, _f32, _ptr, _i64, _i32]
    lib.hm_silu_mul.restype = None
    lib.hm_silu_mul.argtypes = [_ptr, _i64, _i32, _i32, _ptr, _i64, _i32]
    lib.hm_linear_pack.restype = None
    lib.hm_linear_pack.argtypes = [_ptr, _i32, _i32, _ptr, _i32]
    lib.hm_linear_available.restype = ctypes.c_int
    lib.hm_linear_bf16.restype = ctypes.c_int
    lib.hm_linear_bf16.argtypes = [_ptr, _i64, _i32, _ptr, _i32, _i32, _ptr, _i64, _i32, _i32, _i32]
    lib.hm_linear_bf16_amx_available.restype = ctypes.c_int
    lib.hm_rope.restype = None
    lib.hm_rope.argtypes = [_ptr, _i64, _i64, _i32, _i32, _i32, _ptr, _ptr, _i32, _i32]
    lib.hm_rms_norm_bf16.restype = None
    lib.hm_rms_norm_bf16.argtypes = [_ptr, _i64, _i32, _i32, _ptr, _f32, _ptr, _i64, _i32]
    lib.hm_silu_mul_bf16.restype = None
    lib.hm_silu_mul_bf16.argtypes = [_ptr, _i64, _i32, _i32, _ptr, _i64, _i32]
    lib.hm_linear_silu_bf16.restype = ctypes.c_int
    lib.hm_linear_silu_bf16.argtypes = [_ptr, _i64, _i32, _ptr, _i32, _i32, _ptr, _i64, _i32, _i32]
    lib.hm_linear_bf16_pack.restype = None
    lib.hm_linear_bf16_pack.argtypes = [_ptr, _i32, _i32, _ptr, _i32]
    lib.hm_linear_bf16_available.restype = ctypes.c_int
    lib.hm_release_threads.restype = ctypes.c_int
    lib.hm_argmax_f32.restype = None
    lib.hm_argmax_f32.argtypes = [_ptr, _i64, _i32, _i64, _ptr, _i32]
    lib.hm_copy_hashed.restype = None
    lib.hm_copy_hashed.argtypes = [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _ptr, _ptr, _i32]
    lib.hm_copy_checked.restype = _i64
    lib.hm_copy_checked.argtypes = [_ptr, _ptr, _ptr, _ptr, _i64, _ptr, *[_i64] * 6, _ptr, _ptr]
    lib.hm_seal_headers.restype = None
    lib.hm_seal_headers.argtypes = [_ptr, _ptr, _i64, _ptr, _i64, _ptr, _i64, _i64, _ptr]
    for suffix, extra in (("bf16", [_i32]), ("f32", [])):  # bf16 takes `amx` last
        getattr(lib, f"hm_prefill_attention_{suffix}_available").restype = ctypes.c_int
        fn = getattr(lib, f"hm_prefill_attention_{suffix}")
        fn.restype = ctypes.c_int
        fn.argtypes = [
            _ptr, _i64, _i64, _ptr, _ptr, _i64, _i64, _i64, _ptr, _i64,
            _i32, _i32, _i32, _i32, _i32, _f32, _ptr, _i64, _i32, *extra,
        ]  # fmt: skip
    lib.hm_llama_decode_layers.restype = ctypes.c_int
    lib.hm_llama_decode_layers.argtypes = [
        _i32, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _i32, _ptr, _ptr, _ptr, _ptr, _ptr, _i32,
        _i32,
    ]  # fmt: skip
    return lib, str(path)


class ReleasingThreadPool(ThreadPoolExecutor):
    """A ThreadPoolExecutor whose threads free their OpenMP workers after each task
    (`release_threads`): a task's torch copies open parallel regions on its thread, and a pool
    left there would make a step thread's barriers sleep."""

    def submit(self, fn, /, *args, **kwargs):
        return super().submit(_then_release, fn, *args, **kwargs)


def _then_release(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    finally:
        release_threads()


def release_threads() -> bool:
    """Free the calling thread's OpenMP worker threads (csrc/threads.c says why): a server calls it
    on the thread that loaded and calibrated its model before its step thread takes over. False
    where the library is not loaded or the runtime refused."""
    lib, _ = _library()
    return lib is not None and lib.hm_release_threads() == 0


def native_status() -> NativeStatus:
    """Build (once per process) and report the fused CPU kernels; logs why when they are not
    available."""
    lib, detail = _library()
    if lib is None:
        _warn_once(detail)
    return NativeStatus(lib is not None, detail)


@functools.cache
def _warn_once(detail: str) -> None:
    log.warning("fused CPU decode attention unavailable (%s): using the torch path", detail)


def supports(q: torch.Tensor, kv_heads: int, block_size: int) -> bool:
    """True when q is on the CPU and these shapes fit the kernel."""
    return (
        q.device.type == "cpu"
        and block_size <= MAX_BLOCK_SIZE
        and kv_heads > 0
        and q.shape[1] % kv_heads == 0
    )


def _common(q, block_tables, seq_lens, block_size, scale, out_dim: int | None = None):
    """(q fp32 contiguous, tables int32, lens int32, scale, out, lse) with the table checked to
    cover every length; out [B, QH, out_dim], head_dim wide by default."""
    batch, q_heads, head_dim = q.shape
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    if lens.numel() != batch or tables.shape[0] != batch:
        raise ValueError(f"{batch} queries, {lens.numel()} lengths, {tables.shape[0]} tables")
    longest = int(lens.max()) if batch else 0
    if longest > tables.shape[1] * block_size or (batch and int(lens.min()) < 0):
        raise ValueError(
            f"sequence lengths up to {longest} need {-(-longest // block_size)} table columns, "
            f"have {tables.shape[1]}"
        )
    scale = head_dim**-0.5 if scale is None else float(scale)
    out = torch.empty(batch, q_heads, out_dim or head_dim)
    lse = torch.empty(batch, q_heads)
    return q.float().contiguous(), tables, lens, scale, out, lse


def _check_bad(bad: int) -> None:
    if bad < 0:
        raise MemoryError("fused CPU attention could not allocate its per-sequence state")
    if bad:
        raise IndexError(f"block table of sequence {bad - 1} names a block outside the pool")


def paged_attention_full(q, k_cache, v_cache, block_tables, seq_lens, scale=None):
    """(out fp32 [B, QH, D], lse fp32 [B, QH]) of decode attention over full-precision blocks
    k_cache/v_cache [num_blocks, block_size, kv_heads, head_dim] (fp32, bf16 or fp16; strided
    views of a pool are read in place)."""
    lib, _ = _library()
    num_blocks, block_size, kv_heads, head_dim = k_cache.shape
    if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1:
        raise ValueError("K and V views need equal strides and a contiguous head_dim")
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in _DTYPE_CODES:
        raise ValueError(f"unsupported KV dtype {k_cache.dtype}/{v_cache.dtype}")
    qf, tables, lens, scale, out, lse = _common(q, block_tables, seq_lens, block_size, scale)
    s = k_cache.stride()
    bad = lib.hm_paged_attention_full(
        qf.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), _DTYPE_CODES[k_cache.dtype],
        num_blocks, s[0], s[1], s[2], tables.data_ptr(), tables.stride(0), lens.data_ptr(),
        q.shape[0], q.shape[1], kv_heads, head_dim, block_size, scale,
        torch.get_num_threads(), out.data_ptr(), lse.data_ptr(),
    )  # fmt: skip
    _check_bad(bad)
    return out, lse


def paged_attention_latent(q, latent_cache, block_tables, seq_lens, scale, value_dim: int):
    """(out fp32 [B, QH, value_dim], lse fp32 [B, QH]) of absorbed MLA decode attention: every
    query row q [B, QH, D] attends over its sequence's latent rows latent_cache [num_blocks,
    block_size, D] (fp32, bf16 or fp16, contiguous rows) as keys, and over their first
    value_dim columns as values (each row read once for both)."""
    lib, _ = _library()
    num_blocks, block_size, head_dim = latent_cache.shape
    if latent_cache.stride(2) != 1 or latent_cache.dtype not in _DTYPE_CODES:
        raise ValueError(f"unsupported latent rows {latent_cache.dtype}, strides "
                         f"{latent_cache.stride()}")  # fmt: skip
    if not 0 < value_dim <= head_dim:
        raise ValueError(f"value_dim {value_dim} outside a row of {head_dim}")
    qf, tables, lens, scale, out, lse = _common(
        q, block_tables, seq_lens, block_size, scale, value_dim
    )
    s = latent_cache.stride()
    bad = lib.hm_paged_attention_latent(
        qf.data_ptr(), latent_cache.data_ptr(), _DTYPE_CODES[latent_cache.dtype], num_blocks,
        s[0], s[1], tables.data_ptr(), tables.stride(0), lens.data_ptr(), q.shape[0],
        q.shape[1], head_dim, value_dim, block_size, scale, torch.get_num_threads(),
        out.data_ptr(), lse.data_ptr(),
    )  # fmt: skip
    _check_bad(bad)
    return out, lse


class _KiviArgs(NamedTuple):
    """A KIVI pool layer as the C kernel takes it."""

    num_blocks: int
    block_size: int
    kv_heads: int
    head_dim: int
    bits: int
    gk: int  # tokens per key group
    vg: int  # value groups per row
    gv: int  # channels per value group
    ptrs: ctypes.Array  # each field's base pointer
    strides: ctypes.Array  # each field's bytes from one block to the next


def _kivi_args(pool: KiviPacked) -> _KiviArgs:
    """The C kernel's view of `pool`, read from shapes and strides alone (no tensor ops: this
    runs once per layer per step); ValueError unless every field is contiguous within a block."""
    num_blocks, block_size, kv_heads, packed = pool.k_codes.shape
    kg, head_dim, vg = pool.k_scale.shape[1], pool.k_scale.shape[-1], pool.v_scale.shape[-1]
    bits = packed * 8 // head_dim
    for f in pool:
        inner, want = f.stride()[1:], []
        size = 1
        for dim in reversed(f.shape[1:]):
            want.insert(0, size)
            size *= dim
        if f.shape[0] != num_blocks or list(inner) != want:
            raise ValueError("each KIVI field needs num_blocks rows, contiguous within a block")
    if bits not in (2, 4, 8) or packed * 8 != bits * head_dim:
        raise ValueError(f"kivi codes of {packed} bytes do not fit head_dim {head_dim}")
    return _KiviArgs(
        num_blocks,
        block_size,
        kv_heads,
        head_dim,
        bits,
        -(-block_size // kg),
        vg,
        -(-head_dim // vg),
        (ctypes.c_void_p * 6)(*(f.data_ptr() for f in pool)),
        (ctypes.c_int64 * 6)(*(f.stride(0) * f.element_size() for f in pool)),
    )


def paged_attention_kivi(q, pool: KiviPacked, block_tables, seq_lens, scale=None):
    """(out fp32 [B, QH, D], lse fp32 [B, QH]) of decode attention over KIVI blocks: pool's
    fields carry a leading num_blocks dim and may be strided views of a packed pool (each field
    contiguous within a block)."""
    lib, _ = _library()
    a = _kivi_args(pool)
    qf, tables, lens, scale, out, lse = _common(q, block_tables, seq_lens, a.block_size, scale)
    bad = lib.hm_paged_attention_kivi(
        qf.data_ptr(), a.ptrs, a.strides, a.num_blocks, a.bits, a.gk, a.vg, a.gv,
        tables.data_ptr(), tables.stride(0), lens.data_ptr(),
        q.shape[0], q.shape[1], a.kv_heads, a.head_dim, a.block_size, scale,
        torch.get_num_threads(), out.data_ptr(), lse.data_ptr(),
    )  # fmt: skip
    _check_bad(bad)
    return out, lse


def paged_attention_kivi_window(
    q, pool: KiviPacked, tables, lens, k_window, v_window, window_tables, window_lens, scale=None
):
    """(out fp32, lse fp32) of attention over each sequence's KIVI blocks and then its
    full-precision window blocks, in one online softmax (the exact merge of the two parts)."""
    lib, _ = _library()
    a = _kivi_args(pool)
    if k_window.stride() != v_window.stride() or k_window.stride(3) != 1:
        raise ValueError("window K and V views need equal strides and a contiguous head_dim")
    if k_window.dtype != v_window.dtype or k_window.dtype not in _DTYPE_CODES:
        raise ValueError(f"unsupported window dtype {k_window.dtype}/{v_window.dtype}")
    w_block = k_window.shape[1]
    if w_block > MAX_BLOCK_SIZE:
        raise ValueError(f"window blocks of {w_block} tokens exceed {MAX_BLOCK_SIZE}")
    qf, tables, lens, scale, out, lse = _common(q, tables, lens, a.block_size, scale)
    _, wtables, wlens, _, _, _ = _common(q, window_tables, window_lens, w_block, scale)
    w = k_window.stride()
    bad = lib.hm_paged_attention_kivi_window(
        qf.data_ptr(), a.ptrs, a.strides, a.num_blocks, a.bits, a.gk, a.vg, a.gv,
        tables.data_ptr(), tables.stride(0), lens.data_ptr(),
        k_window.data_ptr(), v_window.data_ptr(), _DTYPE_CODES[k_window.dtype],
        k_window.shape[0], w[0], w[1], w[2], wtables.data_ptr(), wtables.stride(0),
        wlens.data_ptr(), w_block,
        q.shape[0], q.shape[1], a.kv_heads, a.head_dim, a.block_size, scale,
        torch.get_num_threads(), out.data_ptr(), lse.data_ptr(),
    )  # fmt: skip
    _check_bad(bad)
    return out, lse


# ---- the dispatch's "native" backend: the torch twins' contracts ----


def paged_decode_attention_native(
    q, k_cache, v_cache, block_tables, seq_lens, scale=None, split_bytes=None, *, return_lse=False
):
    """`paged_decode_attention_torch`'s contract on the fused kernel (the twin where the kernel
    is not built or the shapes do not fit it)."""
    _, block_size, kv_heads, _ = k_cache.shape
    fits = supports(q, kv_heads, block_size) and k_cache.stride(3) == 1
    if not (native_status().available and fits and k_cache.stride() == v_cache.stride()):
        if native_status().available:
            _warn_once(f"KV views {tuple(k_cache.stride())} / block size {block_size} not fused")
        return paged_decode_attention_torch(
            q, k_cache, v_cache, block_tables, seq_lens, scale, split_bytes, return_lse=return_lse
        )
    out, lse = paged_attention_full(q, k_cache, v_cache, block_tables, seq_lens, scale)
    return (out.to(q.dtype), lse) if return_lse else out.to(q.dtype)


def paged_decode_attention_kivi_native(
    q, kv_pool: KiviPacked, block_tables, seq_lens, scale=None, split_bytes=None, *,
    return_lse=False,
):  # fmt: skip
    """`paged_decode_attention_kivi_torch`'s contract on the fused kernel."""
    _, block_size, kv_heads, _ = kv_pool.k_codes.shape
    if not (native_status().available and supports(q, kv_heads, block_size)):
        return paged_decode_attention_kivi_torch(
            q, kv_pool, block_tables, seq_lens, scale, split_bytes, return_lse=return_lse
        )
    out, lse = paged_attention_kivi(q, kv_pool, block_tables, seq_lens, scale)
    return (out.to(q.dtype), lse) if return_lse else out.to(q.dtype)


def paged_decode_attention_kivi_window_native(
    q, packed_pool, packed_tables, packed_lens, k_window, v_window, window_tables, window_lens,
    scale=None, split_bytes=None,
):  # fmt: skip
    """`paged_decode_attention_kivi_window_torch`'s contract on one fused kernel call: each
    sequence's packed blocks, then its window, in one online softmax."""
    check_window_shapes(q, packed_pool, k_window, v_window)
    _, block_size, kv_heads, _ = packed_pool.k_codes.shape
    fits = (
        native_status().available
        and supports(q, kv_heads, max(block_size, k_window.shape[1]))
        and k_window.stride() == v_window.stride()
        and k_window.stride(3) == 1
    )
    if not fits:
        out, _ = merge_attention(
            *paged_decode_attention_kivi_native(
                q, packed_pool, packed_tables, packed_lens, scale, split_bytes, return_lse=True
            ),
            *paged_decode_attention_native(
                q, k_window, v_window, window_tables, window_lens, scale, split_bytes,
                return_lse=True,
            ),
        )  # fmt: skip
        return out.to(q.dtype)
    out, _ = paged_attention_kivi_window(
        q, packed_pool, packed_tables, packed_lens, k_window, v_window, window_tables,
        window_lens, scale,
    )  # fmt: skip
    return out.to(q.dtype)


def paged_mla_decode_attention_native(
    q_latent, q_rope, latent_cache, block_tables, seq_lens, scale, split_bytes=None, *,
    return_lse=False,
):  # fmt: skip
    """`paged_mla_decode_attention_torch`'s contract on the fused full-precision kernel: absorbed
    MLA is attention with every head on one KV head whose key is the row [c_kv | k_rope] and
    whose value is the same row (the output's rope columns are dropped)."""
    from kernels.mla_attention import check_mla_shapes, paged_mla_decode_attention_torch

    check_mla_shapes(q_latent, q_rope, latent_cache, block_tables, seq_lens)
    fits = supports(q_latent, 1, latent_cache.shape[1]) and latent_cache.stride(2) == 1
    if not (native_status().available and fits and latent_cache.dtype in _DTYPE_CODES):
        return paged_mla_decode_attention_torch(
            q_latent, q_rope, latent_cache, block_tables, seq_lens, scale, split_bytes,
            return_lse=return_lse,
        )  # fmt: skip
    q = torch.cat([q_latent.float(), q_rope.float()], dim=-1)
    rank = q_latent.shape[-1]
    parts = torch.get_num_threads() // q.shape[0]
    if parts > 1 and int(seq_lens.max()) >= _MLA_SPLIT_TOKENS:
        out, lse = _split_sequences(q, latent_cache, block_tables, seq_lens, scale, parts, rank)
    else:
        out, lse = paged_attention_latent(q, latent_cache, block_tables, seq_lens, scale, rank)
    return (out, lse) if return_lse else out


# A work item of the C kernel is one (sequence, KV head), and MLA has one KV head: below a
# sequence a thread, sequences this long are split among the idle threads (shorter ones gain less
# than the split and merge cost).
_MLA_SPLIT_TOKENS = 1024


def _split_sequences(q, rows, block_tables, seq_lens, scale, parts: int, value_dim: int):
    """paged_attention_latent with each sequence's blocks cut into `parts` runs, each run a
    sequence of its own (its own work item), merged back by their log-sum-exps (exact)."""
    batch, bs = q.shape[0], rows.shape[1]
    per = -(-block_tables.shape[1] // parts)  # blocks a run
    tables = torch.zeros(batch, parts * per, dtype=block_tables.dtype)
    tables[:, : block_tables.shape[1]] = block_tables
    starts = torch.arange(parts, dtype=seq_lens.dtype) * (per * bs)
    lens = (seq_lens.view(-1, 1) - starts).clamp(0, per * bs)
    out, lse = paged_attention_latent(
        q.repeat_interleave(parts, 0), rows, tables.view(batch * parts, per), lens.reshape(-1),
        scale, value_dim,
    )  # fmt: skip
    out, lse = out.view(batch, parts, *out.shape[1:]), lse.view(batch, parts, -1)
    top = lse.amax(1, keepdim=True)
    w = torch.where(lse.isfinite(), torch.exp(lse - top), 0.0)  # an empty run weighs nothing
    mass = w.sum(1)
    merged = (out * w.unsqueeze(-1)).sum(1) / mass.clamp_min(1e-30).unsqueeze(-1)
    return merged, torch.where(mass > 0, top.squeeze(1) + mass.log(), float("-inf"))


# ---- the linear over packed panels (csrc/linear.c) ----

PANEL = 16  # outputs per panel: a weight packs when its output count is a multiple of it


def panels_supported(weight: torch.Tensor) -> bool:
    """Whether `weight` [N, K] can be packed into panels here: on the CPU, N a multiple of PANEL,
    and fp32 with the library's AVX2 + FMA path, or bf16 (K even) with its AVX-512 BF16 one."""
    if weight.dim() != 2 or weight.device.type != "cpu" or weight.dtype not in _PANEL_DTYPES:
        return False
    n, k = weight.shape
    if n % PANEL or n == 0 or k == 0 or (weight.dtype == torch.bfloat16 and k % 2):
        return False
    lib, _ = _library()
    if lib is None:
        return False
    if weight.dtype == torch.bfloat16:
        return bool(lib.hm_linear_bf16_available())
    return bool(lib.hm_linear_available())


def bf16_rows_supported() -> bool:
    """Whether the library has its AVX-512 BF16 path (bf16 panels, RMSNorm and SiLU-and-mul)."""
    lib, _ = _library()
    return lib is not None and bool(lib.hm_linear_bf16_available())


def amx_supported() -> bool:
    """Whether bf16 panels run on AMX tiles here (built with them, and the OS grants them)."""
    lib, _ = _library()
    return lib is not None and bool(lib.hm_linear_bf16_amx_available())


# bf16 panels go through AMX tiles from this many rows up (where the CPU has them): below it the
# `vdpbf16ps` path is as fast, and the tiles' fixed cost is not paid (bench/model_speed.py).
AMX_MIN_ROWS = 1

# Panel dtypes: fp32 panels are [N/16, K, 16]; bf16 panels [N/16, K/2, 32], a line per input
# pair (16 outputs x 2 inputs), the order `vdpbf16ps` takes them in (csrc/linear_bf16.c).
_PANEL_DTYPES = (torch.float32, torch.bfloat16)


def panels_layout(weight: torch.Tensor) -> tuple[int, int, int]:
    """The shape pack_panels gives `weight` [N, K]: fp32 [N/16, K, 16], bf16 [N/16, K/2, 32]."""
    n, k = weight.shape
    if weight.dtype == torch.bfloat16:
        return n // PANEL, k // 2, 2 * PANEL
    return n // PANEL, k, PANEL


def pack_panels(weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`weight` [N, K] as panels (fp32: [N/16, K, 16], panel p, row k holding outputs
    16p..16p+15 at input k; bf16: [N/16, K/2, 32], the outputs' pairs of inputs 2k, 2k+1),
    written into `out` where given (contiguous, that shape and dtype, 64-byte aligned);
    call only where panels_supported(weight)."""
    lib, _ = _library()
    w = weight.detach().contiguous()
    n, k = w.shape
    shape = panels_layout(w)
    if out is None:
        out = torch.empty(shape, dtype=w.dtype)
    elif out.shape != shape or out.dtype != w.dtype or not out.is_contiguous():
        raise ValueError(f"panels of {tuple(w.shape)} {w.dtype} go in {shape}, not {out.shape}")
    elif out.data_ptr() % 64:
        raise ValueError("panels must start on a 64-byte boundary")
    pack = lib.hm_linear_bf16_pack if w.dtype == torch.bfloat16 else lib.hm_linear_pack
    pack(w.data_ptr(), n, k, out.data_ptr(), torch.get_num_threads())
    return out


def panels_shape(panels: torch.Tensor) -> tuple[int, int]:
    """(N, K) of the weight that `panels` hold."""
    p, lines, width = panels.shape
    if panels.dtype == torch.bfloat16:
        return p * PANEL, lines * 2
    return p * width, lines


def unpack_panels(panels: torch.Tensor) -> torch.Tensor:
    """The [N, K] weight that pack_panels packed (exactly)."""
    n, k = panels_shape(panels)
    if panels.dtype == torch.bfloat16:
        p, kh, _ = panels.shape
        return panels.view(p, kh, PANEL, 2).permute(0, 2, 1, 3).reshape(n, k)
    return panels.permute(0, 2, 1).reshape(n, k)


def panel_rows(panels: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows `rows` [n] of the [N, K] weight that pack_panels packed -> [n, K], gathered from the
    panels without unpacking the rest (a tied LM head's panels serve as the embedding)."""
    n, k = panels_shape(panels)
    p, r = rows // PANEL, rows % PANEL
    if panels.dtype == torch.bfloat16:  # row r's inputs lie by pairs in lanes 2r, 2r + 1
        return panels.view(n // PANEL, k // 2, PANEL, 2)[p, :, r, :].reshape(-1, k)
    return panels[p, :, r]


def _rows(t: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """t as rows [R, last dim] of `dtype` with unit stride along a row (a copy only where
    needed)."""
    rows = t.reshape(-1, t.shape[-1])
    if rows.dtype != dtype or rows.stride(-1) != 1:
        rows = rows.to(dtype).contiguous()
    return rows


def _panel_operands(x: torch.Tensor, panels: torch.Tensor) -> tuple[int, int, torch.Tensor]:
    """(N, K, x as rows in the panels' dtype), the panels checked."""
    n, k = panels_shape(panels)
    if x.shape[-1] != k:
        raise ValueError(f"linear: x has {x.shape[-1]} features, the weight takes {k}")
    align = 64 if panels.dtype == torch.bfloat16 else 32
    if panels.data_ptr() % align or not panels.is_contiguous():
        raise ValueError(f"linear: packed panels must be contiguous and {align}-byte aligned")
    return n, k, _rows(x, panels.dtype)


def linear_silu_panels(x: torch.Tensor, panels: torch.Tensor) -> torch.Tensor | None:
    """SwiGLU's silu(gate) * up of x [..., K] times bf16 panels of gate's rows, then up's:
    [..., N/2], the values of silu_mul(linear_panels(x, panels)) in one pass (the gate/up
    output never goes to memory); None where the shape has no such pass (N/16 odd)."""
    if panels.dtype != torch.bfloat16:
        return None
    lib, _ = _library()
    n, k, rows = _panel_operands(x, panels)
    if not rows.shape[0]:
        return None
    out = torch.empty(rows.shape[0], n // 2, dtype=torch.bfloat16)
    if lib.hm_linear_silu_bf16(rows.data_ptr(), rows.stride(0), rows.shape[0], panels.data_ptr(),
                               n, k, out.data_ptr(), out.stride(0), torch.get_num_threads(),
                               AMX_MIN_ROWS):  # fmt: skip
        return None
    return out.reshape(*x.shape[:-1], n // 2)


def linear_panels(
    x: torch.Tensor, panels: torch.Tensor, add_to: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] times the packed weight's transpose: [..., N] in the panels' dtype (fp32 or
    bf16; x is taken in that dtype); with `add_to` (that dtype, [R, N], unit stride along a
    row) that product is added into it in place, and it is returned."""
    lib, _ = _library()
    n, k, rows = _panel_operands(x, panels)
    dtype = panels.dtype
    if add_to is None:
        out = torch.empty(rows.shape[0], n, dtype=dtype)
    else:
        out = add_to
        if out.dtype != dtype or out.shape != (rows.shape[0], n) or out.stride(1) != 1:
            raise ValueError(f"linear: cannot add into {out.dtype} {list(out.shape)}")
    if rows.shape[0]:
        args = (
            rows.data_ptr(), rows.stride(0), rows.shape[0], panels.data_ptr(), n, k,
            out.data_ptr(), out.stride(0), add_to is not None, torch.get_num_threads(),
        )  # fmt: skip
        if dtype == torch.bfloat16:
            failed = lib.hm_linear_bf16(*args, AMX_MIN_ROWS)
        else:
            failed = lib.hm_linear(*args)
        if failed:
            raise RuntimeError(f"linear: the kernel was built without its {dtype} path")
    return out if add_to is not None else out.reshape(*x.shape[:-1], n)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of rows x [..., D] by `weight` [D], in one pass: fp32 (weight fp32), or bf16
    (weight bf16; rounded where the reference rounds: the normalised row, then the product)."""
    lib, _ = _library()
    dtype = x.dtype if x.dtype == torch.bfloat16 else torch.float32
    rows, w = _rows(x, dtype), weight.to(dtype).contiguous()
    out = torch.empty(rows.shape, dtype=dtype)
    d = rows.shape[1]
    kernel = lib.hm_rms_norm_bf16 if dtype == torch.bfloat16 else lib.hm_rms_norm
    kernel(rows.data_ptr(), rows.stride(0), rows.shape[0], d, w.data_ptr(), eps,
           out.data_ptr(), d, torch.get_num_threads())  # fmt: skip
    return out.reshape(x.shape)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's silu(gate) * up of rows [..., 2I] (gate then up), fp32 or bf16: [..., I], in one
    pass (bf16: silu rounded, then the product, as the reference's two ops)."""
    lib, _ = _library()
    dtype = gate_up.dtype if gate_up.dtype == torch.bfloat16 else torch.float32
    rows = _rows(gate_up, dtype)
    inter = rows.shape[1] // 2
    out = torch.empty(rows.shape[0], inter, dtype=dtype)
    kernel = lib.hm_silu_mul_bf16 if dtype == torch.bfloat16 else lib.hm_silu_mul
    kernel(rows.data_ptr(), rows.stride(0), rows.shape[0], inter, out.data_ptr(), inter,
           torch.get_num_threads())  # fmt: skip
    return out.reshape(*gate_up.shape[:-1], inter)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor | None:
    """torch.argmax(logits, dim=-1) of fp32 CPU rows [B, V] (the first largest, or the first
    NaN), in one pass per row; None for other tensors, or where the library is not here (the
    caller takes torch's)."""
    lib, _ = _library()
    if (
        lib is None
        or logits.device.type != "cpu"
        or logits.dtype != torch.float32
        or logits.dim() != 2
        or not logits.numel()
    ):
        return None
    rows = _rows(logits)
    out = torch.empty(rows.shape[0], dtype=torch.int64)
    lib.hm_argmax_f32(rows.data_ptr(), rows.stride(0), rows.shape[0], rows.shape[1],
                      out.data_ptr(), torch.get_num_threads())  # fmt: skip
    return out


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [N, heads, D] in place (rotate-half layout) by cos/sin [N, 1, D/2] (or [N, D/2])
    of x's dtype, fp32 or bf16; unit stride along D. Returns x."""
    lib, _ = _library()
    n, heads, d = x.shape
    c = cos.reshape(n, d // 2).contiguous()
    s = sin.reshape(n, d // 2).contiguous()
    code = 1 if x.dtype == torch.bfloat16 else 0
    lib.hm_rope(x.data_ptr(), x.stride(0), x.stride(1), n, heads, d, c.data_ptr(), s.data_ptr(),
                code, torch.get_num_threads())  # fmt: skip
    return x


# ---- causal prefill attention in bf16 and fp32 (csrc/prefill_attention.c) ----


# bf16 prefill attention on AMX tiles where the CPU has them (tests turn it off to check the
# `vdpbf16ps` path on the same CPU)
PREFILL_AMX = True
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
    amx = (int(PREFILL_AMX),) if q.dtype == torch.bfloat16 else ()
    failed = getattr(lib, _PREFILL_ATTENTION[q.dtype])(
        q.data_ptr(), q.stride(0), q.stride(1), k_blocks.data_ptr(), v_blocks.data_ptr(),
        s[0], s[1], s[2], table.data_ptr(), block_size, t, start, q_heads, kv_heads, d, scale,
        out.data_ptr(), out.stride(0), torch.get_num_threads(), *amx,
    )  # fmt: skip
    if failed == -1:
        raise MemoryError("prefill attention could not allocate its packed keys")
    if failed:
        raise ValueError(f"prefill attention refused its arguments (code {failed})")


# ---- a block's copy with its layers' checksums (csrc/copy_hashed.c) ----


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
