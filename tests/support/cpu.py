"""What this CPU can run of mlxrt's native kernels (for skipping their tests elsewhere)."""

from __future__ import annotations

from pathlib import Path

from engine import native


def has_avx2_and_fma() -> bool:
    flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    return {"avx2", "fma"} <= set(flags.split())


def kernels_supported() -> bool:
    """Linux x86-64 with AVX2 and FMA: where mlxrt's CPU kernels build and serve."""
    return native.supported_platform() and has_avx2_and_fma()
