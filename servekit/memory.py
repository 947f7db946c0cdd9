"""A server's memory: what it holds resident against what it was configured to hold (weights,
pools, tiers), and handing freed heap back to the system after a load."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
from typing import NamedTuple

import psutil

log = logging.getLogger(__name__)


class MemoryUsage(NamedTuple):
    """One process's resident memory (bytes), from /proc/<pid>/smaps_rollup."""

    rss: int  # resident pages it maps, shared ones (the store's slab, libraries) in full
    uss: int  # resident pages only this process maps
    pss: int  # rss with each shared page divided among the processes mapping it: summed over
    # a cluster's processes, a shared slab counts once


def memory_usage(pid: int | None = None) -> MemoryUsage:
    """This process's (or `pid`'s) resident memory."""
    m = psutil.Process(pid).memory_full_info()
    return MemoryUsage(m.rss, m.uss, getattr(m, "pss", m.uss))


def resident_without_shared_memory(pid: int) -> int:
    """`pid`'s resident bytes less its shared-memory mappings' (RssShmem): a worker maps the
    store's slab to move blocks and touches all of it in time, but the store holds those pages
    (they count once, in the store's RSS). Raises psutil.NoSuchProcess for a process gone."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            fields = (line.split(":", 1) for line in f)
            kb = {k: int(v.split()[0]) for k, v in fields if k.startswith("Rss")}
    except FileNotFoundError:
        raise psutil.NoSuchProcess(pid) from None
    return (kb.get("RssAnon", 0) + kb.get("RssFile", 0)) * 1024


# A worker idle this long gives the heap its last forwards freed back to the system: glibc keeps
# freed memory in its arenas (a 16 x 512-token prefill round frees ~0.3 GB of activations), where
# it stays resident. Waiting out a burst keeps the trim, and the faults that refill the heap,
# off the busy path.
IDLE_TRIM_S = 0.5


def release_freed_heap() -> bool:
    """Return the heap that loading freed to the system. glibc keeps freed memory in its arenas;
    a model load (a file read, dequantized, converted and copied) leaves ~0.4 GB of it behind
    for SmolLM2 in fp32, resident until malloc_trim. False where there is no glibc."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        trim = None
    if trim is None:
        log.info("malloc_trim unavailable (no glibc): freed heap stays with the process")
        return False
    trim(0)
    return True


def freeze_startup_objects() -> None:
    """Collect, then move every object alive now (a model's modules, a tokenizer's vocabulary,
    the server's own) out of the cyclic collector's sight. Why: a full collection walked them all
    every ~70k allocations, ~3% of a bf16 1,024-token prefill on 2 cores (302 against 312 ms).
    Only for a process that hosts one server for its life: what is frozen is never collected as
    part of a cycle."""
    gc.collect()
    gc.freeze()


def tensor_bytes(*tensors) -> int:
    """Bytes the tensors' storage holds (each storage once; a packed weight, which has no
    storage to ask, by its values' bytes)."""
    from kernels import tensor_nbytes  # here: the store node and conductor import this module

    seen, total = set(), 0
    for t in tensors:
        if t.is_mkldnn:
            total += tensor_nbytes(t)
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total
