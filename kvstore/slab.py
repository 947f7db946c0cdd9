"""The dram tier's memory: one file in /dev/shm, mapped by the node and by same-host clients,
with a first-fit allocator over it (the allocator lives only in the node)."""

from __future__ import annotations

import bisect
import functools
import mmap
import os
import re
import time
import uuid

import numpy as np

from kvstore.block_header import ALIGN

_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


class ShmSlab:
    """A shared-memory file of `size` bytes; the creating node owns (and unlinks) it."""

    def __init__(self, path: str, size: int, create: bool, populate: bool = True):
        self.path, self.size, self.owner = path, size, create
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            elif os.fstat(fd).st_size != size:
                raise ValueError(
                    f"shared memory {path} is {os.fstat(fd).st_size} bytes, expected {size}"
                )
            mm = mmap.mmap(fd, size) if size else None
        finally:
            os.close(fd)
        self.mm: mmap.mmap | None = mm
        if mm is not None and populate:
            self._populate(mm)
        # the same bytes as a numpy array, for plain copies (`tensor`: as a torch tensor); both
        # are empty once closed
        self.array: np.ndarray = (
            np.frombuffer(mm, dtype=np.uint8) if mm is not None else np.empty(0, np.uint8)
        )
        self.view: memoryview = memoryview(mm) if mm is not None else memoryview(b"")

    @functools.cached_property
    def tensor(self):
        """The slab as a uint8 torch tensor (for clients that copy blocks into tensors; torch is
        imported here, so a store node that never asks does not load it)."""
        import torch

        return torch.from_numpy(self.array)

    def _populate(self, mm: mmap.mmap) -> None:
        # Fault every page in now: first touches of tmpfs pages during a copy cost ~5x the copy.
        try:
            mm.madvise(_MADV_POPULATE_WRITE)
        except (OSError, ValueError):  # kernels before 5.14
            step = mmap.PAGESIZE
            view = memoryview(mm)
            for off in range(0, self.size, step):
                view[off] = view[off]
            view.release()

    @classmethod
    def create(cls, shm_dir: str, node_id: str, size: int) -> ShmSlab:
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in node_id)
        return cls(
            os.path.join(shm_dir, f"halfmoon-{safe}-{uuid.uuid4().hex[:12]}"), size, create=True
        )  # named as SLAB_NAME matches

    def close(self) -> None:
        self.__dict__.pop("tensor", None)  # the torch view, if one was made
        # drop the references into the mapping (closing it fails while one is exported)
        self.array = np.empty(0, np.uint8)
        self.view.release()
        self.view = memoryview(b"")
        if self.mm is not None:
            try:
                self.mm.close()
            except BufferError:  # a tensor over it still lives somewhere; the mapping dies with it
                pass
            self.mm = None
        if self.owner:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


# what ShmSlab.create names a slab: other halfmoon files share the directory (the workers' CPU
# turn locks, halfmoon-cpus-*.lock, are held with flock and never mapped: not a slab to remove)
SLAB_NAME = re.compile(r"halfmoon-[A-Za-z0-9_-]+-[0-9a-f]{12}")


def remove_stale(shm_dir: str, min_age_s: float = 60.0) -> list[str]:
    """Unlink slab files that no live process maps (left by nodes that were killed); their paths."""
    try:
        names = [n for n in os.listdir(shm_dir) if SLAB_NAME.fullmatch(n)]
    except OSError:
        return []
    now = time.time()
    candidates = set()
    for n in names:
        path = os.path.join(shm_dir, n)
        try:
            if now - os.stat(path).st_mtime >= min_age_s:
                candidates.add(path)
        except OSError:
            pass
    if not candidates:
        return []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                maps = f.read()
        except OSError:
            continue
        candidates = {p for p in candidates if p not in maps}
        if not candidates:
            return []
    removed = []
    for path in candidates:
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass
    return removed


class SlabAllocator:
    """First-fit allocation of ALIGN-aligned ranges in [0, size); frees coalesce with neighbours."""

    def __init__(self, size: int):
        self.size = size
        self._free_off: list[int] = [0] if size else []  # sorted offsets of free ranges
        self._free_len: dict[int, int] = {0: size} if size else {}
        self.used = 0

    @staticmethod
    def rounded(n: int) -> int:
        return (n + ALIGN - 1) // ALIGN * ALIGN

    def alloc(self, n: int) -> int | None:
        """Offset of a new range of n bytes, or None when no free range is big enough."""
        n = self.rounded(max(n, 1))
        for i, off in enumerate(self._free_off):
            ln = self._free_len[off]
            if ln >= n:
                del self._free_len[off]
                if ln == n:
                    self._free_off.pop(i)
                else:
                    self._free_off[i] = off + n
                    self._free_len[off + n] = ln - n
                self.used += n
                return off
        return None

    def free(self, off: int, n: int) -> None:
        n = self.rounded(max(n, 1))
        self.used -= n
        i = bisect.bisect_left(self._free_off, off)
        # merge with the next range
        if i < len(self._free_off) and self._free_off[i] == off + n:
            n += self._free_len.pop(self._free_off.pop(i))
        # merge with the previous range
        if i > 0:
            prev = self._free_off[i - 1]
            if prev + self._free_len[prev] == off:
                self._free_len[prev] += n
                return
        self._free_off.insert(i, off)
        self._free_len[off] = n

    def largest_free(self) -> int:
        return max(self._free_len.values(), default=0)
