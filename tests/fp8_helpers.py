"""FP8 test pieces: tiny FP8 checkpoints and an independent exact dequantization of them.

The reference reads the checkpoint with the ``safetensors`` package and decodes the codes with torch's own
``float8_e4m3fn`` (never ktconvert's reader or tables), multiplies each element by the scale of its block found by
integer division of its row and column (partial edge blocks included), in float32. transformers' FP8 loader is not
used: it gets partial blocks wrong.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

_FP8: dict[str, Path] = {}


def tiny_fp8(root: Path, family: str) -> Path:
    if family not in _FP8:
        from ktconvert.model.tiny import write_tiny_model

        out = root / f"tiny-fp8-{family}"
        write_tiny_model(family, out, fp8=True)
        _FP8[family] = out
    return _FP8[family]


def block_of(model_dir: Path) -> tuple[int, int]:
    cfg = json.loads((model_dir / "config.json").read_text())
    return tuple(cfg["quantization_config"]["weight_block_size"])


def reference_dequant(model_dir: Path) -> dict[str, np.ndarray]:
    """HF name -> float32: FP8 weights exactly dequantized, other tensors widened; scales dropped."""
    import torch
    from safetensors.torch import load_file

    raw: dict = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        raw.update(load_file(f))
    bn, bk = block_of(model_dir)
    out = {}
    for name, t in raw.items():
        if name.endswith("_scale_inv"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            v = t.to(torch.float32).numpy()
            s = raw[name + "_scale_inv"].to(torch.float32).numpy()
            n, k = v.shape
            grid = s[np.arange(n)[:, None] // bn, np.arange(k)[None, :] // bk]
            out[name] = (v * grid).astype(np.float32)
        else:
            out[name] = t.to(torch.float32).numpy()
    return out


def write_reference_dir(model_dir: Path, out: Path) -> Path:
    """The reference dequantization as an F32 HF checkpoint (config without quantization_config)."""
    from safetensors.numpy import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file(reference_dequant(model_dir), str(out / "model.safetensors"))
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, out / name)
    return out


_NP = {"F8_E4M3": np.uint8, "F8_E8M0": np.uint8, "BF16": np.uint16, "F32": np.float32, "F16": np.float16,
       "U8": np.uint8, "I8": np.int8, "I32": np.int32}


def load_raw(model_dir: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Stored arrays (raw bits for F8/BF16) and dtypes of a single-file checkpoint, parsed here from the header."""
    data = (model_dir / "model.safetensors").read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8: 8 + n])
    header.pop("__metadata__", None)
    tensors, dtypes = {}, {}
    for name, e in header.items():
        a, b = e["data_offsets"]
        tensors[name] = np.frombuffer(data[8 + n + a: 8 + n + b], dtype=_NP[e["dtype"]]).reshape(e["shape"]).copy()
        dtypes[name] = e["dtype"]
    return tensors, dtypes


def reshard_with_mtp(model_dir: Path, out: Path, n_layers: int) -> Path:
    """The checkpoint in two shards with an index: weights in the first, every ``_scale_inv`` in the second (a
    scale in another shard than its weight), plus an MTP layer ``n_layers`` (a copy of the last layer's tensors,
    FP8 included, and DeepSeek's MTP extras) that conversion must skip."""
    from ktconvert.formats.safetensors_write import to_bytes

    tensors, dtypes = load_raw(model_dir)
    last = f"model.layers.{n_layers - 1}."
    mtp = f"model.layers.{n_layers}."
    for name in [k for k in tensors if k.startswith(last)]:
        tensors[mtp + name[len(last):]] = tensors[name]
        dtypes[mtp + name[len(last):]] = dtypes[name]
    h = tensors["model.norm.weight"].shape[0]
    for extra in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
        tensors[mtp + extra], dtypes[mtp + extra] = np.ones(h, np.float32), "F32"
    out.mkdir(parents=True, exist_ok=True)
    first = {k: v for k, v in tensors.items() if not k.endswith("_scale_inv")}
    second = {k: v for k, v in tensors.items() if k.endswith("_scale_inv")}
    names = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    weight_map = {}
    for fname, part in zip(names, (first, second)):
        (out / fname).write_bytes(to_bytes(part, {"format": "pt"}, {k: dtypes[k] for k in part}))
        weight_map.update({k: fname for k in part})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, out / name)
    return out


def rewrite(model_dir: Path, out: Path, edit) -> Path:
    """A copy of a single-file checkpoint with ``edit(tensors, dtypes, config)`` applied (hostile-input tests)."""
    from ktconvert.formats.safetensors_write import to_bytes

    tensors, dtypes = load_raw(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    edit(tensors, dtypes, cfg)
    out.mkdir(parents=True, exist_ok=True)
    (out / "model.safetensors").write_bytes(to_bytes(tensors, {"format": "pt"}, {k: dtypes[k] for k in tensors}))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, out / name)
    return out
