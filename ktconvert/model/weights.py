"""Load Hugging Face safetensors checkpoints into a reference model, per-expert or fused.

Accepted expert layouts: per-expert (``experts.E.gate_proj.weight`` ..., Mixtral ``w1/w3/w2``, what
transformers 5 saves by default) and fused (``experts.gate_up_proj [E, 2I, H]`` gate rows first,
``experts.down_proj [E, H, I]``, or the transposed ``[E, H, 2I]`` / ``[E, I, H]`` some checkpoints store).
The fused orientation is read from the config's dimensions and refused when they cannot decide it.
Mixtral keys under transformers 5's in-memory ``mlp.`` are renamed to the checkpoint's ``block_sparse_moe.``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

import numpy as np
import torch

from ktconvert.errors import InputError
from ktconvert.families.config import MoeConfig
from ktconvert.formats import open_release
from ktconvert.formats import quantized
from ktconvert.io.dtypes import SAFETENSORS_DTYPES, TORCH_NAMES

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_FUSED = re.compile(r"^(model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.experts)\.(gate_up_proj|down_proj)(_bias)?(?:\.weight)?$")


@dataclass
class LoadReport:
    """What loading did: files read, tensors taken, and keys deliberately skipped (with why)."""

    files: list[str] = field(default_factory=list)
    loaded: int = 0
    skipped: dict[str, str] = field(default_factory=dict)
    fused_layout: dict[str, str] = field(default_factory=dict)


def read_tensors(model_dir: str | os.PathLike, report: LoadReport | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors checkpoint by name, read through :mod:`ktconvert.formats` (which validates the
    headers, shards, index and duplicate names); each a writable torch tensor of the stored dtype, except FP8
    block-scaled and other quantized release weights (:mod:`ktconvert.formats.quantized`): their exact float32
    decoding (their scale tensors are consumed)."""
    release = open_release(model_dir)  # the run's one opened release, or opened here
    ck = release.checkpoint
    if ck.container != "safetensors":
        raise InputError(f"a {ck.container} checkpoint, not Hugging Face safetensors", path=str(model_dir),
                         fix="pass the Hugging Face checkpoint directory")
    qmap = release.qmap  # a quantized release loads as its exact decoding
    out = {}
    for name, arr in ck.read_all().items():
        if name in qmap.scales:
            if report is not None:
                report.skipped[name] = f"{qmap.weights[qmap.scales[name]].fmt} scale, applied to its weight"
        else:
            out[name] = stored_tensor(ck, qmap, name, arr)
    if report is not None:
        report.files.extend(str(f) for f in ck.files)
    return out


def stored_tensor(ck, qmap: quantized.QuantMap, name: str, arr: np.ndarray | None = None,
                  expert: int | None = None) -> torch.Tensor:
    """One stored tensor of a safetensors checkpoint as :func:`read_tensors` hands it out: a quantized release
    weight as its exact float32 decoding (:mod:`ktconvert.formats.quantized`, the decoder ``quantize`` uses), any
    other tensor in its stored dtype. ``arr``: the stored data already read (else it is read here); ``expert``: only
    the slab ``[expert:expert + 1]`` of a stacked ``[E, ...]`` tensor (the rows of one expert, nothing else read)."""
    w = qmap.weights.get(name)
    if w is not None:
        if expert is None:
            return torch.from_numpy(quantized.read_float32(ck, w))
        per = quantized.n_rows(w) // w.shape[0]
        rows = quantized.read_rows(ck, w, expert * per, (expert + 1) * per)
        return torch.from_numpy(rows.reshape(1, *w.shape[1:]))
    if arr is None:
        view = ck.read(name)
        arr = np.array(view if expert is None else view[expert:expert + 1])
    return as_torch(arr, ck[name].dtype, name)


def as_torch(arr: np.ndarray, dtype: str, name: str = "") -> torch.Tensor:
    """A stored array (numpy's raw view of a safetensors dtype) as the torch tensor of that dtype."""
    t = torch.from_numpy(arr)
    if SAFETENSORS_DTYPES[dtype].native:
        return t
    if dtype in TORCH_NAMES:  # numpy holds only the bits: reinterpret them
        return t.view(getattr(torch, TORCH_NAMES[dtype]))
    raise InputError(f"{dtype} tensors cannot be loaded into the reference model", where=name,
                     fix="dequantize the checkpoint first (ktconvert quantize --type F32)")


