"""ggml's C reference quantizers, built from the llama-cpp-python sdist and loaded through ctypes.

Used by the bit-exactness tests and by ``benchmarks/bench_quant.py``. Only the ``ggml-base`` target is
built (it holds ``ggml-quants.c`` and ``ggml_quantize_chunk``), with ``GGML_NATIVE=OFF`` so the
compiler cannot contract ``a*b+c`` into FMAs: that is the code path ``llama-quantize`` takes on a
plain x86-64 build. The build lands in a cache directory outside the repository and is reused.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np

#: Pinned so every machine compares against the same ggml (0.3.36 vendors ggml 0.25.3).
LLAMA_CPP_PYTHON_VERSION = "0.3.36"

_LIB_NAME = "libggml-base.so"


class RefUnavailable(RuntimeError):
    """The reference cannot be built here; the message says why (shown as the skip reason)."""


def cache_dir() -> Path:
    root = os.environ.get("KTCONVERT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "ktconvert")
    return Path(root) / "ggml-ref" / LLAMA_CPP_PYTHON_VERSION


def _run(cmd: list[str], cwd: Path | None, what: str, timeout: int) -> None:
    try:
        proc = subprocess.run(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout, text=True)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RefUnavailable(f"{what} failed: {exc}") from exc
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.splitlines()[-15:])
        raise RefUnavailable(f"{what} failed (exit {proc.returncode}):\n{tail}")


def extract_vendor(sdist: Path, dest: Path, sub: tuple[str, ...] = ("ggml",)) -> Path:
    """Extract ``vendor/llama.cpp/<sub>`` of the sdist (only ``ggml``: 25 MB of its 217 MB; ``()``: the whole
    llama.cpp tree), refusing unsafe members; returns the extracted ``vendor/llama.cpp/<sub>`` directory."""
    want = ["vendor", "llama.cpp", *sub]
    prefix = None
    with tarfile.open(sdist, "r:gz") as tar:
        members = []
        for m in tar.getmembers():
            parts = m.name.split("/")
            if len(parts) >= 1 + len(want) and parts[1:1 + len(want)] == want:
                if m.name.startswith("/") or ".." in parts or not (m.isfile() or m.isdir()):
                    continue
                prefix = parts[0]
                members.append(m)
        if not members:
            raise RefUnavailable(f"{sdist.name} has no {'/'.join(want)} directory")
        tar.extractall(dest, members=members, filter="data")
    return dest.joinpath(prefix, *want)


def download_sdist(dest: Path) -> Path:
    """pip-download the pinned llama-cpp-python sdist into ``dest``; returns its path."""
    _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q",
          f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", str(dest)],
         None, f"pip download of llama-cpp-python {LLAMA_CPP_PYTHON_VERSION}", timeout=900)
    sdists = list(dest.glob("llama_cpp_python-*.tar.gz"))
    if not sdists:
        raise RefUnavailable("pip download produced no llama-cpp-python sdist")
    return sdists[0]


def build(verbose: bool = False) -> Path:
    """Return the path of a built ``libggml-base.so``, building it into the cache on first use."""
    target = cache_dir()
    lib = target / _LIB_NAME
    if lib.exists():
        return lib
    for tool in ("cmake", "cc"):
        if shutil.which(tool) is None:
            raise RefUnavailable(f"'{tool}' not found on PATH; install cmake and a C/C++ compiler to build ggml's reference")
    target.parent.mkdir(parents=True, exist_ok=True)
    lock_path = target.parent / f".{LLAMA_CPP_PYTHON_VERSION}.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same version
        if lib.exists():
            return lib
        with tempfile.TemporaryDirectory(prefix="ggml-ref-", dir=target.parent) as tmp:
            tmp = Path(tmp)
            sdist = download_sdist(tmp)
            src = extract_vendor(sdist, tmp / "src")
            sdist.unlink()
            (src / "ggml.pc.in").touch()  # the sdist lacks it and ggml's CMakeLists configures it unconditionally
            bdir = tmp / "build"
            gen = ["-G", "Ninja"] if shutil.which("ninja") else []
            _run(["cmake", *gen, "-S", str(src), "-B", str(bdir), "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF",
                  "-DGGML_BUILD_TESTS=OFF", "-DGGML_BUILD_EXAMPLES=OFF", "-DBUILD_SHARED_LIBS=ON"],
                 None, "cmake configure of ggml", timeout=600)
            _run(["cmake", "--build", str(bdir), "--target", "ggml-base", "-j", str(os.cpu_count() or 1)],
                 None, "build of ggml-base", timeout=1800)
            built = sorted(bdir.rglob(_LIB_NAME + "*"), key=lambda p: len(p.name))
            real = [p for p in built if p.is_file() and not p.is_symlink()]
            if not real:
                raise RefUnavailable("the ggml-base build produced no shared library")
            staging = Path(tempfile.mkdtemp(prefix="stage-", dir=target.parent))
            staging.chmod(0o755)
            shutil.copy2(real[-1], staging / _LIB_NAME)
            shutil.copy2(src / "include" / "ggml.h", staging / "ggml.h")  # kept to check signatures against
            os.replace(staging, target)
    return lib


class GgmlRef:
    """ctypes wrapper over ``ggml_quantize_chunk`` and the per-type ``to_float`` dequantizers."""

    def __init__(self, lib_path: Path):
        self.path = Path(lib_path)
        self.lib = lib = ctypes.CDLL(str(self.path))
        # size_t ggml_quantize_chunk(enum ggml_type, const float *src, void *dst, int64_t start,
        #                            int64_t nrows, int64_t n_per_row, const float *imatrix)
        lib.ggml_quantize_chunk.restype = ctypes.c_size_t
        lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                            ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
        lib.ggml_quantize_init.argtypes = [ctypes.c_int]
        lib.ggml_quantize_init.restype = None
        lib.ggml_row_size.restype = ctypes.c_size_t
        lib.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
        lib.ggml_blck_size.restype = ctypes.c_int64
        lib.ggml_blck_size.argtypes = [ctypes.c_int]
        lib.ggml_type_size.restype = ctypes.c_size_t
        lib.ggml_type_size.argtypes = [ctypes.c_int]
        lib.ggml_get_type_traits.restype = ctypes.POINTER(_TypeTraits)
        lib.ggml_get_type_traits.argtypes = [ctypes.c_int]

    def quantize(self, x: np.ndarray, qtype: int, imatrix: np.ndarray | None = None) -> np.ndarray:
        """Quantize rows (last axis) exactly as ``llama-quantize`` does, without an importance matrix or with
        ``imatrix``: ``(n_per_row,)`` for every row, or ``(E, n_per_row)`` for a tensor of ``E`` experts on its
        first axis (llama-quantize passes expert e's slice with expert e's rows, one call per expert)."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        n_per_row = x.shape[-1]
        nrows = x.size // n_per_row
        row_size = self.lib.ggml_row_size(int(qtype), n_per_row)
        out = np.empty((nrows, row_size), dtype=np.uint8)
        self.lib.ggml_quantize_init(int(qtype))
        if imatrix is None:
            parts = [(0, nrows, None)]
        else:
            qw = np.ascontiguousarray(imatrix, dtype=np.float32).reshape(-1, n_per_row)
            per = nrows // qw.shape[0]
            parts = [(e * per, per, qw[e]) for e in range(qw.shape[0])]
        for r0, nr, w in parts:
            got = self.lib.ggml_quantize_chunk(int(qtype), x.ctypes.data, out.ctypes.data, r0 * n_per_row, nr,
                                               n_per_row, None if w is None else w.ctypes.data)
            assert got == nr * row_size
        return out.reshape(*x.shape[:-1], row_size)

    def dequantize(self, q: np.ndarray, qtype: int) -> np.ndarray:
        q = np.ascontiguousarray(q).view(np.uint8)
        blck = self.lib.ggml_blck_size(int(qtype))
        tsize = self.lib.ggml_type_size(int(qtype))
        n_per_row = q.shape[-1] // tsize * blck
        out = np.empty((*q.shape[:-1], n_per_row), dtype=np.float32)
        traits = self.lib.ggml_get_type_traits(int(qtype)).contents
        if int(qtype) == 0:  # F32 has no to_float: the bytes are the floats
            return q.view(np.float32).reshape(out.shape).copy()
        if not traits.to_float:
            raise RefUnavailable(f"ggml type {qtype} has no to_float")
        _TO_FLOAT(traits.to_float)(q.ctypes.data, out.ctypes.data, out.size)
        return out


