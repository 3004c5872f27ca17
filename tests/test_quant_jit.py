"""The compiled quantizers (ktconvert/quant/_jit.py, _jit_imatrix.py) as compiled code: no fused multiply-add anywhere (the C
reference has none on x86-64, and a contraction would change the last bit of some scales), and numba's disk
cache works when the installed package directory cannot be written. Byte equality with ggml's C is
tests/test_quant_exact.py."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

JIT = Path(__file__).resolve().parents[1] / "ktconvert" / "quant" / "_jit.py"
JIT_IMATRIX = JIT.with_name("_jit_imatrix.py")

_INSPECT = r"""
import json, re, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
import kt_jit_probe as J
from kt_jit_probe_pkg import _jit_imatrix as W
res = {}
x, qw = np.ones((2, 256), np.float32), np.ones((1, 256), np.float32)
kernels = (  # q2_k/q5_k share q4_k's search; the imatrix kernels share _qkx3/_qp/_qx
    ("q4_k", J.q4_k, (x, np.zeros((2, 144), np.uint8))), ("q6_k", J.q6_k, (x, np.zeros((2, 210), np.uint8))),
    ("q8_0", J.q8_0, (np.ones((2, 32), np.float32), np.zeros((2, 34), np.uint8))),
    ("q4_k imatrix", W.q4_k, (x, qw, 0, 2, np.zeros((2, 144), np.uint8))),
    ("iq4_xs", W.iq4_xs, (x, qw, 0, 2, np.zeros((2, 136), np.uint8))),
)
for name, fn, args in kernels:
    fn(*args)
    asm = "\n".join(fn.inspect_asm().values())
    ir = "\n".join(fn.inspect_llvm().values())
    res[name] = {
        "fma": re.findall(r"\b(v?f(?:n)?m(?:add|sub)\w*|fml[as]\w*)\b", asm)[:5],
        "flags": re.findall(r"\b(?:fmul|fadd|fsub|fdiv)\s+(?:contract|fast|reassoc|afn|arcp|nsz|nnan|ninf)\b", ir)[:5],
        "fmuladd": "llvm.fmuladd" in ir or "llvm.fma." in ir,
        "fmul": len(re.findall(r"\bfmul\b", ir)),
        "mul_insns": len(re.findall(r"\bv?mul[sp]s\b|\bfmul\b", asm)),
    }
print(json.dumps(res))
"""


def _probe(tmp_path: Path) -> Path:
    """A copy of _jit.py as a standalone module (it imports only numpy, numba and llvmlite)."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    shutil.copy(JIT, pkg / "kt_jit_probe.py")
    return pkg


def _probe_pkg(tmp_path: Path) -> Path:
    """_probe plus a package holding _jit.py and _jit_imatrix.py (which imports ._jit)."""
    pkg = _probe(tmp_path)
    sub = pkg / "kt_jit_probe_pkg"
    sub.mkdir()
    (sub / "__init__.py").write_text("")
    shutil.copy(JIT, sub / "_jit.py")
    shutil.copy(JIT_IMATRIX, sub / "_jit_imatrix.py")
    return pkg


def _env(tmp_path: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_")}
    env.update(XDG_CACHE_HOME=str(tmp_path / "xdg"), OMP_NUM_THREADS="1", **extra)
    return env


def test_compiled_kernels_hold_no_fused_multiply_add(tmp_path):
    """fastmath is off: LLVM gets no ``contract`` flag, emits no fmuladd, and the machine code (compiled for
    this CPU, FMA units included where it has them) has no FMA instruction."""
    pkg = _probe_pkg(tmp_path)
    res = subprocess.run([sys.executable, "-c", _INSPECT, str(pkg)], capture_output=True, text=True, timeout=600,
                         env=_env(tmp_path, NUMBA_CACHE_DIR=str(tmp_path / "fresh")))  # fresh compile: inspectable
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    for name, r in got.items():
        assert r["fmul"] > 0 and r["mul_insns"] > 0, f"{name}: no multiplications found; the inspection is broken"
        assert not r["flags"], f"{name}: fast-math flags in the IR: {r['flags']}"
        assert not r["fmuladd"], f"{name}: an fmuladd/fma intrinsic in the IR"
        assert not r["fma"], f"{name}: FMA instructions on {platform.machine()}: {r['fma']}"


_CALL = r"""
import json, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
import kt_jit_probe as J
J.q8_0(np.ones((4, 32), np.float32), np.zeros((4, 34), np.uint8))
print(json.dumps({"hits": sum(J.q8_0.stats.cache_hits.values()), "misses": sum(J.q8_0.stats.cache_misses.values())}))
"""


def test_compile_cache_works_when_the_install_is_read_only(tmp_path):
    """With no writable ``__pycache__`` beside the module (a read-only site-packages; here ``__pycache__`` is a
    plain file, since a root test cannot make a directory unwritable), numba caches in the per-user cache
    directory, and a second process loads the kernel from there instead of compiling it again."""
    pkg = _probe(tmp_path)
    (pkg / "__pycache__").write_text("not a directory")
    runs = []
    for _ in range(2):
        res = subprocess.run([sys.executable, "-c", _CALL, str(pkg)], capture_output=True, text=True, timeout=600,
                             env=_env(tmp_path))
        assert res.returncode == 0, res.stderr[-3000:]
        runs.append(json.loads(res.stdout.strip().splitlines()[-1]))
    assert runs[0] == {"hits": 0, "misses": 1}
    assert runs[1] == {"hits": 1, "misses": 0}
    cached = [p.name for p in (tmp_path / "xdg").rglob("kt_jit_probe.q8_0*")]
    assert any(n.endswith(".nbi") for n in cached) and any(n.endswith(".nbc") for n in cached), cached
    assert sorted(p.name for p in pkg.iterdir()) == ["__pycache__", "kt_jit_probe.py"]
