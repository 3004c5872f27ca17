"""Upstream's kt-amx converter flow, run in its own process for ``bench_kt_amx.py`` (the baseline, not ktconvert):
``python benchmarks/kt_upstream_flow.py JOB.json`` prints one JSON line. It imports kt-kernel, so it never runs in
ktconvert's process. Written from upstream's converter's steps (convert_cpu_weights.py), not copied from it.
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




if __name__ == "__main__":
    print(json.dumps(upstream(json.loads(Path(sys.argv[1]).read_text()))))