_TO_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


class _TypeTraits(ctypes.Structure):
    _fields_ = [
        ("type_name", ctypes.c_char_p),
        ("blck_size", ctypes.c_int64),
        ("blck_size_interleave", ctypes.c_int64),
        ("type_size", ctypes.c_size_t),
        ("is_quantized", ctypes.c_bool),
        ("to_float", ctypes.c_void_p),
        ("from_float_ref", ctypes.c_void_p),
    ]


def load() -> GgmlRef:
    """Build (or reuse) and load the reference; raises ``RefUnavailable`` with the reason if it cannot."""
    return GgmlRef(build())


def load_or_skip() -> GgmlRef:
    """:func:`load` for a test fixture: CI must really compare against the C, so under CI (or with
    KTCONVERT_REQUIRE_GGML_REF=1) a failed build fails the test; elsewhere it skips with the reason."""
    import pytest

    try:
        return load()
    except RefUnavailable as exc:
        if os.environ.get("KTCONVERT_REQUIRE_GGML_REF") == "1" or os.environ.get("CI"):
            pytest.fail(f"ggml C reference required but unavailable: {exc}")
        pytest.skip(f"ggml C reference unavailable (build from the llama-cpp-python sdist failed): {exc}")


if __name__ == "__main__":  # python tests/ggml_ref.py: build the cache ahead of a test run
    print(build())
