"""What every benchmark records about the machine it ran on."""

from __future__ import annotations

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