def to_reference_state(cfg: MoeConfig, tensors: dict[str, torch.Tensor], report: LoadReport | None = None,
                       expert: int | None = None) -> dict[str, torch.Tensor]:
    """Rename and split checkpoint tensors into the reference model's state-dict names.

    ``expert``: the fused expert tensors among ``tensors`` hold only that expert's slab (``[1, ...]``, as
    :func:`stored_tensor` reads it), so only that expert's weights come out (a streaming provider's one-expert read).
    """
    report = report if report is not None else LoadReport()
    block = cfg.moe_block_name
    gate_n, up_n, down_n = cfg.expert_proj_names
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.mlp.moe_intermediate_size
    if expert is not None:
        e = 1
    state: dict[str, torch.Tensor] = {}
    fused: dict[str, dict[str, torch.Tensor]] = {}
    sp = cfg.spec
    for key, value in tensors.items():
        if key.startswith(sp.ignore_prefixes):
            report.skipped[key] = "outside the language model (vision tower or multi-token prediction)"
            continue
        key = sp.canonical_name(key)  # a multimodal wrapper's model.language_model.* -> model.*
        m = _LAYER.match(key)
        if m and int(m.group(1)) >= cfg.num_hidden_layers:
            report.skipped[key] = "layer beyond num_hidden_layers (e.g. a multi-token-prediction layer)"
            continue
        if key.endswith("rotary_emb.inv_freq"):
            report.skipped[key] = "rotary table, recomputed from the config"
            continue
        if m and cfg.ffn_name(int(m.group(1))) != "mlp":  # transformers 5 saves the block as mlp whatever the hub calls it
            key = re.sub(r"^(model\.layers\.\d+)\.mlp\.", rf"\1.{cfg.ffn_name(int(m.group(1)))}.", key)
        fm = _FUSED.match(key)
        if fm:
            prefix = fm.group(1).replace(".mlp.experts", f".{block}.experts")
            fused.setdefault(prefix, {})[fm.group(2) + (fm.group(3) or "")] = value
            continue
        state[key] = value
    # gate/up halves of a fused tensor: concatenated (gate first) or interleaved (gate even, up odd; gpt-oss)
    halves = ((slice(0, None, 2), slice(1, None, 2)) if cfg.spec.experts.interleaved_gate_up
              else (slice(0, i), slice(i, None)))
    for prefix, parts in fused.items():
        if not {"gate_up_proj", "down_proj"} <= set(parts):
            raise InputError(
                f"fused experts need both gate_up_proj and down_proj, found only {sorted(parts)}",
                where=prefix,
            )
        gu, dn = parts["gate_up_proj"], parts["down_proj"]
        orientation = _fused_orientation(prefix, gu, dn, e, h, i)
        report.fused_layout[prefix] = orientation
        if orientation == "transposed":
            gu, dn = gu.transpose(1, 2), dn.transpose(1, 2)
        gub, dnb = parts.get("gate_up_proj_bias"), parts.get("down_proj_bias")
        for x in range(e):
            n = x if expert is None else expert
            state[f"{prefix}.{n}.{gate_n}.weight"] = gu[x, halves[0]]
            state[f"{prefix}.{n}.{up_n}.weight"] = gu[x, halves[1]]
            state[f"{prefix}.{n}.{down_n}.weight"] = dn[x]
            if gub is not None:
                state[f"{prefix}.{n}.{gate_n}.bias"] = gub[x, halves[0]]
                state[f"{prefix}.{n}.{up_n}.bias"] = gub[x, halves[1]]
            if dnb is not None:
                state[f"{prefix}.{n}.{down_n}.bias"] = dnb[x]
    if cfg.tie_word_embeddings and "lm_head.weight" not in state and "model.embed_tokens.weight" in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


def _fused_orientation(prefix: str, gu: torch.Tensor, dn: torch.Tensor, e: int, h: int, i: int) -> str:
    """``standard`` ([E, 2I, H], [E, H, I]) or ``transposed`` ([E, H, 2I], [E, I, H]), decided by the dims.

    Either tensor alone can be ambiguous (``H == 2I`` for gate_up, ``H == I`` for down); together they are not.
    """
    # the pair decides: both orientations would need 2I == H and I == H at once
    std = tuple(gu.shape) == (e, 2 * i, h) and tuple(dn.shape) == (e, h, i)
    tr = tuple(gu.shape) == (e, h, 2 * i) and tuple(dn.shape) == (e, i, h)
    if std:
        return "standard"
    if tr:
        return "transposed"
    raise InputError(
        f"fused expert shapes gate_up_proj {list(gu.shape)} / down_proj {list(dn.shape)} fit neither "
        f"[E, 2I, H]/[E, H, I] nor [E, H, 2I]/[E, I, H] with E={e}, H={h}, I={i}",
        where=prefix,
        fix="check num_experts, hidden_size and moe_intermediate_size in config.json",
    )


def load_weights(model: torch.nn.Module, source: str | os.PathLike | dict[str, torch.Tensor]) -> LoadReport:
    """Load a checkpoint directory (or a name->tensor dict) into ``model`` strictly: every parameter
    must be provided with its exact shape and no unexplained tensor may be left over."""
    report = LoadReport()
    tensors = source if isinstance(source, dict) else read_tensors(source, report)
    where = None if isinstance(source, dict) else str(source)
    state = to_reference_state(model.config, tensors, report)
    expected = model.state_dict()
    check_state({k: tuple(v.shape) for k, v in expected.items()}, state, where, model.config.family)
    with torch.no_grad():
        for key, ref in expected.items():
            ref.copy_(state[key])
    report.loaded = len(expected)
    return report


def check_state(expected: dict[str, tuple[int, ...]], state: dict[str, torch.Tensor], where: str | None,
                family: str) -> None:
    """Strict loading: every expected name present with its exact shape, nothing unexplained left over (the whole
    model for :func:`load_weights`, one part of it for a streaming provider)."""
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    if missing:
        raise InputError(
            f"{len(missing)} tensor(s) missing, first: {', '.join(missing[:3])}",
            path=where,
            fix="is config.json the one that belongs to these weights?",
        )
    if unexpected:
        raise InputError(
            f"{len(unexpected)} tensor(s) the {family} reference does not know, first: {', '.join(unexpected[:3])}",
            path=where,
            fix="quantized (e.g. fp8 with weight_scale_inv) checkpoints must be dequantized first",
        )
    for key, shape in expected.items():
        if tuple(state[key].shape) != tuple(shape):
            raise InputError(
                f"shape {list(state[key].shape)} does not match the config's {list(shape)}",
                path=where,
                where=key,
            )
