"""``quantize --to hf``: the input checkpoint in Hugging Face form, FP8 block-scaled weights dequantized to
BF16/F16/F32: what users run upstream's GPU-only FP8->BF16 cast for, here on a CPU and through the same plan,
streaming executor, resume and manifest as every other output.

Names, shapes and tensor order are the input's own (no llama.cpp renaming, no expert stacking); every FP8 weight
becomes one tensor of ``--type`` (the exact dequantization, rounded once to that type), its ``_scale_inv``
disappears, and every other tensor is copied byte for byte (as released: the upstream cast leaves them alone too).
Layers past ``num_hidden_layers`` (DeepSeek's multi-token-prediction layer) are kept: they are part of the release.
config.json loses its FP8 ``quantization_config``; tokenizer and remote-code files are copied.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from ktconvert import __version__
from ktconvert.convert.plan import (DEFAULT_SAFETENSORS_SHARD, Plan, PlanTensor, _names, _shards, fingerprints,
                                    place_shards)
from ktconvert.convert.recipe import Recipe
from ktconvert.convert.source import Segment
from ktconvert.errors import InputError, UsageProblem
from ktconvert.formats import open_checkpoint
from ktconvert.formats.config import load_config
from ktconvert.formats import quantized
from ktconvert.io.dtypes import DTYPE_BYTES

HF_TYPES = ("BF16", "F16", "F32")
TORCH_DTYPE = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
# small files of a release that belong beside its weights (tokenizers, generation defaults, remote code)
_COPIED = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
           "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json")
_COPY_LIMIT = 64 * 1024**2


def build_hf_plan(src: str | Path, recipe: Recipe, type_name: str | None, *, config: str | Path | dict | None = None,
                  shard_size: int | None = None) -> Plan:
    """The plan of an HF-form output of ``src``; :class:`InputError` / :class:`UsageProblem` before anything runs."""
    if type_name not in HF_TYPES:
        raise UsageProblem(f"--to hf writes {', '.join(HF_TYPES)}, not {type_name or 'a recipe'}",
                           fix="pass --type BF16 (or F16, F32) with --to hf")
    ck = open_checkpoint(src)
    shown = str(src)
    if ck.container != "safetensors":
        raise InputError("--to hf reads a Hugging Face safetensors checkpoint, this is GGUF", path=shown,
                         fix="convert GGUF input with --to gguf or --to safetensors")
    cfg = config if isinstance(config, dict) else load_config(config) if config is not None else ck.config
    if cfg is None:
        raise InputError("no config.json beside the checkpoint: the output needs one", path=shown,
                         fix="pass --config path/to/config.json")
    qmap = quantized.require(ck, cfg, shown)
    tensors, in_bytes = [], {}
    for name, info in ck.items():
        if name in qmap.scales:
            continue
        shape = tuple(info.shape)
        rows = math.prod(shape[:-1]) if shape else 1
        w = qmap.weights.get(name)
        seg = Segment(0, rows, name, scale=w.scale if w else "",
                      block=(tuple(w.block) if hasattr(w, "block") else (1, w.group)) if w else (),
                      fmt=w.fmt if w else "")
        if w is not None:
            t, nbytes = type_name, math.prod(shape) * DTYPE_BYTES[type_name]
            in_bytes[name] = info.nbytes + sum(ck[c].nbytes for c in quantized.companions(w) if c in ck)
        else:
            t, nbytes = info.dtype, info.nbytes
            in_bytes[name] = info.nbytes
        tensors.append(PlanTensor(name=name, shape=shape, type=t, nbytes=nbytes, file=0, offset=0, segments=(seg,),
                                  copy_bytes=w is None, hf_name=name, group="quantized" if w else "copied",
                                  src_dtype=info.dtype, st_dtype=t, st_shape=shape))
    plan = Plan(source=shown, container="safetensors", arch=str(cfg.get("model_type")), model_type=cfg.get("model_type"),
                format="hf", recipe=recipe, tensors=tensors, files=[], sources=fingerprints(ck),
                input_files=[str(f) for f in ck.files])
    plan._in_bytes = in_bytes
    if qmap.weights:
        fmts = ", ".join(f"{f} {v['weights']}" for f, v in sorted(qmap.summary().items()))
        plan.notes.append(f"{len(qmap.weights)} quantized weight(s) ({fmts}) decoded to {type_name}; "
                          f"{len(tensors) - len(qmap.weights)} tensor(s) copied as stored")
    else:
        plan.notes.append(f"no quantized weights: {len(tensors)} tensor(s) copied as stored")
    act = quantized.activation_scale_note(qmap)
    if act:
        plan.notes.append(act)
    _lay_out(plan, shard_size if shard_size is not None else DEFAULT_SAFETENSORS_SHARD)
    model_dir = Path(src) if Path(src).is_dir() else Path(src).parent
    plan.extra["config.json"] = (json.dumps(hf_config(cfg, type_name), indent=2) + "\n").encode()
    for name in _COPIED + tuple(p.name for p in sorted(model_dir.glob("*.py"))):
        p = model_dir / name
        if p.is_file() and p.stat().st_size < _COPY_LIMIT:
            plan.extra[name] = p.read_bytes()
    plan.tokenizer = "copied (tokenizer files)" if "tokenizer.json" in plan.extra else "none"
    return plan


def hf_config(cfg: dict, type_name: str) -> dict:
    """config.json of the output: no FP8 ``quantization_config`` (the weights are no longer quantized; left in,
    transformers would try to re-quantize on load), ``dtype`` the written type."""
    out = json.loads(json.dumps(cfg))
    for c in (out, out.get("text_config")):
        if isinstance(c, dict):
            c.pop("quantization_config", None)
            c.pop("expert_dtype", None)  # DeepSeek-V4: "fp4" says the experts ship packed
    key = "torch_dtype" if "torch_dtype" in out and "dtype" not in out else "dtype"
    out[key] = TORCH_DTYPE[type_name]
    return out


def _lay_out(plan: Plan, shard: int) -> None:
    idx = _shards([t.nbytes for t in plan.tensors], shard)
    count = max(idx) + 1 if idx else 1
    names = _names("model", "safetensors", count)
    meta = {"format": "pt", "ktconvert_version": __version__}
    weight_map = place_shards(plan, [(names[f], [t for t, i in zip(plan.tensors, idx) if i == f], meta)
                                     for f in range(count)])
    if count > 1:
        index = {"metadata": {"total_size": sum(t.nbytes for t in plan.tensors)}, "weight_map": weight_map}
        plan.extra["model.safetensors.index.json"] = (json.dumps(index, indent=2) + "\n").encode()
