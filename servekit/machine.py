"""What this machine's CPU computes natively, for `dtype: auto`: bf16 where the CPU has
AVX-512 BF16 or AMX tiles, fp32 elsewhere (there bf16 is emulated, 5-7x slower than fp32)."""

from __future__ import annotations

import functools
from pathlib import Path

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
