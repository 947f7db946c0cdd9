"""Large CPU tensors on transparent huge pages.

A decode step reads a KV pool of hundreds of MB block by block in the order of each sequence's
table: on 4 KiB pages nearly every block is a TLB miss (a core's TLB covers a few MB), and the
walk stalls the read. Linux backs an anonymous range with 2 MiB pages where it is asked to
(madvise MADV_HUGEPAGE; `/sys/kernel/mm/transparent_hugepage/enabled` is `madvise` on most
distributions, so nothing is huge unless asked). bench/kernels.py's bf16 decode step over a pool so
backed: 51 -> 43 ms on a 2-core EPYC.
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import sys

import torch

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # linux/mman.h
_libc = None
_failed = False  # the first failure is logged; later ones are not (a hint, not a requirement)


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask for huge pages under the 2 MiB-aligned interior of `t`'s memory (before its pages are
    first touched: a touched page stays small until khugepaged collapses it); whether the kernel
    took the advice (False off Linux, for small or non-CPU tensors, or when madvise fails)."""
    global _libc, _failed
    nbytes = t.numel() * t.element_size()
    if t.device.type != "cpu" or nbytes < 2 * HUGE_PAGE or not sys.platform.startswith("linux"):
        return False
    start = (t.data_ptr() + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1)
    length = (t.data_ptr() + nbytes - start) & ~(HUGE_PAGE - 1)
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
        rc = _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), _MADV_HUGEPAGE)
    except (OSError, AttributeError) as e:
        rc, why = -1, str(e)
    else:
        why = f"errno {ctypes.get_errno()}"
    if rc != 0 and not _failed:
        _failed = True
        log.warning("madvise(MADV_HUGEPAGE) failed (%s): large tensors stay on small pages", why)
    return rc == 0


def empty_on_huge_pages(shape, dtype: torch.dtype, device="cpu") -> torch.Tensor:
    """torch.empty(shape) advised onto huge pages where it is on the CPU and 4 MiB or more: in an
    anonymous mapping of its own, starting on a 2 MiB boundary, that the tensor keeps alive.
    Why not torch.empty: malloc serves a large block from free memory its heap already holds
    when there is enough (a model load frees ~0.5 GB), and those pages, touched before, stay
    small whatever madvise says: a worker's packed weights and KV pool came out on 4 KiB pages
    once the load's order of allocations changed."""
    shape = tuple(shape)
    nbytes = math.prod(shape) * dtype.itemsize
    if (
        torch.device(device).type != "cpu"
        or nbytes < 2 * HUGE_PAGE
        or not sys.platform.startswith("linux")
    ):
        return torch.empty(shape, dtype=dtype, device=device)
    # private (the default is a shared mapping: shmem, which THP leaves alone), fresh: no page
    # resident until written
    area = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE)
    view = ctypes.c_char.from_buffer(area)
    skip = -ctypes.addressof(view) % HUGE_PAGE
    del view  # (an exported buffer would pin the mapping)
    # frombuffer holds a reference to `area`: the mapping lives as long as the tensor's storage
    t = torch.frombuffer(area, dtype=torch.uint8, count=nbytes, offset=skip)
    t = t.view(dtype).view(shape)
    advise_huge_pages(t)
    return t


def zeros_on_huge_pages(shape, dtype: torch.dtype, device="cpu") -> torch.Tensor:
    """torch.zeros(shape) on huge pages where it is on the CPU (empty_on_huge_pages), every page
    written (resident, as a configured pool is counted)."""
    return empty_on_huge_pages(shape, dtype, device).zero_()
