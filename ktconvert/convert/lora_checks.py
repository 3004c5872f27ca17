"""What the kt-kernel / sglang-kt 0.7.2 stack never checks about a MoE LoRA adapter, checked before anything is
written (the list is in ``docs/commands/convert-lora.md``): NaN/Inf, a lora_B that is all zero (the
projection has no effect), ranks that disagree, stray keys, PEFT options the kernel does not implement, F32 that
the server rounds to BF16, the manifest's sizes, hashes, rank and alpha, and the base model's geometry.

Each check returns findings (:func:`finding`: one :class:`ktconvert.diagnostics.Diagnostic` each, one line naming the
tensor or field). ``error`` findings refuse the conversion; ``warning`` findings are reported beside the output.
preflight runs the same checks on a launch.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np

from ktconvert.convert.lora_read import FUSED_FILE, MANIFEST_FILE, PROJS, Adapter
from ktconvert.diagnostics import ERROR, WARNING, Diagnostic
from ktconvert.io.atomic import sha256_file
from ktconvert.io.dtypes import FLOAT_DTYPES

#: lora_B times alpha/r below this everywhere in a slot: the projection's output moves by less than bf16 can show.
NO_EFFECT = 1e-6
_LORA_KEY = re.compile(r"\.lora_(A|B|embedding_A|embedding_B)(\.weight)?$")
_UNSUPPORTED = {"use_rslora": "rsLoRA scaling (alpha/sqrt(r))", "use_dora": "DoRA",
                "rank_pattern": "per-module ranks", "alpha_pattern": "per-module alphas"}
_EXPERT_FORMATS = ("bf16", "int8", "fp8", "rawint4", "mxfp4")


def finding(severity: str, where: str, message: str, fix: str) -> Diagnostic:
    """A convert-lora finding: ``where`` is the tensor, the field (adapter_config.json:lora_alpha) or the file."""
    return Diagnostic("", severity, message, fix, where)


def finding_line(f: Diagnostic) -> str:
    """The finding as convert-lora prints it (after ``ktconvert: SEVERITY:``)."""
    return f"{f.where}: {f.message} ({f.fix})"


def finding_dict(f: Diagnostic) -> dict:
    """The finding in convert-lora's ``-o json`` (``findings``)."""
    return {"severity": f.severity, "where": f.where, "message": f.message, "fix": f.fix}


def check_finite(ad: Adapter) -> list[Diagnostic]:
    """A NaN/Inf in any float tensor, at its first element (one slice of the first axis at a time)."""
    out = []
    for t in ad.tensors:
        if t.dtype not in FLOAT_DTYPES:
            continue
        whole = len(t.shape) < 2 or int(np.prod(t.shape)) <= (1 << 22)  # small: one read; large: a slab at a time
        for i in ([None] if whole else range(t.shape[0])):
            x = t.float32(i)
            bad = ~np.isfinite(x)
            if bad.any():
                at = tuple(int(v) for v in np.argwhere(bad)[0])
                index = at if i is None else (i,) + at
                out.append(finding(ERROR, f"tensor {t.name}", f"non-finite value {x[at]} at index {list(index)} "
                                   "(sglang-kt serves it without a check)",
                                   "the adapter comes from a diverged run; retrain it, or pass --allow-nonfinite"))
                break
    return out


def check_effect(ad: Adapter, alpha: float | None) -> list[Diagnostic]:
    """lora_B all zero (or scaled below :data:`NO_EFFECT`) per layer and projection: that projection has no effect."""
    if alpha is not None and alpha == 0:
        return [finding(WARNING, "adapter_config.json:lora_alpha", "lora_alpha is 0: the scaling alpha/r is 0 and "
                        "the adapter has no effect", "set the alpha the adapter was trained with")]
    scale = abs(alpha) / ad.rank if alpha is not None else 1.0
    dead = []
    for L in ad.layers:
        for p in PROJS:
            m = max(float(np.max(np.abs(x.float32()), initial=0.0)) for x in ad.slots[(L, p, "b")])
            if m * scale < NO_EFFECT:
                dead.append((ad.slot_name(L, p, "b"), m))
    if not dead:
        return []
    what = "all zero" if all(m == 0 for _, m in dead) else f"below {NO_EFFECT:g} once scaled by alpha/r"
    if len(dead) == 3 * len(ad.layers):
        return [finding(WARNING, f"tensor {dead[0][0]}", f"lora_B is {what} in every layer and projection: the "
                        "expert LoRA has no effect (a freshly initialised adapter, or training never updated it)",
                        "export the adapter after training steps")]
    return [finding(WARNING, f"tensor {n}", f"lora_B is {'all zero' if m == 0 else what}: this layer's projection "
                    "has no effect", "check that training updated it") for n, m in dead]


