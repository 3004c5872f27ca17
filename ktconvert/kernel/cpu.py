"""The CPU features kt-kernel's variant choice and llama.cpp's kernels depend on, from ``/proc/cpuinfo``.

Read from the file rather than by importing kt_kernel (which would change this process's float behaviour).
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

# flag names as Linux prints them -> what they enable
FEATURES = {
    "avx2": "AVX2",
    "avx512f": "AVX-512 F",
    "avx512bw": "AVX-512 BW",
    "avx512_vnni": "AVX-512 VNNI (int8 dot products: kt-kernel's AMXINT8 path without AMX)",
    "avx512_bf16": "AVX-512 BF16",
    "avx_vnni": "AVX-VNNI (256-bit int8 dot products)",
    "amx_tile": "AMX tiles",
    "amx_int8": "AMX INT8",
    "amx_bf16": "AMX BF16",
}


def parse_cpuinfo(text: str) -> dict:
    """``{"model": str|None, "logical_cpus": int, "flags": set}`` from the text of /proc/cpuinfo."""
    model, flags, cpus = None, set(), 0
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "processor":
            cpus += 1
        elif key == "model name" and model is None:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    return {"model": model, "logical_cpus": cpus, "flags": flags}


def cpu_features(cpuinfo: str | os.PathLike = "/proc/cpuinfo") -> dict:
    """CPU model, logical CPUs, and each feature of :data:`FEATURES` present or not."""
    path = Path(cpuinfo)
    try:
        info = parse_cpuinfo(path.read_text(errors="replace"))
    except OSError:
        info = {"model": platform.processor() or None, "logical_cpus": os.cpu_count() or 0, "flags": set()}
    return {"model": info["model"], "logical_cpus": info["logical_cpus"] or (os.cpu_count() or 0),
            "machine": platform.machine(), "source": str(path) if info["flags"] else None,
            "features": {f: f in info["flags"] for f in FEATURES}}
