"""What every benchmark records about the machine it ran on, and how it times a call."""

from __future__ import annotations

import statistics
import time
from pathlib import Path


def cpu_flags() -> dict[str, bool]:
    """The instruction sets that decide fp32/bf16 speed here, from /proc/cpuinfo."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return {}
    flags = next((set(x.split(":", 1)[1].split()) for x in lines if x.startswith("flags")), set())
    return {
        "avx2": "avx2" in flags,
        "avx512f": "avx512f" in flags,
        "avx512_bf16": "avx512_bf16" in flags,
        "amx": any(f.startswith("amx") for f in flags),
    }


def median_s(fn, repeats: int, warmup: bool = True) -> float:
    """Median wall seconds of `repeats` calls of fn (after one untimed call when `warmup`): this
    machine is shared and noisy, so medians, not means."""
    if warmup:
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
