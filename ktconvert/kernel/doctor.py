"""What is installed and usable here for running converted weights: the CPU features that matter, kt-kernel
(version, the variant it selects, which methods it runs on this CPU) and llama.cpp (llama-cpp-python).

Both engines are asked in child processes: importing kt_kernel changes this process's float behaviour, and
importing llama.cpp costs seconds. Library code: returns a dict, the CLI renders it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

from ktconvert.kernel.cpu import cpu_features
from ktconvert.kernel.methods import METHODS
from ktconvert.kernel.runner import probe_kernel

REQUIREMENTS = ("kt-kernel", "llama-cpp", "avx512", "amx", *METHODS)

_LLAMA_CHILD = r"""
import json, sys
import llama_cpp
info = llama_cpp.llama_print_system_info()
info = info.decode() if isinstance(info, bytes) else str(info)
print(json.dumps({"version": getattr(llama_cpp, "__version__", None), "file": llama_cpp.__file__, "system_info": info}))
"""


def _llama_cpp_paths() -> list[str]:
    """Where llama-cpp-python may be: this environment, then the tests' source build cache."""
    root = os.environ.get("KTCONVERT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "ktconvert")
    cached = sorted((Path(root) / "llama-cpp-python").glob("*/llama_cpp/__init__.py"))
    return [str(p.parent.parent) for p in cached if (p.parent.parent / ".complete").is_file()]  # finished builds


def probe_llama_cpp(timeout: float = 60) -> dict:
    """llama-cpp-python importable in a child? Its version and llama.cpp's ``system_info`` (the CPU features
    the build uses, e.g. ``AMX_INT8 = 1``)."""
    candidates = [None] + _llama_cpp_paths() if importlib.util.find_spec("llama_cpp") else _llama_cpp_paths()
    if not candidates:
        return {"importable": False, "error": "llama_cpp is not installed", "version": None, "system_info": None}
    last = ""
    for extra in candidates:
        env = dict(os.environ)
        if extra:
            env["PYTHONPATH"] = os.pathsep.join([extra, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        try:
            res = subprocess.run([sys.executable, "-c", _LLAMA_CHILD], capture_output=True, text=True, env=env,
                                 timeout=timeout)
        except subprocess.TimeoutExpired:
            last = f"importing llama_cpp took over {timeout:.0f} s"
            continue
        if res.returncode == 0 and res.stdout.strip():
            out = json.loads(res.stdout.strip().splitlines()[-1])
            info = out["system_info"]
            return {"importable": True, "error": None, "version": out["version"], "from": extra or "this environment",
                    "system_info": info,
                    "amx_in_build": "AMX_INT8 = 1" in info,
                    "note": ("this build has llama.cpp's AMX buffer types, whose repack path segfaulted on quantized "
                             "MoE GGUFs (issue 21): load models with use_extra_bufts=False"
                             if "AMX_INT8 = 1" in info else None)}
        last = (res.stderr.strip().splitlines() or [f"exit {res.returncode}"])[-1]
    return {"importable": False, "error": last, "version": None, "system_info": None}


def _method_rows(cpu: dict, kernel: dict) -> list[dict]:
    feats = cpu["features"]
    amx = feats["amx_tile"] and feats["amx_int8"]
    rows = []
    for name, m in METHODS.items():
        runs = kernel["available"] and name in kernel["methods"]
        path = None
        if runs and name in ("AMXINT8", "AMXINT4"):
            path = "AMX tiles" if amx and kernel.get("variant") == "amx" else "AVX-512 VNNI (no AMX here)"
        rows.append({"method": name, "reads": m.reads, "runs": runs, "path": path,
                     "ktconvert_verifies": m.driven or bool(m.release)})
    return rows


def doctor(*, llama: bool = True) -> dict:
    """The whole report: ``{"cpu", "kt_kernel", "methods", "llama_cpp"}``."""

    cpu = cpu_features()
    installed = importlib.util.find_spec("kt_kernel") is not None
    kernel = dict(probe_kernel()) if installed else {
        "available": False, "version": None, "variant": None, "methods": [],
        "error": "kt_kernel is not installed (pip install --no-deps kt-kernel==0.7.2)"}
    kernel["installed"] = installed
    kernel["variant_override"] = os.environ.get("KT_KERNEL_CPU_VARIANT")
    return {"cpu": cpu, "kt_kernel": kernel, "methods": _method_rows(cpu, kernel),
            "llama_cpp": probe_llama_cpp() if llama else {"importable": None, "error": "not checked"}}


def missing(report: dict, required: list[str]) -> list[str]:
    """One line per requirement the report does not meet (``REQUIREMENTS``: names and method names)."""
    out = []
    feats = report["cpu"]["features"]
    for req in required:
        if req == "kt-kernel" and not report["kt_kernel"]["available"]:
            out.append(f"kt-kernel: {report['kt_kernel']['error']}")
        elif req == "llama-cpp" and not report["llama_cpp"].get("importable"):
            out.append(f"llama-cpp: {report['llama_cpp'].get('error')} (pip install llama-cpp-python)")
        elif req == "avx512" and not (feats["avx512f"] and feats["avx512bw"]):
            out.append("avx512: this CPU lacks AVX-512 F/BW")
        elif req == "amx" and not (feats["amx_tile"] and feats["amx_int8"]):
            out.append("amx: this CPU has no AMX tiles (AMXINT8/AMXINT4 still run on the AVX-512 VNNI path)")
        elif req in METHODS:
            row = next(r for r in report["methods"] if r["method"] == req)
            if not row["runs"]:
                why = report["kt_kernel"]["error"] or f"no {req} kernel in the {report['kt_kernel']['variant']} variant"
                out.append(f"{req}: does not run here: {why}")
    return out
