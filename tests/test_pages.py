"""kernels/pages.py: a KV pool on the CPU asks for transparent huge pages before its first touch."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import kernels
from kernels import FullKVLayout

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str:
    try:
        return re.search(r"\[(\w+)\]", THP.read_text()).group(1)
    except (OSError, AttributeError):
        return ""


def eligible(t: torch.Tensor) -> bool:
    """Whether the kernel may back the mapping holding t's middle with huge pages
    (/proc/self/smaps: THPeligible of the area around the address)."""
    addr = t.data_ptr() + t.numel() * t.element_size() // 2
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if m:
            inside = int(m.group(1), 16) <= addr < int(m.group(2), 16)
        elif inside and line.startswith("THPeligible:"):
            return line.split()[1] == "1"
    raise AssertionError("no mapping holds the tensor")


@pytest.mark.skipif(thp_mode() != "madvise", reason="needs transparent huge pages on madvise")
def test_a_kv_pool_asks_for_huge_pages():
    layout = FullKVLayout(30, 3, 64, 16, torch.bfloat16)
    pool = layout.empty_blocks(256)  # 45 MiB
    assert not pool.any() and pool.shape == (256, *layout.block_shape)
    assert eligible(pool)  # (a plain allocation is not, unless malloc hands back advised memory)
    small = kernels.zeros_on_huge_pages((1024,), torch.float32)  # under 4 MiB: not worth asking
    assert not small.any() and not kernels.advise_huge_pages(small)


def mapped(addr: int) -> bool:
    """Whether any mapping of this process holds `addr`."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        if lo <= addr < hi:
            return True
    return False


@pytest.mark.skipif(thp_mode() != "madvise", reason="needs transparent huge pages on madvise")
def test_huge_page_tensors_have_a_mapping_of_their_own():
    # not malloc's (which may hand back freed pages, touched, that madvise leaves small): a
    # fresh mapping starting on a huge page, that lives as long as a view of it
    t = kernels.empty_on_huge_pages((3, 8 << 20), torch.bfloat16)
    assert t.shape == (3, 8 << 20) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % kernels.HUGE_PAGE == 0 and eligible(t)
    t[1].fill_(2.5)
    row = t[1, -5:].clone()
    view, addr = t[2], t.data_ptr()
    del t  # a view keeps the mapping
    view.fill_(-1.0)
    assert mapped(addr) and row.tolist() == [2.5] * 5 and view[-1].item() == -1.0
    del view  # the last reference: the mapping goes
    assert not mapped(addr)
