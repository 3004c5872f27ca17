"""llama.cpp's own ``llama-imatrix``, ``llama-quantize`` and ``llama-perplexity``, built from the pinned llama-cpp-python sdist into the
shared cache (next to ggml's reference build, tests/ggml_ref.py) and run as child processes.

The imatrix parity tests compare ``ktconvert quantize --imatrix`` with ``llama-quantize --imatrix`` byte for byte;
llama-cpp-python's C API cannot pass an imatrix (a C++ map), so the tools themselves are built. The KL-divergence
base-file tests run ``llama-perplexity --kl-divergence-base`` / ``--kl-divergence``. A tool missing from an older
cache is built and added beside the ones already there (they are kept). Static libraries
(no ``LD_LIBRARY_PATH``), ``GGML_NATIVE=OFF`` like the other builds. About 5 minutes on 2 cores, once.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from ggml_ref import LLAMA_CPP_PYTHON_VERSION, RefUnavailable, _run, download_sdist, extract_vendor

TOOLS = ("llama-imatrix", "llama-quantize", "llama-perplexity")


def cache_dir() -> Path:
    root = os.environ.get("KTCONVERT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "ktconvert")
    return Path(root) / "llama-tools" / LLAMA_CPP_PYTHON_VERSION


def build(need: tuple[str, ...] = TOOLS) -> Path:
    """The cache directory holding the tools ``need`` names, building every missing one of :data:`TOOLS` on first
    use (one build for all; a lock serialises concurrent runs; a tool already in the cache is never rebuilt or
    replaced). Tests that need only some tools do not wait for the others when theirs are there."""
    target = cache_dir()
    if all((target / t).is_file() for t in need):
        return target
    for tool in ("cmake", "cc", "c++"):
        if shutil.which(tool) is None:
            raise RefUnavailable(f"'{tool}' not found on PATH; install cmake and a C/C++ compiler to build llama.cpp's tools")
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{LLAMA_CPP_PYTHON_VERSION}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if all((target / t).is_file() for t in need):
            return target
        missing = [t for t in TOOLS if not (target / t).is_file()]
        with tempfile.TemporaryDirectory(prefix="llama-tools-", dir=target.parent) as tmp:
            tmp = Path(tmp)
            sdist = download_sdist(tmp)
            src = extract_vendor(sdist, tmp / "src", ())
            sdist.unlink()
            (src / "ggml" / "ggml.pc.in").touch()  # the sdist lacks it and ggml's CMakeLists configures it
            bdir = tmp / "build"
            gen = ["-G", "Ninja"] if shutil.which("ninja") else []
            _run(["cmake", *gen, "-S", str(src), "-B", str(bdir), "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF",
                  "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                  "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=OFF"],
                 None, "cmake configure of llama.cpp", timeout=600)
            _run(["cmake", "--build", str(bdir), "--target", *missing, "-j", str(os.cpu_count() or 1)],
                 None, f"build of {', '.join(missing)}", timeout=2400)
            target.mkdir(parents=True, exist_ok=True)
            target.chmod(0o755)
            for t in missing:
                found = [p for p in bdir.rglob(t) if p.is_file() and os.access(p, os.X_OK)]
                if not found:
                    raise RefUnavailable(f"the llama.cpp build produced no {t}")
                shutil.copy2(found[0], tmp / t)
                os.replace(tmp / t, target / t)  # each binary appears whole or not at all
    return target


def run_tool(tool: str, args: list[str], timeout: int = 600) -> str:
    """Run ``tool`` (one of :data:`TOOLS`) with ``args`` on one thread; returns its log, raises AssertionError with
    the log's tail when it fails."""
    exe = build((tool,)) / tool
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([str(exe), *args], env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{tool} failed (exit {proc.returncode}):\n"
                             + "\n".join((proc.stderr + proc.stdout).splitlines()[-10:]))
    return proc.stderr + proc.stdout


if __name__ == "__main__":  # python tests/llamacpp_tools.py: build the cache ahead of a test run
    print(build())
