"""A deterministic tiny MoE LoRA adapter for each tiny model, in kt-kernel's raw training form: BF16
``fused_expert_lora.safetensors`` for every MoE layer, a PEFT ``adapter_model.safetensors`` (F32, the attention output
projection ``o_proj`` (DeepSeek-V4: ``o_b_proj``) of every layer, under ``base_model.model.``), ``adapter_config.json`` and ``kt_adapter_manifest.json`` (sizes, sha256,
the fused tensor contract). Every other form comes from it through ``ktconvert convert-lora``.

Its lora_B is not zero (an adapter fresh from initialisation has no effect, which convert-lora reports), and the
values are small (``|x| < 0.05``) so the adapted model stays close to the base.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from ktconvert.families.config import normalize_config
from ktconvert.formats.config import dims_from_hf_config
from ktconvert.formats.kt_amx import to_bf16_f32
from ktconvert.formats.safetensors_write import layout_safetensors, save_file_order
from ktconvert.io.atomic import write_dirs
from ktconvert.model import rng
from ktconvert.model.tiny_weights import tensor_specs, tiny_config

RANK = 4
ALPHA = 8.0
SCALE = 0.05
OUTPUT_PROJECTIONS = ("o_proj", "o_b_proj")


def _values(family: str, name: str, shape: tuple[int, ...]) -> np.ndarray:
    v = rng.uniform_pm1(rng.stream_key("tiny-lora", family, name), int(np.prod(shape))) * SCALE
    return v.astype(np.float32).reshape(shape)


def _save_file_bytes(arrays: dict[str, np.ndarray], dtypes: dict[str, str], metadata) -> bytes:
    """The bytes ``safetensors``' ``save_file`` writes for these tensors (dtype-then-name order, its header form):
    what kt-kernel's trainer and PEFT write."""
    specs = save_file_order([(n, dtypes[n], a.shape, a.nbytes) for n, a in arrays.items()])
    header, _, _ = layout_safetensors(specs, metadata)
    return header + b"".join(np.ascontiguousarray(arrays[n]).tobytes() for n, *_ in specs)


def tiny_lora_files(family: str, rank: int = RANK, alpha: float = ALPHA) -> dict[str, bytes]:
    raw = tiny_config(family)
    dims = dims_from_hf_config(raw, "tiny config")
    E, H, I = dims.n_experts, dims.hidden_size, dims.moe_intermediate_size
    fused, bits = {}, {}
    shapes = {"gate_lora_a": (E, rank, H), "gate_lora_b": (E, I, rank), "up_lora_a": (E, rank, H),
              "up_lora_b": (E, I, rank), "down_lora_a": (E, rank, I), "down_lora_b": (E, H, rank)}
    for L in sorted(dims.moe_layers):
        for k, shape in shapes.items():
            name = f"layers.{L}.experts.{k}"
            fused[name] = (to_bf16_f32(_values(family, name, shape)).view(np.uint32) >> np.uint32(16)).astype(np.uint16)
            bits[name] = "BF16"
    peft = {}
    specs = tensor_specs(normalize_config(raw))
    # the attention's output projection: o_proj, or the second half of a grouped one (DeepSeek-V4's o_b_proj)
    target = next(t for t in OUTPUT_PROJECTIONS if any(s.name.endswith(f".self_attn.{t}.weight") for s in specs))
    for spec in specs:
        if spec.name.endswith(f".self_attn.{target}.weight"):
            stem = "base_model.model." + spec.name[: -len(".weight")]
            out_f, in_f = spec.shape
            peft[f"{stem}.lora_A.weight"] = _values(family, f"{stem}.lora_A", (rank, in_f))
            peft[f"{stem}.lora_B.weight"] = _values(family, f"{stem}.lora_B", (out_f, rank))
    base = f"ktconvert/tiny-{family}"
    files = {"fused_expert_lora.safetensors": _save_file_bytes(fused, bits, None),
             "adapter_model.safetensors": _save_file_bytes(peft, {n: "F32" for n in peft}, {"format": "pt"}),
             "adapter_config.json": (json.dumps({"base_model_name_or_path": base, "bias": "none", "lora_alpha": alpha,
                                                 "lora_dropout": 0.0, "peft_type": "LORA", "r": rank,
                                                 "target_modules": [target], "task_type": "CAUSAL_LM"},
                                                indent=2, sort_keys=True) + "\n").encode()}
    arts = {n: {"size": len(b), "sha256": hashlib.sha256(b).hexdigest()} for n, b in sorted(files.items())}
    arts["fused_expert_lora.safetensors"].update(
        tensor_count=len(fused), tensors={n: {"shape": list(a.shape), "dtype": "BF16"} for n, a in sorted(fused.items())})
    manifest = {"version": 1, "status": "ready", "expert_weight_format": "bf16", "base": {"model_name_or_path": base},
                "lora": {"rank": rank, "alpha": float(alpha)}, "artifacts": arts}
    files["kt_adapter_manifest.json"] = (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()
    return files


def write_tiny_lora(family: str, out_dir: str | os.PathLike, *, force: bool = False) -> dict[str, str]:
    """Write the tiny adapter of ``family`` into ``out_dir`` atomically; ``{file: sha256}``."""
    files = tiny_lora_files(family)
    write_dirs([(Path(out_dir), files)], force=force)
    return {name: hashlib.sha256(data).hexdigest() for name, data in sorted(files.items())}