def check_ranks(ad: Adapter) -> list[Diagnostic]:
    """Expert rank, non-expert tensor ranks and ``adapter_config.json`` ``r`` agree (sglang-kt fails at load, or
    scales the non-expert part by the wrong alpha/r)."""
    out, r = [], ad.rank
    cr = ad.config.get("r")
    if cr is not None and cr != r:
        out.append(finding(ERROR, "adapter_config.json:r", f"r is {cr} but the expert tensors have rank {r}",
                           "the config belongs to another adapter"))
    for name, t in ad.others:
        m = _LORA_KEY.search(name)
        if m is None or len(t.shape) != 2:
            continue
        tr = t.shape[0] if m.group(1) in ("A", "embedding_A") else t.shape[1]
        if tr != r:
            out.append(finding(ERROR, f"tensor {t.name}", f"non-expert rank {tr}, expert rank {r}: kt-kernel's "
                               "converter refuses it and one r cannot scale both", "retrain with one rank"))
            break
    return out


def check_keys(ad: Adapter) -> list[Diagnostic]:
    """Tensors that are neither fused expert LoRA (in the fused file) nor LoRA A/B (in the PEFT file)."""
    out = [finding(ERROR, f"tensor {t.name}", f"a stray tensor in {FUSED_FILE} (kt-kernel's converter refuses it)",
                   "remove it; non-expert LoRA belongs in adapter_model.safetensors") for t in ad.stray[:1]]
    odd = [t for name, t in ad.others if not _LORA_KEY.search(name)]
    if odd:
        out.append(finding(ERROR, f"tensor {odd[0].name}", f"not a LoRA A/B tensor ({len(odd)} such): "
                           "sglang-kt's LoRA loader does not know it", "remove it from the adapter"))
    return out


def check_options(cfg: dict) -> list[Diagnostic]:
    """PEFT options kt-kernel's SFT kernel does not implement (it scales every expert by alpha/r)."""
    return [finding(ERROR, f"adapter_config.json:{k}", f"{k} is set ({what}); kt-kernel has no {what} and "
                    "would serve the adapter with plain alpha/r", f"retrain without {k}")
            for k, what in _UNSUPPORTED.items() if cfg.get(k)]


def check_dtype(ad: Adapter, target: str) -> list[Diagnostic]:
    if "F32" not in ad.expert_dtypes:
        return []
    if target == "kt":
        return [finding(WARNING, "dtype F32", "kt-kernel trains and resumes BF16 expert LoRA: the F32 expert tensors "
                        "are rounded to BF16 in the output", "nothing to do unless you need F32")]
    return [finding(WARNING, "dtype F32", "F32 expert LoRA: sglang-kt casts expert LoRA to BF16 at load without a "
                    "word, so the served adapter is the BF16-rounded one", "expect BF16 rounding (relative 2^-9)")]


def check_base(ad: Adapter, dims) -> list[Diagnostic]:
    """Every MoE layer present with exactly E experts of the model's H and I; no layer the model has as dense."""
    if dims is None:
        return []
    out = []
    for L in ad.layers:
        H, I = ad.dims(L)
        name = ad.slot_name(L, "gate", "a")
        for what, got, want in (("experts", ad.experts, dims.n_experts), ("hidden size H", H, dims.hidden_size),
                                ("expert intermediate size I", I, dims.moe_intermediate_size)):
            if want is not None and got != want:
                out.append(finding(ERROR, f"tensor {name}", f"layer {L}: {what} is {got} but the base model's "
                                   f"config says {want}", "this adapter was trained for another model"))
                return out
        if dims.n_layers is not None and L >= dims.n_layers:
            out.append(finding(ERROR, f"tensor {name}", f"layer {L} is beyond the base model's {dims.n_layers} "
                               "layers", "this adapter was trained for another model"))
        elif dims.moe_layers is not None and L not in dims.moe_layers:
            out.append(finding(ERROR, f"tensor {name}", f"layer {L} is a dense layer in the base model; it has no "
                               "experts to adapt", "this adapter was trained for another model"))
    if dims.moe_layers is not None:
        lacking = sorted(set(dims.moe_layers) - set(ad.layers))
        if lacking:
            out.append(finding(ERROR, f"layer {lacking[0]}", f"MoE layer(s) {lacking[:5]} have no expert LoRA: "
                               "sglang-kt raises KeyError 'Missing KT expert LoRA tensor' at load",
                               "train or export the adapter for every MoE layer"))
    return out


