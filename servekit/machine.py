"""What this machine offers, for the config's `auto` values: the dtype its CPU computes natively
(`dtype: auto`: bf16 where the CPU has AVX-512 BF16 or AMX tiles, fp32 elsewhere, where bf16 is
emulated, 5-7x slower than fp32), and the memory it can still give (the KV tiers' `auto` sizes,
servekit.memory_sizing)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import NamedTuple

DTYPE_AUTO = "auto"


def cpu_flags(cpuinfo: str | None = None) -> dict[str, bool]:
    """The instruction sets that decide fp32 / bf16 speed, from /proc/cpuinfo (or its text)."""
    if cpuinfo is None:
        return dict(_this_cpu())
    lines = cpuinfo.splitlines()
    flags = next((set(x.split(":", 1)[1].split()) for x in lines if x.startswith("flags")), set())
    return {
        "avx2": "avx2" in flags,
        "avx512f": "avx512f" in flags,
        "avx512_bf16": "avx512_bf16" in flags,
        "amx": any(f.startswith("amx") for f in flags),
    }


@functools.cache
def _this_cpu() -> dict[str, bool]:
    # read once a process: the config resolves `auto` per section, the start line says why
    try:
        return cpu_flags(Path("/proc/cpuinfo").read_text())
    except OSError:
        return {}


def native_dtype(flags: dict[str, bool] | None = None) -> str:
    """The fastest dtype the CPU computes natively: bfloat16 with AVX-512 BF16 or AMX, else
    float32."""
    flags = cpu_flags() if flags is None else flags
    return "bfloat16" if flags.get("avx512_bf16") or flags.get("amx") else "float32"


def resolve_dtype(dtype: str, flags: dict[str, bool] | None = None) -> str:
    """`dtype`, with "auto" replaced by this CPU's native dtype."""
    return native_dtype(flags) if dtype == DTYPE_AUTO else dtype


# ---- memory, for the KV tiers' `auto` sizes (servekit.memory_sizing) ----

_NO_LIMIT = 1 << 60  # cgroup v1 writes "no limit" as a page-rounded 2^63 - 1


class MachineMemory(NamedTuple):
    """What memory this machine, or the cgroup this process runs in, can still give (bytes)."""

    total: int  # MemTotal
    available: int  # MemAvailable: free memory plus what the kernel reclaims without swapping
    cgroup_limit: int | None = None  # the tightest memory limit over this process's cgroups
    cgroup_used: int = 0  # what that cgroup holds now, less its reclaimable page cache

    @property
    def usable(self) -> int:
        """MemAvailable, or the room left under the cgroup's limit where that is smaller: a
        cgroup's limit, not the host's free memory, is where a container's processes are
        killed, and what it already holds is not room (so its limit less its use, not the
        limit alone)."""
        if self.cgroup_limit is None:
            return self.available
        return max(0, min(self.available, self.cgroup_limit - self.cgroup_used))


def machine_memory() -> MachineMemory:
    """This machine's memory, from /proc/meminfo and this process's cgroups."""
    try:
        total, available = parse_meminfo(Path("/proc/meminfo").read_text())
    except OSError:
        total = available = 0
    return MachineMemory(total, available, *_cgroup_memory())


def parse_meminfo(text: str) -> tuple[int, int]:
    """(MemTotal, MemAvailable) in bytes from /proc/meminfo's text; a kernel before 3.14 has no
    MemAvailable, and free memory alone (an underestimate) stands for it."""
    kib = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if rest.split():
            kib[key] = int(rest.split()[0])
    return kib.get("MemTotal", 0) * 1024, kib.get("MemAvailable", kib.get("MemFree", 0)) * 1024


def _cgroup_memory(root: Path = Path("/sys/fs/cgroup")) -> tuple[int | None, int]:
    """(limit, use less reclaimable page cache) of the tightest memory limit over this process's
    cgroups and their ancestors, v2 or v1; (None, 0) where there is none."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None, 0
    dirs: list[tuple[Path, str, str, str]] = []  # (dir, limit file, use file, stat key)
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2, mounted at the root or (hybrid) at unified/
            for mount in (root, root / "unified"):
                dirs += [(d, "memory.max", "memory.current", "inactive_file")
                         for d in _ancestors(mount, path)]  # fmt: skip
        elif "memory" in controllers.split(","):
            dirs += [(d, "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
                     for d in _ancestors(root / "memory", path)]  # fmt: skip
    best: tuple[int | None, int] = (None, 0)
    for d, limit_file, use_file, stat_key in dirs:
        try:
            raw = (d / limit_file).read_text().strip()
            limit = None if raw == "max" else int(raw)
            if limit is None or limit >= _NO_LIMIT:
                continue
            used = int((d / use_file).read_text())
            stat = dict(x.split() for x in (d / "memory.stat").read_text().splitlines())
            used -= min(used, int(stat.get(stat_key, 0)))
        except (OSError, ValueError):
            continue
        if best[0] is None or limit - used < best[0] - best[1]:
            best = (limit, used)
    return best


def _ancestors(mount: Path, path: str) -> list[Path]:
    """`mount`/`path` and each directory above it up to `mount`, those that exist (inside a
    container the cgroup's path is often not mounted: its own cgroup is the mount's root)."""
    parts = [p for p in path.split("/") if p]
    found = [mount.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]
    return [d for d in found if d.is_dir()]
