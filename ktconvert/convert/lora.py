"""MoE LoRA adapters between kt-kernel's stacked form and the per-expert PEFT form, as real safetensors.

Stacked (kt-kernel SFT, ``fused_expert_lora.safetensors``): per layer ``layers.L.experts.{gate,up,down}_lora_{a,b}``
with shapes ``gate/up_lora_a [E, r, H]``, ``gate/up_lora_b [E, I, r]``, ``down_lora_a [E, r, I]``,
``down_lora_b [E, H, r]``. PEFT (``adapter_model.safetensors`` + ``adapter_config.json``):
``model.layers.L.mlp.experts.E.{gate,up,down}_proj.lora_{A,B}.weight`` with ``lora_A [r, in]`` and
``lora_B [out, r]`` (Mixtral: ``block_sparse_moe.experts.E.{w1,w3,w2}``; a ``base_model.model.`` prefix is
accepted on input). Expert ``e`` of a stacked tensor is exactly the PEFT tensor of expert ``e``, so conversion
copies bytes (dtype kept) one expert at a time and a round trip is byte-identical. Scaling is never folded.

Inputs are read through :func:`ktconvert.formats.open_checkpoint`, so a pickle is refused whatever its name,
with a message that says what the file is; nothing is ever unpickled. Output is built in a hidden sibling
directory and renamed into place when complete.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ktconvert import families
from ktconvert.errors import InputError, UsageProblem
from ktconvert.formats import ModelDims, dims_from_hf_config, open_checkpoint
from ktconvert.formats.config import load_config
from ktconvert.formats.safetensors_write import write_safetensors
from ktconvert.io.atomic import atomic_dir, guard_output
from ktconvert.io.datafile import read_json
from ktconvert.io.dtypes import DTYPE_BYTES, FLOAT_DTYPES

PROJS = ("gate", "up", "down")
STACKED_FILE = "fused_expert_lora.safetensors"
PEFT_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
_STACKED = re.compile(r"^layers\.(\d+)\.experts\.(gate|up|down)_lora_(a|b)$")
_PEFT = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(mlp|block_sparse_moe)\.experts\.(\d+)\."
                   r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.lora_(A|B)\.weight$")
_PEFT_PROJ = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}
_TARGET_ORDER = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w3", "w2",
                 "embed_tokens", "lm_head")


@dataclass
class LoraResult:
    """What :func:`convert_lora` wrote: the direction, the output directory and files, rank, layers, experts."""

    direction: str
    out: Path
    files: list[str]
    rank: int
    layers: list[int]
    experts: int
    notes: list[str] = field(default_factory=list)


@dataclass
class _Tensor:
    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    ck: object

    def data(self) -> np.ndarray:
        return self.ck.read(self.name)


def _read_dir(src: Path) -> tuple[list[_Tensor], dict, Path]:
    """Every tensor of the adapter (a file, or the *.safetensors of a directory) and its adapter_config.json."""

    if src.is_dir():
        files = sorted(src.glob("*.safetensors"))
        if not files:
            open_checkpoint(src)  # raises the reader's message (pickles only, empty directory, ...)
            raise InputError("no .safetensors file in the adapter directory", path=str(src),
                             fix="point at the adapter directory or its .safetensors file")
        base = src
    else:
        files, base = [src], src.parent
    tensors: list[_Tensor] = []
    seen: dict[str, Path] = {}
    for f in files:
        ck = open_checkpoint(f)
        if ck.container != "safetensors":
            raise InputError(f"this is a {ck.container} file, not a safetensors adapter", path=str(f),
                             fix="convert-lora reads and writes safetensors adapters")
        for name, info in ck.items():
            if name in seen:
                raise InputError(f"tensor also stored in {seen[name].name}", path=str(f), where=f"tensor {name}",
                                 fix="two adapter files hold the same tensor; remove one")
            seen[name] = f
            tensors.append(_Tensor(name, f, info.dtype, tuple(info.shape), ck))
    cfg_path = base / CONFIG_FILE
    cfg: dict = {}
    if cfg_path.is_file():
        cfg = read_json(cfg_path, CONFIG_FILE, fix="fix or remove adapter_config.json")
    return tensors, cfg, base


def _base_dims(base_config):
    if base_config is None:
        return None

    if isinstance(base_config, ModelDims):
        return base_config
    cfg = base_config if isinstance(base_config, dict) else load_config(base_config)
    return dims_from_hf_config(cfg, str(base_config) if not isinstance(base_config, dict) else "base config")


def _check_geometry(layer: int, E: int, r: int, H: int, I: int, dims, where: str) -> None:
    if dims is None:
        return
    for what, got, want in (("experts", E, dims.n_experts), ("hidden size H", H, dims.hidden_size),
                            ("expert intermediate size I", I, dims.moe_intermediate_size)):
        if want is not None and got != want:
            raise InputError(f"layer {layer}: {what} is {got} but the base model's config says {want}",
                             path=where, where=f"layer {layer}", fix="this adapter was trained for another model")
    if dims.n_layers is not None and layer >= dims.n_layers:
        raise InputError(f"layer {layer} is beyond the base model's {dims.n_layers} layers", path=where,
                         where=f"layer {layer}", fix="this adapter was trained for another model")
    if dims.moe_layers is not None and layer not in dims.moe_layers:
        raise InputError(f"layer {layer} is a dense layer in the base model; it has no experts to adapt",
                         path=where, where=f"layer {layer}", fix="this adapter was trained for another model")
    if r <= 0:
        raise InputError(f"layer {layer}: rank {r}", path=where, fix="the adapter is empty")


def convert_lora(src: str | Path, out: str | Path, *, base_config=None, lora_alpha: float | None = None,
                 force: bool = False, allow_nonfinite: bool = False) -> LoraResult:
    """Convert the adapter at ``src`` (direction detected from its tensor names) into the directory ``out``.

    ``base_config``: the base model's ``config.json`` (path or dict); when given, E, H, I and MoE layers are
    checked against it. ``lora_alpha`` is used when the input has no ``adapter_config.json`` saying it. A NaN or
    Inf in any tensor is an error naming it (an adapter from a diverged run), unless ``allow_nonfinite``.
    """
    src, out = Path(src), Path(out)
    if not src.exists():
        raise InputError("no such file or directory", path=str(src), fix="check the path")
    tensors, cfg, base = _read_dir(src)
    dims = _base_dims(base_config)
    stacked = [t for t in tensors if _STACKED.match(t.name)]
    peft_experts = [t for t in tensors if _PEFT.match(t.name)]
    if stacked and peft_experts:
        raise InputError("the adapter holds both stacked (layers.L.experts.*) and per-expert PEFT expert tensors",
                         path=str(src), fix="convert one form at a time")
    if not stacked and not peft_experts:
        raise InputError("no MoE expert LoRA tensors (neither layers.L.experts.{gate,up,down}_lora_{a,b} nor "
                         "...mlp.experts.E.{gate,up,down}_proj.lora_{A,B}.weight)", path=str(src),
                         fix="point at a MoE LoRA adapter")
    others = [t for t in tensors if not _STACKED.match(t.name) and not _PEFT.match(t.name)]
    odd = next((t for t in others if re.match(r"^(?:base_model\.model\.)?(?:model\.)?layers\.\d+\.(?:mlp\.|block_sparse_moe\.)?experts\.", t.name)), None)
    if odd is not None:
        raise InputError("an expert tensor of neither form (stacked layers.L.experts.{gate,up,down}_lora_{a,b} or "
                         "per-expert ...experts.E.{gate,up,down}_proj.lora_{A,B}.weight)", path=str(odd.file),
                         where=f"tensor {odd.name}", fix="rename it or remove it from the adapter")
    if not allow_nonfinite:
        for t in tensors:
            _check_finite(t)
    _check_out(src, out, force)
    if stacked:
        return _to_peft(stacked, others, cfg, dims, out, lora_alpha, str(src), force)
    return _to_stacked(peft_experts, others, cfg, dims, out, lora_alpha, str(src), force)


def _check_finite(t: _Tensor) -> None:
    """A NaN/Inf anywhere in ``t``, reported at its first element (read one slice of the first axis at a time)."""
    if t.dtype not in FLOAT_DTYPES:
        return
    for i in range(t.shape[0] if len(t.shape) > 1 else 1):
        x = t.ck.read_float32(t.name, i if len(t.shape) > 1 else None)
        bad = ~np.isfinite(x)
        if bad.any():
            at = tuple(int(v) for v in np.argwhere(bad)[0])
            index = ((i,) + at) if len(t.shape) > 1 else at
            raise InputError(f"non-finite value {x[at]} at index {list(index)}", path=str(t.file),
                             where=f"tensor {t.name}",
                             fix="the adapter comes from a diverged run; retrain it, or pass --allow-nonfinite "
                                 "to convert it anyway")


def _check_out(src: Path, out: Path, force: bool) -> None:
    guard_output(out, inputs=[src if src.is_dir() else src.parent], force=force)


def _rank_from(cfg: dict, r: int, where: str) -> None:
    if "r" in cfg and cfg["r"] != r:
        raise InputError(f"adapter_config.json says r={cfg['r']} but the expert tensors have rank {r}",
                         path=where, where="r", fix="the config belongs to another adapter")
    pattern = cfg.get("rank_pattern") or {}
    odd = {k: v for k, v in pattern.items() if v != r and re.search(r"experts|gate_proj|up_proj|down_proj|w[123]", k)}
    if odd:
        k = next(iter(odd))
        raise InputError(f"rank_pattern gives {k} rank {odd[k]}, the stacked form needs one rank for every expert",
                         path=where, where="rank_pattern", fix="retrain with one rank for the expert projections")


def _alpha(cfg: dict, lora_alpha, where: str):
    if lora_alpha is not None:
        return lora_alpha
    if "lora_alpha" in cfg:
        return cfg["lora_alpha"]
    raise UsageProblem("no lora_alpha: the adapter has no adapter_config.json saying it", path=where,
                       fix="pass --lora-alpha (the alpha the adapter was trained with)")


def _to_peft(stacked, others, cfg, dims, out: Path, lora_alpha, where: str, force: bool) -> LoraResult:
    layers: dict[int, dict[str, _Tensor]] = defaultdict(dict)
    for t in stacked:
        L, proj, ab = _STACKED.match(t.name).groups()
        layers[int(L)][f"{proj}_{ab}"] = t
    rank = E = None
    for L in sorted(layers):
        got = layers[L]
        missing = [f"{p}_lora_{ab}" for p in PROJS for ab in "ab" if f"{p}_{ab}" not in got]
        if missing:
            raise InputError(f"layer {L} has no {', '.join(missing)}", path=where, where=f"layer {L}",
                             fix="the adapter is incomplete; re-export it")
        for k, t in got.items():
            if len(t.shape) != 3:
                raise InputError(f"{t.name} is {list(t.shape)}; stacked LoRA tensors are 3-D [E, ., .]",
                                 path=str(t.file), where=f"tensor {t.name}", fix="this is not a kt-kernel stacked adapter")
        e, r, H = got["gate_a"].shape
        I = got["gate_b"].shape[1]
        want = {"gate_a": (e, r, H), "up_a": (e, r, H), "gate_b": (e, I, r), "up_b": (e, I, r),
                "down_a": (e, r, I), "down_b": (e, H, r)}
        for k, shape in want.items():
            if got[k].shape != shape:
                t = got[k]
                raise InputError(f"{t.name} is {list(t.shape)} but the layer's gate_lora_a [E={e}, r={r}, H={H}] and "
                                 f"gate_lora_b [E, I={I}, r] make it {list(shape)}", path=str(t.file),
                                 where=f"tensor {t.name}", fix="the adapter's ranks or shapes are inconsistent")
        if rank is not None and (r != rank or e != E):
            raise InputError(f"layer {L} has E={e}, r={r}; earlier layers E={E}, r={rank}", path=where,
                             where=f"layer {L}", fix="the stacked form needs one rank and expert count throughout")
        rank, E = r, e
        _check_geometry(L, e, r, H, I, dims, where)
    _rank_from(cfg, rank, where)
    alpha = _alpha(cfg, lora_alpha, where)
    sp = families.find(dims.model_type) if dims is not None else None  # another model type: the common names
    names = dict(zip(PROJS, sp.expert_proj_names)) if sp else {p: f"{p}_proj" for p in PROJS}
    block = sp.moe_block_name if sp else "mlp"
    items = []
    for L in sorted(layers):
        for p in PROJS:
            for ab, AB in (("a", "A"), ("b", "B")):
                t = layers[L][f"{p}_{ab}"]
                for e in range(E):
                    items.append((f"model.layers.{L}.{block}.experts.{e}.{names[p]}.lora_{AB}.weight", t, e))
    rest = _clean_others(others, {n for n, _, _ in items}, where)
    modules = {names[p] for p in PROJS} | {_module(n) for n, _ in rest}
    new_cfg = {**cfg, "peft_type": cfg.get("peft_type", "LORA"), "r": rank, "lora_alpha": alpha,
               "target_modules": _ordered(modules), "bias": cfg.get("bias", "none"),
               "task_type": cfg.get("task_type", "CAUSAL_LM")}
    new_cfg.setdefault("base_model_name_or_path", None)

    def tensors():
        for name, t, e in items:
            yield name, t.dtype, t.shape[1:], t.shape[1] * t.shape[2] * _itemsize(t.dtype), _slab(t, e)
        for name, t in rest:
            yield name, t.dtype, t.shape, _nbytes(t), _whole(t)

    files = _write(out, force, {PEFT_FILE: tensors}, new_cfg)
    return LoraResult("stacked->peft", out, files, rank, sorted(layers), E)


def _to_stacked(peft, others, cfg, dims, out: Path, lora_alpha, where: str, force: bool) -> LoraResult:
    per: dict[tuple[int, str, str], dict[int, _Tensor]] = defaultdict(dict)
    for t in peft:
        L, _block, e, proj, AB = _PEFT.match(t.name).groups()
        slot = per[(int(L), _PEFT_PROJ[proj], AB.lower())]
        if int(e) in slot:
            raise InputError(f"expert {e} appears twice ({slot[int(e)].name})", path=str(t.file),
                             where=f"tensor {t.name}", fix="remove the duplicate")
        slot[int(e)] = t
    layer_ids = sorted({L for L, _, _ in per})
    E = dims.n_experts if dims is not None and dims.n_experts else max(e for s in per.values() for e in s) + 1
    rank = None
    for L in layer_ids:
        shapes = {}
        for p in PROJS:
            for ab in "ab":
                slot = per.get((L, p, ab), {})
                missing = sorted(set(range(E)) - set(slot))
                if missing:
                    raise InputError(f"layer {L} {p} lora_{ab.upper()}: {len(missing)} of {E} experts missing "
                                     f"(first: expert {missing[0]})", path=where, where=f"layer {L}",
                                     fix="every expert needs its LoRA pair; re-export the adapter")
                extra = sorted(set(slot) - set(range(E)))
                if extra:
                    raise InputError(f"layer {L}: expert {extra[0]} is beyond the {E} experts", path=where,
                                     where=f"tensor {slot[extra[0]].name}", fix="the adapter belongs to another model")
                sh = {t.shape for t in slot.values()}
                dt = {t.dtype for t in slot.values()}
                if len(sh) != 1 or len(dt) != 1 or len(next(iter(sh))) != 2:
                    t = slot[0]
                    raise InputError(f"layer {L} {p} lora_{ab.upper()}: experts differ in shape or dtype "
                                     f"({sorted(map(list, sh))}, {sorted(dt)}) or are not 2-D", path=str(t.file),
                                     where=f"tensor {t.name}", fix="the stacked form needs one shape per projection")
                shapes[f"{p}_{ab}"] = next(iter(sh))
        r, H = shapes["gate_a"]
        I = shapes["gate_b"][0]
        want = {"gate_a": (r, H), "up_a": (r, H), "gate_b": (I, r), "up_b": (I, r), "down_a": (r, I), "down_b": (H, r)}
        for k, shape in want.items():
            if shapes[k] != shape:
                p, ab = k.split("_")
                t = per[(L, p, ab)][0]
                raise InputError(f"{t.name} is {list(shapes[k])}; with rank {r}, H={H}, I={I} it must be {list(shape)}",
                                 path=str(t.file), where=f"tensor {t.name}", fix="the adapter's ranks or shapes are inconsistent")
        if rank is not None and r != rank:
            raise InputError(f"layer {L} has rank {r}, earlier layers {rank}", path=where, where=f"layer {L}",
                             fix="the stacked form needs one rank throughout")
        rank = r
        _check_geometry(L, E, r, H, I, dims, where)
    _rank_from(cfg, rank, where)
    alpha = _alpha(cfg, lora_alpha, where)
    items = []
    for L in layer_ids:
        for p in PROJS:
            for ab in "ab":
                items.append((f"layers.{L}.experts.{p}_lora_{ab}", [per[(L, p, ab)][e] for e in range(E)]))
    rest = _clean_others(others, {n for n, _ in items}, where)
    new_cfg = {**cfg, "peft_type": cfg.get("peft_type", "LORA"), "r": rank, "lora_alpha": alpha}
    if "target_modules" not in new_cfg:
        new_cfg["target_modules"] = _ordered({"gate_proj", "up_proj", "down_proj"} | {_module(n) for n, _ in rest})

    def stacked_tensors():
        for name, ts in items:
            t0 = ts[0]
            yield name, t0.dtype, (E, *t0.shape), E * _nbytes(t0), _experts(ts)

    def other_tensors():
        for name, t in rest:
            yield name, t.dtype, t.shape, _nbytes(t), _whole(t)

    groups = {STACKED_FILE: stacked_tensors}
    if rest:
        groups[PEFT_FILE] = other_tensors
    files = _write(out, force, groups, new_cfg)
    return LoraResult("peft->stacked", out, files, rank, layer_ids, E)


def _module(name: str) -> str:
    parts = name.split(".")
    for i, p in enumerate(parts):
        if p.startswith("lora_") and i:
            return parts[i - 1]
    return parts[-2] if len(parts) > 1 else name


def _ordered(modules: set[str]) -> list[str]:
    return [m for m in _TARGET_ORDER if m in modules] + sorted(m for m in modules if m not in _TARGET_ORDER)


def _clean_others(others: list[_Tensor], taken: set[str], where: str) -> list[tuple[str, _Tensor]]:
    """Non-expert adapter tensors, with PEFT's ``base_model.model.`` prefix and ``.orig_module`` removed."""
    out, seen = [], set(taken)
    for t in others:
        name = t.name.removeprefix("base_model.model.").replace(".orig_module", "")
        if name in seen:
            raise InputError(f"two tensors become {name} once the PEFT prefix is removed", path=str(t.file),
                             where=f"tensor {t.name}", fix="remove the duplicate")
        seen.add(name)
        out.append((name, t))
    return out


def _itemsize(dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise InputError(f"dtype {dtype} cannot be carried over", fix="re-save the adapter in F32, F16 or BF16")
    return DTYPE_BYTES[dtype]


def _nbytes(t: _Tensor) -> int:
    n = _itemsize(t.dtype)
    for d in t.shape:
        n *= d
    return n


def _slab(t: _Tensor, e: int):
    return lambda: iter([np.ascontiguousarray(t.data()[e]).tobytes()])


def _whole(t: _Tensor):
    return lambda: iter([np.ascontiguousarray(t.data()).tobytes()])


def _experts(ts: list[_Tensor]):
    return lambda: (np.ascontiguousarray(t.data()).tobytes() for t in ts)


def _write(out: Path, force: bool, groups: dict, config: dict) -> list[str]:
    with atomic_dir(out, force=force) as tmp:
        for fname, make in groups.items():
            write_safetensors(tmp / fname, make(), {"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        files = sorted(p.name for p in tmp.iterdir())
    return files
