"""Tiny MoE LoRA adapters in kt-kernel's raw training form, and kt-kernel's own adapter code run in a child process
(never imported here: ``import kt_kernel`` flushes subnormals process-wide)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

E, R, H, I = 4, 4, 64, 96


def fused(layers=(1, 2), seed=0, r=R, e=E, h=H, i=I, dtype="bf16") -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    dt = torch.bfloat16 if dtype == "bf16" else torch.float32
    t = {}
    for L in layers:
        for p in ("gate", "up"):
            t[f"layers.{L}.experts.{p}_lora_a"] = torch.randn(e, r, h, generator=g).to(dt)
            t[f"layers.{L}.experts.{p}_lora_b"] = torch.randn(e, i, r, generator=g).to(dt)
        t[f"layers.{L}.experts.down_lora_a"] = torch.randn(e, r, i, generator=g).to(dt)
        t[f"layers.{L}.experts.down_lora_b"] = torch.randn(e, h, r, generator=g).to(dt)
    return t


def nonexpert(layers=(0, 1), seed=1, r=R) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    t = {}
    for L in layers:
        t[f"base_model.model.model.layers.{L}.self_attn.q_proj.lora_A.weight"] = torch.randn(r, H, generator=g)
        t[f"base_model.model.model.layers.{L}.self_attn.q_proj.lora_B.weight"] = torch.randn(H, r, generator=g)
    return t


def raw_dir(d: Path, *, experts=None, others=None, config=None) -> Path:
    """A raw kt-kernel training directory as its trainer writes it (fused file by ``save_file``, no metadata)."""
    from safetensors.torch import save_file

    d.mkdir(parents=True, exist_ok=True)
    save_file(experts if experts is not None else fused(), str(d / "fused_expert_lora.safetensors"))
    others = nonexpert() if others is None else others
    save_file(others, str(d / "adapter_model.safetensors"), metadata={"format": "pt"})
    cfg = {"r": R, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0,
           "peft_type": "LORA", "base_model_name_or_path": "tiny/base"} if config is None else config
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    return d


def kt_kernel_dir() -> Path:
    spec = importlib.util.find_spec("kt_kernel")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("kt-kernel 0.7.2 is not installed (pip install --no-deps kt-kernel==0.7.2)")
    return Path(list(spec.submodule_search_locations)[0])


def run_child(code: str, *args: str, timeout: int = 300) -> str:
    """Run ``code`` in a fresh interpreter (``sys.argv[1:]`` = ``args``); its stdout, or the test fails with stderr."""
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout,
                       env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


#: kt-kernel's convert_kt_to_sglang_adapter.py loaded from its file (it needs only torch and safetensors) and run on
#: every job of a JSON list: [{"input", "output", "base", "alpha", "expert"}] -> [null or the error text].
CV_JOBS = r"""
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("cv", sys.argv[1])
cv = importlib.util.module_from_spec(spec); spec.loader.exec_module(cv)
out = []
for j in json.loads(sys.argv[2]):
    try:
        cv.convert_kt_to_sglang_adapter(j["input"], j["output"], base_model_name_or_path=j["base"],
                                        lora_alpha=j.get("alpha"), expert_output_dir=j.get("expert"))
        out.append(None)
    except Exception as exc:
        out.append(f"{type(exc).__name__}: {exc}")
print(json.dumps(out))
"""


def kt_kernel_convert(jobs: list[dict]) -> list:
    cv = kt_kernel_dir() / "sft" / "convert_kt_to_sglang_adapter.py"
    return json.loads(run_child(CV_JOBS, str(cv), json.dumps(jobs)))
