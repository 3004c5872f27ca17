"""Every on-disk form of a MoE LoRA adapter of the kt-kernel / sglang-kt 0.7.2 stack, read into one shape.

Forms (``docs/commands/convert-lora.md``): kt-kernel's raw training directory (``fused_expert_lora.safetensors``
``layers.L.experts.{gate,up,down}_lora_{a,b}`` stacked ``[E, ., .]``, a PEFT ``adapter_model.safetensors`` for the
non-expert part, ``adapter_config.json``, ``kt_adapter_manifest.json``), the fused file alone (also the seed-era
stacked file), a converted sglang adapter directory (merged or expert-only: ``model.layers.L.mlp.experts.E.
{gate,up,down}_proj.lora_{A,B}.weight``) and a PEFT save of per-expert LoRA (the same names under
``base_model.model.``). Whatever the form, :class:`Adapter` gives each expert slot ``(layer, proj, a|b)`` as one
2-D source per expert, so checks and writers never branch on the form again.

Refused here with the reason: the legacy ``lora_experts.E.le_*`` form (nothing serves it) and pickles (never
unpickled). A DeepSeek-V4 MXFP4 adapter (manifest ``expert_weight_format: mxfp4``) is recognised by
:func:`native_format` and left alone: sglang-kt serves that raw directory as is.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ktconvert.errors import InputError
from ktconvert.formats import open_checkpoint
from ktconvert.io.datafile import read_json

PROJS = ("gate", "up", "down")
FUSED_FILE = "fused_expert_lora.safetensors"
PEFT_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
MANIFEST_FILE = "kt_adapter_manifest.json"
STACKED_RE = re.compile(r"^layers\.(\d+)\.experts\.(gate|up|down)_lora_(a|b)$")
PEFT_RE = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(mlp|block_sparse_moe)\.experts\.(\d+)\."
                     r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.lora_(A|B)\.weight$")
_PEFT_PROJ = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}
_EXPERTISH = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?layers\.\d+\.(?:mlp\.|block_sparse_moe\.)?experts\.")
_LEGACY = re.compile(r"\.lora_experts\.\d+\.le_(gate|up|down)\.")


@dataclass
class Tensor:
    """One stored tensor: its name, file, dtype, shape and the checkpoint that reads it."""

    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    ck: object

    def raw(self, index: int | None = None) -> np.ndarray:
        a = self.ck.read(self.name)
        return a if index is None else a[index]

    def float32(self, index: int | None = None) -> np.ndarray:
        return self.ck.read_float32(self.name, index)


@dataclass
class Piece:
    """Expert ``e`` of one slot: ``tensor`` itself (per-expert form) or ``tensor[index]`` (stacked form)."""

    tensor: Tensor
    index: int | None

    @property
    def shape(self) -> tuple[int, ...]:
        return self.tensor.shape[1:] if self.index is not None else self.tensor.shape

    def raw(self) -> np.ndarray:
        return self.tensor.raw(self.index)

    def float32(self) -> np.ndarray:
        return self.tensor.float32(self.index)


@dataclass
class Adapter:
    """An adapter in any form. ``slots[(L, proj, "a"|"b")]`` lists one :class:`Piece` per expert; ``others`` are the
    non-expert tensors as ``(name without base_model.model./.orig_module, tensor)``; ``stray`` the tensors of the
    fused file that are not fused expert LoRA (kt-kernel's converter refuses them)."""

    src: Path
    form: str
    slots: dict[tuple[int, str, str], list[Piece]]
    others: list[tuple[str, Tensor]]
    config: dict
    manifest: dict | None
    tensors: list[Tensor]
    stray: list[Tensor] = field(default_factory=list)

    @property
    def layers(self) -> list[int]:
        return sorted({L for L, _, _ in self.slots})

    @property
    def experts(self) -> int:
        return len(next(iter(self.slots.values()))) if self.slots else 0

    @property
    def rank(self) -> int:
        return self.slots[(self.layers[0], "gate", "a")][0].shape[0]

    def dims(self, layer: int) -> tuple[int, int]:
        """``(H, I)`` of ``layer``."""
        return self.slots[(layer, "gate", "a")][0].shape[1], self.slots[(layer, "gate", "b")][0].shape[0]

    def slot_name(self, L: int, proj: str, ab: str) -> str:
        """The name a finding gives a slot: the stacked tensor, or the first per-expert tensor."""
        return self.slots[(L, proj, ab)][0].tensor.name

    @property
    def expert_dtypes(self) -> set[str]:
        return {p.tensor.dtype for ps in self.slots.values() for p in ps}


def native_format(src: Path) -> dict | None:
    """The manifest of a directory whose experts are served natively (``expert_weight_format: mxfp4``, DeepSeek-V4),
    else None."""
    m = src / MANIFEST_FILE if src.is_dir() else None
    if m is None or not m.is_file():
        return None
    man = read_json(m, MANIFEST_FILE, fix="fix or remove kt_adapter_manifest.json")
    return man if isinstance(man, dict) and man.get("expert_weight_format") == "mxfp4" else None


def _files(src: Path) -> tuple[list[Path], Path]:
    if not src.is_dir():
        return [src], src.parent
    if (src / FUSED_FILE).is_file():  # a raw training dir: kt-kernel reads exactly these two
        files = [src / FUSED_FILE] + sorted(p for p in src.iterdir() if p.name.startswith("adapter_model."))
        return files, src
    files = sorted(src.glob("*.safetensors"))
    if not files:
        open_checkpoint(src)  # raises the reader's message (pickles only, empty directory, ...)
        raise InputError("no .safetensors file in the adapter directory", path=str(src),
                         fix="point at the adapter directory or its .safetensors file")
    return files, src


def read_adapter(src: Path) -> Adapter:
    """The adapter at ``src`` (a file or a directory), its expert slots checked for a consistent geometry."""
    if not src.exists():
        raise InputError("no such file or directory", path=str(src), fix="check the path")
    files, base = _files(src)
    tensors: list[Tensor] = []
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
            tensors.append(Tensor(name, f, info.dtype, tuple(info.shape), ck))
    legacy = next((t for t in tensors if _LEGACY.search(t.name)), None)
    if legacy is not None:
        raise InputError("the legacy lora_experts form (extra experts le_gate/le_up/le_down), which neither sglang-kt "
                         "0.7.2 nor kt-kernel's converter reads", path=str(legacy.file), where=f"tensor {legacy.name}",
                         fix="retrain with kt-kernel 0.7.2's fused expert LoRA")
    cfg = read_json(base / CONFIG_FILE, CONFIG_FILE, fix="fix or remove adapter_config.json") \
        if (base / CONFIG_FILE).is_file() else {}
    if not isinstance(cfg, dict):
        raise InputError("adapter_config.json is not a JSON object", path=str(base / CONFIG_FILE), fix="fix it")
    manifest = None
    if src.is_dir() and (src / MANIFEST_FILE).is_file():
        manifest = read_json(src / MANIFEST_FILE, MANIFEST_FILE, fix="fix or remove kt_adapter_manifest.json")
        if not isinstance(manifest, dict):
            raise InputError("not a JSON object", path=str(src / MANIFEST_FILE), fix="fix or remove it")

    stacked = [t for t in tensors if STACKED_RE.match(t.name)]
    per = [t for t in tensors if PEFT_RE.match(t.name)]
    if stacked and per:
        raise InputError("the adapter holds both stacked (layers.L.experts.*) and per-expert expert tensors",
                         path=str(src), fix="convert one form at a time")
    if not stacked and not per:
        raise InputError("no MoE expert LoRA tensors (neither layers.L.experts.{gate,up,down}_lora_{a,b} nor "
                         "...mlp.experts.E.{gate,up,down}_proj.lora_{A,B}.weight)", path=str(src),
                         fix="point at a MoE LoRA adapter")
    rest = [t for t in tensors if not STACKED_RE.match(t.name) and not PEFT_RE.match(t.name)]
    odd = next((t for t in rest if _EXPERTISH.match(t.name)), None)
    if odd is not None:
        raise InputError("an expert tensor of neither form (stacked layers.L.experts.{gate,up,down}_lora_{a,b} or "
                         "per-expert ...experts.E.{gate,up,down}_proj.lora_{A,B}.weight)", path=str(odd.file),
                         where=f"tensor {odd.name}", fix="rename it or remove it from the adapter")
    stray = [t for t in rest if t.file.name == FUSED_FILE or (stacked and t.file == stacked[0].file)]
    others = _clean_others([t for t in rest if t not in stray])
    if stacked:
        slots = _stacked_slots(stacked, str(src))
        form = "raw-dir" if src.is_dir() else "fused-file"
    else:
        slots = _per_expert_slots(per, str(src))
        prefixed = any(t.name.startswith("base_model.model.") for t in per)
        form = "peft" if prefixed else ("sglang-merged" if others else "sglang-expert-only")
    _check_shapes(slots, str(src))
    return Adapter(src, form, slots, others, cfg, manifest, tensors, stray)


def _stacked_slots(stacked: list[Tensor], where: str) -> dict:
    slots: dict = {}
    for t in stacked:
        L, proj, ab = STACKED_RE.match(t.name).groups()
        if len(t.shape) != 3:
            raise InputError(f"{t.name} is {list(t.shape)}; stacked LoRA tensors are 3-D [E, ., .]",
                             path=str(t.file), where=f"tensor {t.name}", fix="this is not a kt-kernel stacked adapter")
        slots[(int(L), proj, ab)] = [Piece(t, e) for e in range(t.shape[0])]
    return slots


def _per_expert_slots(per: list[Tensor], where: str) -> dict:
    by: dict[tuple[int, str, str], dict[int, Tensor]] = defaultdict(dict)
    for t in per:
        L, _block, e, proj, AB = PEFT_RE.match(t.name).groups()
        slot = by[(int(L), _PEFT_PROJ[proj], AB.lower())]
        if int(e) in slot:
            raise InputError(f"expert {e} appears twice ({slot[int(e)].name})", path=str(t.file),
                             where=f"tensor {t.name}", fix="remove the duplicate")
        if len(t.shape) != 2:
            raise InputError(f"{t.name} is {list(t.shape)}; per-expert LoRA tensors are 2-D", path=str(t.file),
                             where=f"tensor {t.name}", fix="re-export the adapter")
        slot[int(e)] = t
    E = max(e for s in by.values() for e in s) + 1
    slots = {}
    for key, slot in by.items():
        missing = sorted(set(range(E)) - set(slot))
        if missing:
            L, p, ab = key
            raise InputError(f"layer {L} {p} lora_{ab.upper()}: {len(missing)} of {E} experts missing "
                             f"(first: expert {missing[0]})", path=where, where=f"layer {L}",
                             fix="every expert needs its LoRA pair; re-export the adapter")
        slots[key] = [Piece(slot[e], None) for e in range(E)]
    return slots


def _check_shapes(slots: dict, where: str) -> None:
    """Every layer has all six slots, one shape and dtype per slot, and ``[r,H] [I,r] [r,I] [H,r]`` agree."""
    layers = sorted({L for L, _, _ in slots})
    E = rank = None
    for L in layers:
        missing = [f"{p}_lora_{ab}" for p in PROJS for ab in "ab" if (L, p, ab) not in slots]
        if missing:
            raise InputError(f"layer {L} has no {', '.join(missing)}", path=where, where=f"layer {L}",
                             fix="the adapter is incomplete; re-export it")
        shapes = {}
        for p in PROJS:
            for ab in "ab":
                ps = slots[(L, p, ab)]
                if len({(x.shape, x.tensor.dtype) for x in ps}) != 1:
                    t = ps[-1].tensor
                    raise InputError(f"layer {L} {p} lora_{ab.upper()}: experts differ in shape or dtype",
                                     path=str(t.file), where=f"tensor {t.name}",
                                     fix="the fused form needs one shape per projection")
                shapes[f"{p}_{ab}"] = (len(ps), *ps[0].shape)
        e, r, H = shapes["gate_a"]
        I = shapes["gate_b"][1]
        want = {"gate_a": (e, r, H), "up_a": (e, r, H), "gate_b": (e, I, r), "up_b": (e, I, r),
                "down_a": (e, r, I), "down_b": (e, H, r)}
        for k, shape in want.items():
            if shapes[k] != shape:
                p, ab = k.split("_")
                t = slots[(L, p, ab)][0].tensor
                got = list(t.shape) if len(t.shape) == 3 else list(shapes[k])
                need = list(shape) if len(t.shape) == 3 else list(shape[1:])
                raise InputError(f"{t.name} is {got} but the layer's gate_lora_a [E={e}, r={r}, H={H}] and "
                                 f"gate_lora_b [E, I={I}, r] make it {need}", path=str(t.file),
                                 where=f"tensor {t.name}", fix="the adapter's ranks or shapes are inconsistent")
        if rank is not None and (r != rank or e != E):
            raise InputError(f"layer {L} has E={e}, r={r}; earlier layers E={E}, r={rank}", path=where,
                             where=f"layer {L}", fix="one rank and expert count throughout")
        if r <= 0:
            raise InputError(f"layer {L}: rank {r}", path=where, fix="the adapter is empty")
        rank, E = r, e


def _clean_others(others: list[Tensor]) -> list[tuple[str, Tensor]]:
    """Non-expert tensors with PEFT's ``base_model.model.`` prefix and ``.orig_module`` removed."""
    out, seen = [], set()
    for t in others:
        name = t.name.replace("base_model.model.", "").replace(".orig_module", "")
        if name in seen:
            raise InputError(f"two tensors become {name} once the PEFT prefix is removed", path=str(t.file),
                             where=f"tensor {t.name}", fix="remove the duplicate")
        seen.add(name)
        out.append((name, t))
    return out
