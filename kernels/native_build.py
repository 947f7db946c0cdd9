"""The kernels' C library (kernels/csrc/): built on first use with the system C compiler, cached
by source, compiler flags and CPU, loaded through ctypes with each entry point's signature from
native_abi.py; and whether it is there (`native_status`), and the OpenMP thread release.

`native_status()` says whether the library is there and, if not, why; the dispatch then falls
back to the torch twin (paged_attention_torch.py), logs the reason once, and a worker reports it
as a metric. `HALFMOON_NATIVE=0` turns it off (to compare against the twin). The compiled
library lives under $HALFMOON_CACHE (default ~/.cache/halfmoon, where models are fetched to) in
`kernels/`, named by a hash of the source, the compiler, the flags and what `-march=native`
means on this CPU, so a changed source or another kind of CPU builds its own; the build writes a
temporary file and renames it, so processes that build at once never load a half-written
library.

The library links OpenMP as `libgomp.so.1`, the soname torch's own runtime is loaded under, so
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

from kernels.native_abi import declare

log = logging.getLogger("halfmoon.kernels")

# One library of every kernel (decode and prefill attention, the small-batch linear of packed
# panels with the element-wise steps around it, the hashed copies, the fused decode step); the
# headers they include count towards the cache key.
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
    declare(lib)
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
