"""Start :mod:`ktconvert.kernel.kt_child` in a subprocess and read what it made (this process never imports
kt-kernel). Used by the tests, the benchmark and the kernel check."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from ktconvert.errors import EnvironmentProblem

KT_FILE = re.compile(r"^(INT8|INT4)_(gate|up|down)_(\d+)_(\d+)Byte_(quant|scale)_\.kt$")


def run_child(job: dict, *, python: str | None = None, timeout: float = 600, env: dict | None = None) -> dict:
    """Run one job in a fresh interpreter; its JSON result, or :class:`EnvironmentProblem` with its stderr."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump(job, fh)
        path = fh.name
    try:
        proc = subprocess.run([python or sys.executable, "-m", "ktconvert.kernel.kt_child", path],
                              capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})
    finally:
        os.unlink(path)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        raise EnvironmentProblem(f"kt-kernel child failed ({job.get('job')}): {tail[0]}",
                                 fix="install kt-kernel (pip install --no-deps kt-kernel==0.7.2)")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def probe(python: str | None = None) -> str | None:
    """Why kt-kernel cannot run here (one line), or ``None`` when a child process imports it."""
    try:
        run_child({"job": "probe"}, python=python, timeout=120)
    except (EnvironmentProblem, subprocess.TimeoutExpired, OSError) as exc:
        return str(exc)
    return None


def kernel_pack(layers: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]], *, method: str, parts: int,
                workdir: Path, threads: int | None = None) -> dict[str, np.ndarray]:
    """kt-kernel's own packer, driven as upstream's converter drives it, on ``{layer: (gate, up, down)}`` (float32
    arrays of bf16 values ``[E,I,H]``, ``[E,I,H]``, ``[E,H,I]``): ``{kt-amx tensor name: array}`` read back from
    the ``.kt`` tree it saves, named as upstream's merge step names them."""
    workdir.mkdir(parents=True, exist_ok=True)
    E, I, H = next(iter(layers.values()))[0].shape
    job = {"job": "pack", "method": method, "E": E, "H": H, "I": I, "P": parts, "threads": threads or parts,
           "out": str(workdir / "kt"), "layers": []}
    for L, arrays in layers.items():
        ly = {"layer": L}
        for k, a in zip(("gate", "up", "down"), arrays):
            ly[k] = str(workdir / f"{L}.{k}.npy")
            np.save(ly[k], np.ascontiguousarray(a, dtype=np.float32))
        job["layers"].append(ly)
    run_child(job)
    out = {}
    for L in layers:
        out.update(read_kt_tree(workdir / "kt", L))
    return out


def read_kt_tree(root: Path, layer: int) -> dict[str, np.ndarray]:
    """The ``_layer_L/_numa_N/*.kt`` files of one layer as kt-amx tensors (weight I8, scale F32)."""
    out = {}
    for numa in sorted((root / f"_layer_{layer}").glob("_numa_*")):
        n = int(numa.name.split("_")[-1])
        for f in numa.iterdir():
            mt = KT_FILE.match(f.name)
            if not mt:
                continue
            _, proj, e, size, kind = mt.groups()
            data = f.read_bytes()
            if len(data) != int(size):
                raise EnvironmentProblem(f"{f.name} holds {len(data)} bytes, its name says {size}", path=str(f))
            name = f"blk.{layer}.ffn_{proj}_exps.{e}.numa.{n}.{'weight' if kind == 'quant' else 'scale'}"
            out[name] = np.frombuffer(data, dtype=np.int8 if kind == "quant" else np.float32)
    return out


def kernel_moe(kt_dir: Path, *, layer: int, method: str, parts: int, x: np.ndarray, ids: np.ndarray,
               weights: np.ndarray, E: int, H: int, I: int, workdir: Path, threads: int | None = None) -> np.ndarray:
    """kt-kernel's ``method`` MoE forward on one layer of the kt-amx directory ``kt_dir`` (loaded by pointer, as
    upstream's loader does): ``x`` ``[T, H]`` (bf16 values), ``ids``/``weights`` ``[T, k]``; float32 ``[T, H]``."""
    workdir.mkdir(parents=True, exist_ok=True)
    job = {"job": "moe", "method": method, "E": E, "H": H, "I": I, "P": parts, "layer": layer,
           "top_k": int(ids.shape[1]), "max_len": max(64, int(ids.shape[0])), "threads": threads or parts,
           "dir": str(kt_dir), "out": str(workdir / "y.npy")}
    for k, a in (("x", x), ("ids", ids), ("weights", weights)):
        job[k] = str(workdir / f"{k}.npy")
        np.save(job[k], a)
    run_child(job)
    return np.load(workdir / "y.npy")
