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


def zeros_on_huge_pages(shape, dtype: torch.dtype, device="cpu") -> torch.Tensor:
    """torch.zeros(shape), its memory advised onto huge pages first where it is on the CPU."""
    t = torch.empty(shape, dtype=dtype, device=device)
    advise_huge_pages(t)
    return t.zero_()
