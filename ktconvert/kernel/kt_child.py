"""Child-process driver of kt-kernel's compiled module (``python -m ktconvert.kernel.kt_child JOB.json``).

Never import this module in ktconvert's own process: it imports ``kt_kernel``, which flushes subnormal floats to
zero process-wide. It drives ``kt_kernel_ext`` directly (upstream's Python wrapper needs CUDA-only pinned memory),
the way upstream's converter and loader configure it, for three jobs:

* ``probe``: import kt-kernel and print its variant (tests use it to decide whether to skip);
* ``pack``: quantize one layer's bf16 experts with the kernel's own packer and save its ``.kt`` tree
  (``_layer_L/_numa_N/{INT8|INT4}_{proj}_{e}_{S}Byte_{quant|scale}_.kt``), as upstream's converter does;
* ``moe``: load a kt-amx directory's layer by pointer and run the MoE forward on given tokens;
* ``upstream``: upstream's whole converter flow on a per-expert bf16 checkpoint (the benchmark's baseline).

The job file is JSON; array inputs and outputs are ``.npy`` files named in it. Prints one JSON line on success.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np


def _pool(ext, parts: int, threads: int):
    cfg = ext.WorkerPoolConfig()
    cfg.subpool_count = parts
    cfg.subpool_numa_map = list(range(parts))
    cfg.subpool_thread_count = [threads // parts + (1 if i < threads % parts else 0) for i in range(parts)]
    return ext.CPUInfer(cfg)


def _moe_class(moe, method: str):
    return {"AMXINT8": moe.AMXInt8_MOE, "AMXINT4": moe.AMXInt4_MOE}[method]


def _config(moe, cpu, job: dict, mask: np.ndarray):
    cfg = moe.MOEConfig(job["E"], job.get("top_k", 2), job["H"], job["I"], mask.ctypes.data)
    cfg.layer_idx = job["layer"]
    cfg.pool = cpu.backend_
    cfg.max_len = job.get("max_len", 64)
    return cfg


def _bf16(path: str) -> np.ndarray:
    """A float32 .npy as bf16 bits (the values must already be bf16-representable)."""
    x = np.ascontiguousarray(np.load(path), dtype=np.float32)
    return np.ascontiguousarray((x.view(np.uint32) >> 16).astype(np.uint16))


def pack(job: dict) -> dict:
    """``job["layers"]``: ``[{layer, gate, up, down}]`` (.npy of bf16-valued float32), all with the same geometry."""
    import kt_kernel  # noqa: F401  (registers kt_kernel_ext)
    import kt_kernel_ext
    from kt_kernel_ext import moe

    cpu = _pool(kt_kernel_ext, job["P"], job.get("threads", job["P"]))
    mask = np.zeros(job["E"], dtype=np.bool_)
    ident = np.arange(job["E"], dtype=np.int64)
    t0 = time.perf_counter()
    for ly in job["layers"]:
        gate, up, down = (_bf16(ly[k]) for k in ("gate", "up", "down"))
        cfg = _config(moe, cpu, {**job, "layer": ly["layer"]}, mask)
        cfg.save, cfg.load = True, False
        cfg.gate_proj, cfg.up_proj, cfg.down_proj = gate.ctypes.data, up.ctypes.data, down.ctypes.data
        cfg.path = job["out"]
        m = _moe_class(moe, job["method"])(cfg)
        cpu.submit(m.load_weights_task(ident.ctypes.data))
        cpu.sync()
        del m, gate, up, down
    return {"seconds": time.perf_counter() - t0}


def _load_layer(job: dict):
    """Per part and expert, the weight and scale arrays of one layer of a kt-amx dir (kept alive by the caller)."""
    from safetensors.numpy import safe_open

    want = {}
    for p in ("gate", "up", "down"):
        for n in range(job["P"]):
            for e in range(job["E"]):
                for kind in ("weight", "scale"):
                    want[f"blk.{job['layer']}.ffn_{p}_exps.{e}.numa.{n}.{kind}"] = (p, n, e, kind)
    arrays: dict = {}
    for f in sorted(Path(job["dir"]).rglob("*.safetensors")):
        with safe_open(str(f), framework="numpy") as fh:
            for name in fh.keys():
                if name in want:
                    arrays[want[name]] = np.ascontiguousarray(fh.get_tensor(name))
    missing = [k for k, v in want.items() if v not in arrays]
    if missing:
        raise SystemExit(f"missing tensor {missing[0]}")
    return arrays


def run_moe(job: dict) -> dict:
    import kt_kernel  # noqa: F401
    import kt_kernel_ext
    from kt_kernel_ext import moe

    arrays = _load_layer(job)
    cpu = _pool(kt_kernel_ext, job["P"], job.get("threads", job["P"]))
    mask = np.zeros(job["E"], dtype=np.bool_)
    cfg = _config(moe, cpu, job, mask)
    cfg.gate_proj = cfg.up_proj = cfg.down_proj = 0
    for p in ("gate", "up", "down"):
        setattr(cfg, f"{p}_projs", [[arrays[(p, n, e, "weight")].ctypes.data for e in range(job["E"])]
                                    for n in range(job["P"])])
        setattr(cfg, f"{p}_scales", [[arrays[(p, n, e, "scale")].ctypes.data for e in range(job["E"])]
                                     for n in range(job["P"])])
    cfg.save, cfg.load = False, False
    m = _moe_class(moe, job["method"])(cfg)
    ident = np.arange(job["E"], dtype=np.int64)
    cpu.submit(m.load_weights_task(ident.ctypes.data))
    cpu.sync()
    x = _bf16(job["x"])  # [T, H]
    ids = np.ascontiguousarray(np.load(job["ids"]), dtype=np.int64)  # [T, k]
    wts = np.ascontiguousarray(np.load(job["weights"]), dtype=np.float32)  # [T, k]
    T, k = ids.shape
    out = np.zeros_like(x)
    bsz = np.array([T], dtype=np.int32)
    cpu.submit(m.forward_task(bsz.ctypes.data, k, ids.ctypes.data, wts.ctypes.data, x.ctypes.data, out.ctypes.data,
                              False))
    cpu.sync()
    y = (out.astype(np.uint32) << 16).view(np.float32)
    np.save(job["out"], y)
    return {"tokens": int(T)}


def upstream(job: dict) -> dict:
    """Upstream's converter path (``convert_cpu_weights.py``, per-expert bf16 input, merged safetensors output),
    reproduced step for step for the benchmark: per MoE layer, every expert loaded with ``safe_open(framework="pt")``
    and ``.to(torch.bfloat16)``, stacked into ``[E, I, H]`` / ``[E, H, I]``, quantized and saved by the kernel into
    a tmpfs scratch ``.kt`` tree, read back and written as one safetensors shard per layer, scratch removed."""
    import os
    import shutil

    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    import kt_kernel  # noqa: F401
    import kt_kernel_ext
    from kt_kernel_ext import moe

    where = {}
    for root, _, files in os.walk(job["src"]):
        for f in files:
            if f.endswith(".safetensors"):
                path = os.path.join(root, f)
                with safe_open(path, framework="pt") as fh:
                    for k in fh.keys():
                        where[k] = path
    cpu = _pool(kt_kernel_ext, job["P"], job.get("threads", job["P"]))
    mask = torch.zeros(job["E"], dtype=torch.bool)
    ident = torch.arange(job["E"], dtype=torch.int64)
    scratch, out = job["scratch"], job["out"]
    os.makedirs(out, exist_ok=True)
    tag = "INT8" if job["method"] == "AMXINT8" else "INT4"
    n = len(job["layers"])
    t0 = time.perf_counter()
    for i, L in enumerate(job["layers"]):
        stacks = {}
        for p in ("gate", "up", "down"):
            mats = []
            for e in range(job["E"]):
                key = f"model.layers.{L}.mlp.experts.{e}.{p}_proj.weight"
                with safe_open(where[key], framework="pt") as fh:
                    mats.append(fh.get_tensor(key).to(torch.bfloat16))
            stacks[p] = torch.stack(mats, dim=0).contiguous()
            del mats
        cfg = moe.MOEConfig(job["E"], job.get("top_k", 8), job["H"], job["I"], mask.data_ptr())
        cfg.layer_idx, cfg.pool, cfg.max_len = L, cpu.backend_, 512
        cfg.save, cfg.load = True, False
        cfg.gate_proj, cfg.up_proj, cfg.down_proj = (stacks[p].data_ptr() for p in ("gate", "up", "down"))
        cfg.path = scratch
        m = _moe_class(moe, job["method"])(cfg)
        cpu.submit(m.load_weights_task(ident.data_ptr()))
        cpu.sync()
        del m, stacks
        tensors = {}
        for part in range(job["P"]):
            folder = os.path.join(scratch, f"_layer_{L}", f"_numa_{part}")
            for f in os.listdir(folder):
                kind_tag, p, e = f.split("_")[0:3]
                if kind_tag != tag:
                    continue
                kind = "weight" if f.endswith("_quant_.kt") else "scale"
                data = np.fromfile(os.path.join(folder, f), dtype=np.int8 if kind == "weight" else np.float32)
                tensors[f"blk.{L}.ffn_{p}_exps.{e}.numa.{part}.{kind}"] = torch.from_numpy(data)
        save_file(tensors, os.path.join(out, f"model-{i + 1:05d}-of-{n:05d}.safetensors"))
        del tensors
        shutil.rmtree(os.path.join(scratch, f"_layer_{L}"))
    return {"seconds": time.perf_counter() - t0}


def main(argv: list[str]) -> int:
    job = json.loads(Path(argv[0]).read_text()) if argv else {"job": "probe"}
    kind = job.get("job", "probe")
    if kind == "probe":
        import kt_kernel

        print(json.dumps({"variant": getattr(kt_kernel, "__cpu_variant__", None),
                          "version": getattr(kt_kernel, "__version__", None)}))
        return 0
    result = {"pack": pack, "moe": run_moe, "upstream": upstream}[kind](job)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
