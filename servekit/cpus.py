"""Which CPUs a worker's process runs on, and how many torch threads it then uses."""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


def parse_cpu_list(name: str, text: str | int) -> list[int]:
    """CPU ids from a list like "0-3,6" (as taskset and cgroups write them; a YAML scalar 2 is
    CPU 2); [] for "". A ValueError names the field and what is wrong."""
    cpus: set[int] = set()
    for part in (p.strip() for p in str(text).split(",") if p.strip()):
        lo, _, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi) if hi else int(lo)
        except ValueError:
            raise ValueError(f"{name}: {part!r} is not a CPU id or a range like 0-3") from None
        if first < 0 or last < first:
            raise ValueError(f"{name}: {part!r} is not a range of CPU ids")
        cpus.update(range(first, last + 1))
    return sorted(cpus)


def pin_process(name: str, cpus_text: str, torch_threads: int) -> int:
    """Keep this process on the CPUs `cpus_text` names (all when ""), and return the torch
    threads it should use: `torch_threads`, or one per pinned CPU when that is 0 (0 = torch's
    default). A CPU this machine does not offer is a ValueError."""
    cpus = parse_cpu_list(name, cpus_text)
    if not cpus:
        return torch_threads
    allowed = os.sched_getaffinity(0)
    missing = sorted(set(cpus) - allowed)
    if missing:
        raise ValueError(f"{name}: CPUs {missing} are not available here (have {sorted(allowed)})")
    os.sched_setaffinity(0, cpus)
    log.info("%s: pinned to CPUs %s", name, cpus)
    return torch_threads or len(cpus)
