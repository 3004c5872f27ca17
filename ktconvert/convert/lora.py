"""MoE LoRA adapters between the forms of the kt-kernel / sglang-kt 0.7.2 stack, checked before anything is written.

Any form :mod:`ktconvert.convert.lora_read` reads becomes one of:

* ``sglang`` (the default for a fused input): the merged adapter directory for ``--lora-paths``, or with
  ``expert_only`` the adapter for ``--kt-expert-lora-path``. Same tensors, same tensor order and the same
  ``adapter_config.json`` bytes as kt-kernel's ``convert_kt_to_sglang_adapter.py`` for the same input and flags
  (expert ``e`` of a fused tensor is copied byte for byte; dtypes kept; non-expert keys lose ``base_model.model.``
  and ``.orig_module``; alpha from adapter_config.json, else ``--lora-alpha``, else the manifest; a disagreement is
  refused instead of silently resolved).
* ``kt`` (the default for a per-expert input): a raw training directory kt-kernel accepts: BF16
  ``fused_expert_lora.safetensors`` without metadata, the non-expert part under PEFT's ``base_model.model.``
  prefix, ``adapter_config.json`` and ``kt_adapter_manifest.json`` with every file's size and sha256 and the fused
  tensor contract, as kt-kernel's ``save_kt_adapter_artifacts`` records them.

A DeepSeek-V4 MXFP4 adapter is served by sglang-kt as the raw directory itself: it is recognised, its manifest
checked, and nothing is written. Scaling is never folded into the tensors. Output is built in a hidden sibling
directory and renamed into place when complete.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ktconvert.convert.lora_checks import check_adapter, finding, resolve_alpha
from ktconvert.convert.lora_read import (CONFIG_FILE, FUSED_FILE, MANIFEST_FILE, PEFT_FILE, PROJS, Adapter,
                                         native_format, read_adapter)
from ktconvert.diagnostics import ERROR, WARNING, Diagnostic
from ktconvert.errors import InputError, UsageProblem
from ktconvert.formats import ModelDims, dims_from_hf_config
from ktconvert.formats.config import load_config
from ktconvert.formats.kt_amx import to_bf16_f32
from ktconvert.formats.safetensors_write import save_file_order, write_safetensors
from ktconvert.io.atomic import atomic_dir, claim_output, sha256_file
from ktconvert.io.dtypes import DTYPE_BYTES

STACKED_FILE = FUSED_FILE  # the seed-era name of the same file
#: kt-kernel's converter lists target_modules in this order, then the rest sorted (its config bytes depend on it).
_TARGET_ORDER = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "in_proj_qkv",
                 "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "embed_tokens", "lm_head")
_EXPERT_MODULES = ("gate_proj", "up_proj", "down_proj")
TARGETS = ("sglang", "kt")


class LoraRefused(InputError):
    """The adapter failed a check; ``findings`` holds every finding, the message the first error."""

    def __init__(self, findings: list[Diagnostic], where: str):
        self.findings = findings
        errors = [f for f in findings if f.severity == ERROR]
        first = errors[0]
        more = f" [+{len(errors) - 1} more error(s)]" if len(errors) > 1 else ""
        super().__init__(f"{first.message}{more}", path=where, where=first.where, fix=first.fix)


@dataclass
class LoraResult:
    """What :func:`convert_lora` wrote (``direction`` ``"none"``: nothing, see ``notes``)."""

    direction: str
    out: Path
    files: list[str]
    rank: int
    layers: list[int]
    experts: int
    form: str = ""
    alpha: float | None = None
    findings: list[Diagnostic] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _base_dims(base_config):
    if base_config is None:
        return None
    if isinstance(base_config, ModelDims):
        return base_config
    if isinstance(base_config, dict):
        return dims_from_hf_config(base_config, "base config")
    p = Path(base_config)
    if p.is_dir():
        p = p / "config.json"
    return dims_from_hf_config(load_config(p), str(p))


def convert_lora(src: str | Path, out: str | Path, *, base_config=None, lora_alpha: float | None = None,
                 to: str | None = None, expert_only: bool = False, base_model_name: str | None = None,
                 force: bool = False, allow_nonfinite: bool = False) -> LoraResult:
    """Convert the adapter at ``src`` into the directory ``out``.

    ``to``: ``"sglang"`` or ``"kt"`` (default: sglang for a fused input, kt for a per-expert one); ``expert_only``
    (sglang): only the expert tensors, for ``--kt-expert-lora-path``. ``base_config``: the base model's directory,
    ``config.json`` path or dict: every MoE layer, E, H and I are checked against it. ``lora_alpha``: used when
    adapter_config.json has none. ``base_model_name``: written as ``base_model_name_or_path`` (default: the
    manifest's, the input config's, else the base model path). Every finding of
    :func:`ktconvert.convert.lora_checks.check_adapter` that is an error refuses the conversion before anything is
    written (:class:`LoraRefused`); warnings come back in ``findings``.
    """
    src, out = Path(src), Path(out)
    if to is not None and to not in TARGETS:
        raise UsageProblem(f"--to {to}: unknown target", fix=f"use one of {', '.join(TARGETS)}")
    if src.is_dir() and (man := native_format(src)) is not None:
        return _native(src, out, man)
    ad = read_adapter(src)
    target = to or ("sglang" if ad.form in ("raw-dir", "fused-file") else "kt")
    if expert_only and target != "sglang":
        raise UsageProblem("--expert-only writes the sglang expert-only adapter", fix="drop --to kt or --expert-only")
    dims = _base_dims(base_config)
    alpha, found = resolve_alpha(ad, lora_alpha)
    found += check_adapter(ad, alpha=alpha, dims=dims, target=target, allow_nonfinite=allow_nonfinite)
    if any(f.severity == ERROR for f in found):
        raise LoraRefused(sorted(found, key=lambda f: f.severity != ERROR), str(src))
    if alpha is None:
        raise UsageProblem("no lora_alpha: neither adapter_config.json nor kt_adapter_manifest.json says it",
                           path=str(src), fix="pass --lora-alpha (the alpha the adapter was trained with)")
    name = base_model_name or _base_name(ad, base_config)
    if target == "sglang" and name is None:
        raise UsageProblem("no base model name to write as base_model_name_or_path", path=str(src),
                           fix="pass --base-model-name-or-path NAME (kt-kernel's converter requires it too)")
    # a file input is that file (a sibling OUT is not inside it); the directory holding it is refused as OUT by
    # the guard, since --force would delete the adapter with it
    with claim_output(out, inputs=[src], force=force):
        if target == "sglang":
            if not ad.others and not expert_only:
                found.append(finding(WARNING, "adapter_model.safetensors", "no non-expert tensors: sglang-kt "
                                     "refuses this merged adapter through --lora-paths", "serve it with "
                                     "--expert-only output and --kt-expert-lora-path"))
            files = _write_sglang(ad, out, alpha, name, expert_only, force)
            direction = f"{ad.form}->sglang-{'expert-only' if expert_only else 'merged'}"
        else:
            files = _write_kt(ad, out, alpha, name, force)
            direction = f"{ad.form}->kt"
    return LoraResult(direction, out, files, ad.rank, ad.layers, ad.experts, ad.form, alpha, found)


def _base_name(ad: Adapter, base_config) -> str | None:
    man = ad.manifest or {}
    base = man.get("base") if isinstance(man.get("base"), dict) else {}
    for v in (base.get("model_name_or_path"), ad.config.get("base_model_name_or_path")):
        if isinstance(v, str) and v:
            return v
    if base_config is not None and not isinstance(base_config, (dict, ModelDims)):
        p = Path(base_config)
        return str(p.parent if p.name == "config.json" else p)
    return None


def _native(src: Path, out: Path, man: dict) -> LoraResult:
    """A DeepSeek-V4 MXFP4 adapter: checked and left as is (sglang-kt validates and serves the raw directory)."""
    lora = man.get("lora") if isinstance(man.get("lora"), dict) else {}
    found = []
    if man.get("version") != 1 or man.get("status") != "ready":
        found.append(finding(ERROR, f"{MANIFEST_FILE}:status", f"version {man.get('version')!r}, status "
                             f"{man.get('status')!r}; sglang-kt accepts version 1, ready", "export it again"))
    if lora != {"rank": 8, "alpha": 16.0}:
        found.append(finding(ERROR, f"{MANIFEST_FILE}:lora", f"{lora}; sglang-kt's DeepSeek-V4 adapter path takes "
                             "exactly rank 8, alpha 16.0", "retrain with r=8, lora_alpha=16"))
    arts = man.get("artifacts") if isinstance(man.get("artifacts"), dict) else {}
    want = {CONFIG_FILE, PEFT_FILE, FUSED_FILE}
    if set(arts) != want:
        found.append(finding(ERROR, f"{MANIFEST_FILE}:artifacts", f"lists {sorted(arts)}, sglang-kt wants exactly "
                             f"{sorted(want)}", "export it again"))
    for name, rec in sorted(arts.items()):
        p = src / name
        if not isinstance(rec, dict) or not p.is_file() or rec.get("size") != p.stat().st_size \
                or rec.get("sha256") != sha256_file(p):
            found.append(finding(ERROR, f"{MANIFEST_FILE}:artifacts.{name}", "missing, or its size or sha256 "
                                 "differs from the file", "copy the directory again"))
            break
    if found:
        raise LoraRefused(found, str(src))
    return LoraResult("none", src, [], 8, [], 0, "dsv4-mxfp4", 16.0, [], [
        "DeepSeek-V4 MXFP4 adapter (kt_adapter_manifest.json expert_weight_format mxfp4): sglang-kt serves this raw "
        f"directory as is with --lora-paths NAME={src}; nothing converted, {out} not written"])


# --- writers ----------------------------------------------------------------------------------------------------


def _module(name: str) -> str | None:
    """The module a LoRA key adapts (kt-kernel's converter's inference: embeddings by name, else the part before
    ``.lora_``)."""
    if "lora_embedding_A" in name or "lora_embedding_B" in name:
        if "embed_tokens" in name:
            return "embed_tokens"
        if "lm_head" in name or "unembed_tokens" in name:
            return "lm_head"
    if ".lora_" not in name:
        return None
    return name.split(".lora_", 1)[0].rsplit(".", 1)[-1]


def _ordered(modules: set[str]) -> list[str]:
    return [m for m in _TARGET_ORDER if m in modules] + sorted(m for m in modules if m not in _TARGET_ORDER)


def _nbytes(dtype: str, shape) -> int:
    if dtype not in DTYPE_BYTES:
        raise InputError(f"dtype {dtype} cannot be carried over", fix="re-save the adapter in F32, F16 or BF16")
    return int(np.prod(shape, dtype=np.int64)) * DTYPE_BYTES[dtype]


def _config(ad: Adapter, rank: int, alpha, modules: set[str], name: str | None, with_input_targets: bool) -> dict:
    cfg = dict(ad.config)
    if with_input_targets and isinstance(cfg.get("target_modules"), list):
        modules = modules | {str(m).split(".")[-1] for m in cfg["target_modules"]}
    cfg.update({"peft_type": cfg.get("peft_type", "LORA"), "r": rank, "lora_alpha": alpha,
                "target_modules": _ordered(modules), "bias": cfg.get("bias", "none"),
                "task_type": cfg.get("task_type", "CAUSAL_LM"), "base_model_name_or_path": name})
    return cfg


def _config_bytes(cfg: dict) -> bytes:
    return (json.dumps(cfg, indent=2, sort_keys=True) + "\n").encode("utf-8")


def _write_sglang(ad: Adapter, out: Path, alpha, name: str, expert_only: bool, force: bool) -> list[str]:
    specs = []
    for (L, p, ab), pieces in ad.slots.items():
        for e, x in enumerate(pieces):
            specs.append((f"model.layers.{L}.mlp.experts.{e}.{p}_proj.lora_{ab.upper()}.weight", x.tensor.dtype,
                          x.shape, _nbytes(x.tensor.dtype, x.shape), x))
    modules = set(_EXPERT_MODULES)
    if not expert_only:
        for n, t in ad.others:
            specs.append((n, t.dtype, t.shape, _nbytes(t.dtype, t.shape), t))
            if (m := _module(n)) is not None:
                modules.add(m)
    cfg = _config(ad, ad.rank, alpha, modules, name, not expert_only)
    items = [(n, d, s, nb, _chunks(x)) for n, d, s, nb, x in save_file_order(specs)]
    with atomic_dir(out, force=force) as tmp:
        write_safetensors(tmp / PEFT_FILE, items, {"format": "pt"})
        (tmp / CONFIG_FILE).write_bytes(_config_bytes(cfg))
        return sorted(p.name for p in tmp.iterdir())


def _chunks(x):
    return lambda: iter([np.ascontiguousarray(x.raw()).tobytes()])


def _bf16_chunks(pieces):
    def gen():
        for x in pieces:
            if x.tensor.dtype == "BF16":
                yield np.ascontiguousarray(x.raw()).tobytes()
            else:
                yield (to_bf16_f32(x.float32()).view(np.uint32) >> np.uint32(16)).astype("<u2").tobytes()
    return gen


def _write_kt(ad: Adapter, out: Path, alpha, name: str | None, force: bool) -> list[str]:
    fused = []
    contract = {}
    for (L, p, ab), pieces in ad.slots.items():
        key = f"layers.{L}.experts.{p}_lora_{ab}"
        shape = (len(pieces), *pieces[0].shape)
        fused.append((key, "BF16", shape, _nbytes("BF16", shape), _bf16_chunks(pieces)))
        contract[key] = {"shape": list(shape), "dtype": "BF16"}
    fused = save_file_order(fused)
    rest = [(n if n.startswith("base_model.model.") else f"base_model.model.{n}", t.dtype, t.shape,
             _nbytes(t.dtype, t.shape), t) for n, t in ad.others]
    rest = [(n, d, s, nb, _chunks_t(t)) for n, d, s, nb, t in save_file_order(rest)]
    modules = {m for n, _ in ad.others if (m := _module(n)) is not None}
    if isinstance(ad.config.get("target_modules"), list):  # the PEFT part: the experts are kt-kernel's own
        modules |= {str(m).split(".")[-1] for m in ad.config["target_modules"]} - set(_EXPERT_MODULES)
    cfg = _config(ad, ad.rank, alpha, modules, name, False)
    man_in = ad.manifest or {}
    with atomic_dir(out, force=force) as tmp:
        write_safetensors(tmp / FUSED_FILE, fused, None)
        write_safetensors(tmp / PEFT_FILE, rest, {"format": "pt"})
        (tmp / CONFIG_FILE).write_bytes(_config_bytes(cfg))
        arts = {n: {"size": (tmp / n).stat().st_size, "sha256": sha256_file(tmp / n)}
                for n in (CONFIG_FILE, PEFT_FILE, FUSED_FILE)}
        arts[FUSED_FILE].update({"tensor_count": len(contract), "tensors": dict(sorted(contract.items()))})
        manifest = {"version": 1, "status": "ready", "expert_weight_format": man_in.get("expert_weight_format", "bf16"),
                    "base": {"model_name_or_path": name}, "lora": {"rank": ad.rank, "alpha": float(alpha)},
                    "artifacts": arts}
        for k in ("expert_quantization", "non_expert_cache", "int8_experts", "native_experts"):
            if k in man_in:
                manifest[k] = man_in[k]
        if isinstance(man_in.get("base"), dict) and "fingerprint" in man_in["base"]:
            manifest["base"]["fingerprint"] = man_in["base"]["fingerprint"]
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, ensure_ascii=False, indent=2, sort_keys=True) + "\n",
                                         encoding="utf-8")
        return sorted(p.name for p in tmp.iterdir())


def _chunks_t(t):
    return lambda: iter([np.ascontiguousarray(t.raw()).tobytes()])


__all__ = ["LoraRefused", "LoraResult", "PROJS", "STACKED_FILE", "convert_lora"]
