"""``quantize --lora ADAPTER``: the adapter merged into the weights in float32 while streaming, ``W + alpha/r * B @ A``
(the scaling kt-kernel and sglang apply), before any output type is chosen.

The adapter is read and checked by convert-lora's own reader and checks (any form; errors refuse the conversion).
Each adapted weight's plan segments get the adapter's ``(A, B, alpha/r)``; the worker adds ``alpha/r * B[rows] @ A``
to exactly the rows it decodes, so memory stays bounded by a unit. Copied tensors that are adapted are decoded
and re-encoded instead. The plan (and so ``--resume``'s fingerprint) and the manifest record every adapter file's
sha256, r and alpha.

:func:`load_lora` (read, check, resolve alpha, name the adapted weights) and ``formats.lora_delta`` (the delta
itself) are shared: ``golden --lora`` merges through this module's ``quantize --to hf`` path and ``verify --lora``
adds the same deltas to the weights it reads, so there is one merge, not three.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from pathlib import Path

import numpy as np

from ktconvert import families
from ktconvert.convert.lora_checks import ERROR, check_adapter, resolve_alpha
from ktconvert.convert.lora_read import PROJS, read_adapter
from ktconvert.convert.plan import Plan
from ktconvert.errors import InputError, UsageProblem
from ktconvert.formats import open_checkpoint
from ktconvert.formats.lora_delta import EXPERT_WEIGHT
from ktconvert.io.atomic import sha256_file



def _deltas(ad, scale: float, model_type: str | None) -> dict[str, tuple]:
    """``{adapted weight's HF name: lora tuple}`` for every expert and non-expert LoRA pair of the adapter."""
    sp = families.find(model_type) if model_type else None
    names = dict(zip(PROJS, sp.expert_proj_names)) if sp else {p: f"{p}_proj" for p in PROJS}
    block = sp.moe_block_name if sp else "mlp"
    out = {}
    for (L, p, ab), pieces in ad.slots.items():
        if ab != "a":
            continue
        for e, a in enumerate(pieces):
            b = ad.slots[(L, p, "b")][e]
            out[f"model.layers.{L}.{block}.experts.{e}.{names[p]}.weight"] = (
                str(a.tensor.file), a.tensor.name, -1 if a.index is None else a.index,
                str(b.tensor.file), b.tensor.name, -1 if b.index is None else b.index, scale)
    by = {n: t for n, t in ad.others}
    for n, t in ad.others:
        if not n.endswith(".lora_A.weight"):
            if ".lora_embedding_" in n:
                raise InputError("embedding LoRA cannot be merged by quantize --lora", path=str(t.file),
                                 where=f"tensor {t.name}", fix="merge it with PEFT's merge_and_unload")
            continue
        b = by.get(n[: -len(".lora_A.weight")] + ".lora_B.weight")
        if b is None:
            raise InputError("lora_A without its lora_B", path=str(t.file), where=f"tensor {t.name}",
                             fix="the adapter is incomplete")
        out[n[: -len(".lora_A.weight")] + ".weight"] = (str(t.file), t.name, -1, str(b.file), b.name, -1, scale)
    return out


def delta_shapes(ad, deltas: dict) -> dict[str, tuple[int, int]]:
    """``(out, in)`` of each delta: rows of B by columns of A."""
    shape = {t.name: (t.shape[1:] if idx >= 0 else t.shape) for t in ad.tensors for idx in (-1, 0)
             if (idx >= 0) == (len(t.shape) == 3)}
    return {n: (shape[d[4]][0], shape[d[1]][1]) for n, d in deltas.items()}


@dataclasses.dataclass
class LoadedLora:
    """A checked adapter ready to merge: ``deltas`` maps each adapted weight's HF name to its lora tuple
    (see ``formats.lora_delta``); ``record`` is what manifests and reports say about it."""

    adapter: object  # lora_read.Adapter
    alpha: float  # as resolved (the config's int stays int: manifests and --resume fingerprints keep their text)
    scale: float
    deltas: dict[str, tuple]
    warnings: list[str]

    @functools.cached_property
    def record(self) -> dict:
        files = sorted({d[0] for d in self.deltas.values()} | {d[3] for d in self.deltas.values()})
        return {"sha256": adapter_sha256(self.adapter), "form": self.adapter.form, "rank": self.adapter.rank,
                "alpha": self.alpha, "scale": self.scale,
                "files": {Path(f).name: sha256_file(Path(f)) for f in files}}


def adapter_sha256(ad) -> str:
    """sha256 of the adapter's values (float32, canonical order): the same adapter in any form convert-lora reads
    (raw dir, sglang, PEFT) has the same digest, a different one (other values, layers, experts) another."""
    h = hashlib.sha256()
    for key in sorted(ad.slots):
        for e, piece in enumerate(ad.slots[key]):
            h.update(f"{key[0]}.{key[1]}.{key[2]}.{e}:".encode())
            h.update(np.ascontiguousarray(piece.float32(), dtype=np.float32).tobytes())
    for name, t in sorted(ad.others, key=lambda x: x[0]):
        h.update(f"{name}:".encode())
        h.update(np.ascontiguousarray(t.float32(), dtype=np.float32).tobytes())
    return h.hexdigest()


def load_lora(adapter: str | Path, *, lora_alpha: float | None = None, dims=None,
              model_type: str | None = None) -> LoadedLora:
    """Read and check ``adapter`` (any form; convert-lora's reader and checks, errors refuse) and resolve alpha."""
    adapter = Path(adapter)
    ad = read_adapter(adapter)
    alpha, found = resolve_alpha(ad, lora_alpha)
    found += check_adapter(ad, alpha=alpha, dims=dims)
    err = next((f for f in found if f.severity == ERROR), None)
    if err is not None:
        raise InputError(err.message, path=str(adapter), where=err.where, fix=err.fix)
    if alpha is None:
        raise UsageProblem("no lora_alpha: neither adapter_config.json nor kt_adapter_manifest.json says it",
                           path=str(adapter), fix="pass --lora-alpha")
    scale = float(alpha) / ad.rank
    warnings = [f"{f.where}: {f.message}" for f in found]
    return LoadedLora(ad, alpha, scale, _deltas(ad, scale, model_type), warnings)


def attach_lora(plan: Plan, adapter: str | Path, *, lora_alpha: float | None = None, dims=None) -> Plan:
    """``plan`` with the adapter's deltas on the segments of every weight it adapts (or :class:`InputError`)."""
    adapter = Path(adapter)
    lo = load_lora(adapter, lora_alpha=lora_alpha, dims=dims, model_type=plan.model_type)
    ad, alpha, scale = lo.adapter, lo.alpha, lo.scale
    deltas = lo.deltas
    ck = open_checkpoint(plan.source)
    shapes = {n: (int(ad_shape[0]), int(ad_shape[1])) for n, ad_shape in delta_shapes(ad, deltas).items()}
    for name, shape in shapes.items():
        if name in ck and tuple(ck[name].shape) != shape:
            raise InputError(f"B @ A is {list(shape)} but {name} is {list(ck[name].shape)}", path=str(adapter),
                             where=name, fix="this adapter was trained for another model")
    used: set[str] = set()
    tensors = []
    for t in plan.tensors:
        segs = []
        for s in t.segments:
            d = deltas.get(s.source)
            if d is not None:
                if s.op not in ("rows", "permute") or s.scale:
                    raise InputError(f"{s.source} is read through a {s.op}{' FP8' if s.scale else ''} segment, "
                                     "which quantize --lora cannot merge into", path=plan.source,
                                     where=f"tensor {s.source}", fix="merge the adapter from a BF16/F32 per-expert "
                                     "Hugging Face checkpoint")
                s = dataclasses.replace(s, lora=d)
                used.add(s.source)
            segs.append(s)
        if any(s.lora for s in segs):
            t = dataclasses.replace(t, segments=tuple(segs), copy_bytes=False)
        tensors.append(t)
    missing = sorted(set(deltas) - used)
    skipped = [n for n in missing if not EXPERT_WEIGHT.match(n)] if plan.format == "kt-amx" else []
    if skipped:  # a kt-amx directory holds the routed experts only: the rest comes from --model-path
        plan.notes.append(f"the adapter's {len(skipped)} non-expert LoRA weight(s) (first {skipped[0]}) are not in a "
                          "kt-amx output: merge them into the --model-path checkpoint (quantize --to hf --lora)")
        missing = [n for n in missing if n not in skipped]
    if missing:
        raise InputError(f"the adapter adapts {missing[0]} ({len(missing)} weight(s) in all), which this "
                         "conversion does not read", path=str(adapter), where=missing[0],
                         fix="is this the adapter of this model?")
    plan.tensors = tensors
    files = sorted({d[0] for d in deltas.values()} | {d[3] for d in deltas.values()})
    plan.lora = {"path": str(adapter), "form": ad.form, "r": ad.rank, "alpha": alpha, "scale": scale,
                 "adapted": len(deltas) - len(skipped),
                 "files": {Path(f).name: {"bytes": Path(f).stat().st_size, "sha256": sha256_file(Path(f))}
                           for f in files}}
    plan.notes.append(f"LoRA {adapter} merged in float32 (W + {alpha:g}/{ad.rank} * B @ A) into "
                      f"{len(deltas) - len(skipped)} weight(s)")
    if plan.format == "hf":  # --type decides quantized weights only: a merged float weight keeps its stored dtype
        kept = sorted({t.type for t in tensors if any(s.lora for s in t.segments) and t.group == "copied"})
        if kept:
            plan.notes.append(f"merged weights are written in their stored dtype ({', '.join(kept)}), rounded after "
                              "the float32 merge")
    return plan
