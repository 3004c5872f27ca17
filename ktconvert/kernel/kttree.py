"""kt-kernel's ``.kt`` tree (``_layer_L/_numa_N/{INT8|INT4}_{proj}_{E}_{S}Byte_{quant|scale}_.kt``, raw bytes)
merged into kt-amx safetensors, the second step of upstream's converter. With
:meth:`ktconvert.kernel.runner.KernelSession.quantize_ktamx_layer` it gives kt-amx directories made by the kernel's own
quantizer, which the tests use as the reference for the kt-amx format.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from ktconvert.errors import InputError
from ktconvert.formats.kt_amx import tensor_name
from ktconvert.kernel.runner import KernelSession, f32_to_bf16_bits
from ktconvert.model import load_config
from ktconvert.model.ops.source import WeightSource

_FILE = re.compile(r"^(INT8|INT4)_(gate|up|down)_(\d+)_(\d+)Byte_(quant|scale)_\.kt$")
_DIR = re.compile(r"^_(layer|numa)_(\d+)$")


def read_kt_tree(tree) -> dict[int, dict[str, np.ndarray]]:
    """``{layer: {kt-amx tensor name: array}}`` of every ``.kt`` file under ``tree`` (weight I8, scale F32)."""
    tree = Path(tree)
    layers: dict[int, dict[str, np.ndarray]] = {}
    for f in sorted(tree.glob("_layer_*/_numa_*/*.kt")):
        m = _FILE.match(f.name)
        lm, nm = _DIR.match(f.parent.parent.name), _DIR.match(f.parent.name)
        if m is None or lm is None or nm is None:
            raise InputError("not a kt-kernel .kt file name", path=str(f),
                             fix="expected _layer_L/_numa_N/{INT8|INT4}_{gate|up|down}_E_SByte_{quant|scale}_.kt")
        data = f.read_bytes()
        if len(data) != int(m.group(4)):
            raise InputError(f"{len(data)} bytes, the name says {m.group(4)}", path=str(f),
                             fix="the tree is truncated: write it again")
        kind = "weight" if m.group(5) == "quant" else "scale"
        arr = np.frombuffer(data, dtype=np.int8 if kind == "weight" else np.float32).copy()
        layer = int(lm.group(2))
        layers.setdefault(layer, {})[tensor_name(layer, m.group(2), int(m.group(3)), int(nm.group(2)), kind)] = arr
    if not layers:
        raise InputError("no .kt files under _layer_*/_numa_*", path=str(tree), fix="pass the tree kt-kernel wrote")
    return layers


def merge_kt_tree(tree, out_dir) -> list[Path]:
    """Write one ``model-LLLLL.safetensors`` per layer of ``tree`` into ``out_dir``; return the files."""
    layers = read_kt_tree(tree)  # a bad tree is refused before anything is written
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = []
    for layer, tensors in sorted(layers.items()):
        path = out_dir / f"model-{layer:05d}.safetensors"
        save_file(dict(sorted(tensors.items())), str(path))
        files.append(path)
    return files


def ktamx_by_kernel(model_dir, out_dir, method: str = "AMXINT8", threadpools: int = 2) -> list[Path]:
    """A kt-amx directory of ``model_dir``'s routed experts quantized by kt-kernel's own AMX quantizer (in a
    child process): every MoE layer's experts as bf16, written as a ``.kt`` tree, merged to safetensors. The
    reference the kt-amx writer is compared with, and AMX input for ``verify --kernel``."""


    cfg = load_config(Path(model_dir))
    src = WeightSource(model_dir, cfg)
    with tempfile.TemporaryDirectory(prefix="ktconvert-kt-tree-") as tree, \
            KernelSession(method, threadpools=threadpools, threads=threadpools) as s:
        for layer in sorted(cfg.mlp.moe_layers):
            b = src.expert_blocks(layer)
            bits = {p: f32_to_bf16_bits(np.stack([getattr(b, p).expert(e) for e in range(cfg.num_experts)]))
                    for p in ("gate", "up", "down")}
            s.quantize_ktamx_layer(tree, layer, bits["gate"], bits["up"], bits["down"], cfg.num_experts_per_tok)
        return merge_kt_tree(tree, out_dir)