def check_manifest(ad: Adapter) -> list[Diagnostic]:
    """``kt_adapter_manifest.json``: version 1 ready, every artifact's size and sha256, the fused tensor contract,
    and its rank against the tensors (alpha is compared where alpha is resolved)."""
    man = ad.manifest
    if man is None:
        return []
    w = MANIFEST_FILE
    out = []
    if man.get("version") != 1 or man.get("status") != "ready":
        out.append(finding(ERROR, f"{w}:status", f"version {man.get('version')!r}, status {man.get('status')!r}; "
                           "kt-kernel accepts version 1, status 'ready' only",
                           "the save did not finish: export the adapter again"))
    fmt = man.get("expert_weight_format")
    if fmt is not None and fmt not in _EXPERT_FORMATS:
        out.append(finding(ERROR, f"{w}:expert_weight_format", f"{fmt!r} is none of {', '.join(_EXPERT_FORMATS)}",
                           "fix the manifest"))
    arts = man.get("artifacts")
    if not isinstance(arts, dict) or FUSED_FILE not in arts:
        out.append(finding(ERROR, f"{w}:artifacts", f"artifacts must list {FUSED_FILE}", "export the adapter again"))
        arts = arts if isinstance(arts, dict) else {}
    for name, rec in arts.items():
        p = ad.src / name
        if name != Path(name).name or not isinstance(rec, dict):
            out.append(finding(ERROR, f"{w}:artifacts.{name}", "not a file name with a record", "fix the manifest"))
            continue
        if not p.is_file():
            out.append(finding(ERROR, f"{w}:artifacts.{name}", "listed but missing", "copy the whole directory"))
        elif rec.get("size") != p.stat().st_size:
            out.append(finding(ERROR, f"{w}:artifacts.{name}.size", f"{rec.get('size')} but the file has "
                               f"{p.stat().st_size} bytes", "the file changed after the save: export again"))
        elif rec.get("sha256") != sha256_file(p):
            out.append(finding(ERROR, f"{w}:artifacts.{name}.sha256", "does not match the file",
                               "the file changed after the save: export again (kt-kernel refuses to resume it)"))
    tensors = (arts.get(FUSED_FILE) or {}).get("tensors") if isinstance(arts.get(FUSED_FILE), dict) else None
    if isinstance(tensors, dict):
        have = {t.name: t for t in ad.tensors if t.file.name == FUSED_FILE}
        for key, spec in sorted(tensors.items()):
            t = have.get(key)
            if t is None or not isinstance(spec, dict) or list(t.shape) != spec.get("shape") \
                    or t.dtype != spec.get("dtype"):
                got = "missing" if t is None else f"{t.dtype} {list(t.shape)}"
                out.append(finding(ERROR, f"{w}:artifacts.{FUSED_FILE}.tensors.{key}",
                                   f"records {spec}, the file has {got}", "export the adapter again"))
                break
    rank = (man.get("lora") or {}).get("rank") if isinstance(man.get("lora"), dict) else None
    if rank is not None and rank != ad.rank:
        out.append(finding(ERROR, f"{w}:lora.rank", f"{rank} but the expert tensors have rank {ad.rank}",
                           "the manifest belongs to another adapter"))
    return out


def resolve_alpha(ad: Adapter, flag: float | None) -> tuple[float | None, list[Diagnostic]]:
    """alpha as kt-kernel's converter takes it (adapter_config.json's lora_alpha, else ``--lora-alpha``), else the
    manifest's ``lora.alpha``; every disagreement between the three is an error (the served scaling alpha/r would
    differ from training)."""
    cfg_alpha = ad.config.get("lora_alpha")
    man = ad.manifest or {}
    man_alpha = man.get("lora", {}).get("alpha") if isinstance(man.get("lora"), dict) else None
    out = []
    if cfg_alpha is not None and flag is not None and float(cfg_alpha) != float(flag):
        out.append(finding(ERROR, "adapter_config.json:lora_alpha", f"lora_alpha is {cfg_alpha}, --lora-alpha "
                           f"says {flag:g}: kt-kernel's converter would keep {cfg_alpha} and ignore the flag",
                           "drop --lora-alpha, or fix adapter_config.json"))
    if man_alpha is not None:
        for what, v in (("adapter_config.json lora_alpha", cfg_alpha), ("--lora-alpha", flag)):
            if v is not None and float(v) != float(man_alpha):
                out.append(finding(ERROR, f"{MANIFEST_FILE}:lora.alpha", f"training alpha {man_alpha}, {what} "
                                   f"{v}", "use the alpha the adapter was trained with"))
                break
    alpha = cfg_alpha if cfg_alpha is not None else flag if flag is not None else man_alpha
    if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, (int, float))
                              or not math.isfinite(float(alpha))):
        out.append(finding(ERROR, "adapter_config.json:lora_alpha", f"{alpha!r} is not a finite number",
                           "set the alpha the adapter was trained with"))
    return alpha, out


def check_adapter(ad: Adapter, *, alpha: float | None, dims=None, target: str = "sglang",
                  allow_nonfinite: bool = False) -> list[Diagnostic]:
    """Every check above, errors first."""
    found = check_keys(ad) + check_options(ad.config) + check_ranks(ad) + check_manifest(ad) + check_base(ad, dims)
    if not allow_nonfinite:
        found += check_finite(ad)
    found += check_effect(ad, alpha) + check_dtype(ad, target)
    return sorted(found, key=lambda f: f.severity != ERROR)
