"""The registry of model families: one YAML spec per family under ``rules/families/``.

Every fact that differs between families (config spellings, module tree, class names, GGUF architecture,
routing maths, tiny-model dims) lives in the spec, so adding a family is adding a file and no module outside
this package branches on a family name. Specs are read once through the one YAML loader (positions + schema
validation), so a malformed spec is one :class:`~ktconvert.errors.InputError` naming the file and line:column.
Torch-free.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

from ktconvert.errors import InputError, UsageProblem
from ktconvert.families.parts import ActivationPart, AttentionPart, ClassesPart, ExpertsPart, GgufPart
from ktconvert.io.datafile import load_data_file
from ktconvert.io.resources import rules_dir

SPEC_DIR = "families"
SCHEMA = "family-spec"


@dataclass(frozen=True)
class FamilySpec:
    """One family's spec file, parsed and validated; accessors name what callers ask."""

    family: str
    data: dict
    shown: str  # how messages name the file, e.g. rules/families/qwen3_moe.yaml

    def section(self, name: str) -> dict:
        """One raw section: for this package only (everyone else reads the typed parts below)."""
        return self.data[name]

    @cached_property
    def attention(self) -> AttentionPart:
        return AttentionPart.of(self.data["attention"])

    @cached_property
    def experts(self) -> ExpertsPart:
        return ExpertsPart.of(self.data["moe"], self.data["classes"])

    @cached_property
    def activation(self) -> ActivationPart | None:
        """The experts' clamped SwiGLU (``moe.activation``); None for plain silu(gate) * up."""
        return ActivationPart.of(self.data["moe"].get("activation"))

    @cached_property
    def classes(self) -> ClassesPart:
        return ClassesPart.of(self.data["classes"])

    @cached_property
    def gguf(self) -> GgufPart:
        return GgufPart.of(self.data["gguf"])

    @property
    def zero_centered_norm(self) -> bool:
        """config.rms_norm: zero_centered (RMSNorm scales by 1 + weight)."""
        return self.data["config"].get("rms_norm", "weight") == "zero_centered"

    @property
    def architectures(self) -> tuple[str, ...]:
        return tuple(self.data["architectures"])

    @property
    def prefix(self) -> str:
        """Class-name prefix of the upstream modeling files (``Qwen3Moe``)."""
        return self.data["classes"]["prefix"]

    @property
    def transformers_type(self) -> str:
        """transformers' ``model_type`` that implements the family (``classes.transformers_type``, default the family
        name): what ``golden`` asks transformers for when config.json's own model_type is not one it knows."""
        return self.data["classes"].get("transformers_type", self.family)

    @property
    def qk_norm(self) -> bool:
        return bool(self.data["attention"]["qk_norm"])

    @property
    def linear_packing(self) -> str:
        """``split`` / ``grouped``: how Gated DeltaNet layers store their input projections (``attention.linear_packing``)."""
        return self.data["attention"].get("linear_packing", "split")

    @property
    def linear_projections(self) -> tuple[str, ...]:
        """A Gated DeltaNet layer's input projections, in the order the modeling files create them."""
        if self.linear_packing == "grouped":
            return ("in_proj_qkvz", "in_proj_ba")
        return ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")

    @property
    def moe_block_name(self) -> str:
        return self.data["moe"]["block"]

    @property
    def dense_block_name(self) -> str:
        """The attribute a dense layer keeps its MLP under (``moe.dense_block``, default the MoE block's)."""
        return self.data["moe"].get("dense_block", self.moe_block_name)

    @property
    def expert_proj_names(self) -> tuple[str, str, str]:
        return tuple(self.data["moe"]["projections"])

    @property
    def shared_expert(self) -> str:
        return self.data["moe"]["shared_expert"]

    @property
    def dense_layers(self) -> str:
        return self.data["config"]["dense_layers"]

    @property
    def expert_width_key(self) -> str:
        return self.data["config"]["expert_width"]

    @property
    def gguf_arch(self) -> str:
        return self.gguf.arch

    @property
    def naming_map(self) -> str:
        return self.gguf.naming

    @property
    def probe(self) -> dict:
        return dict(self.data["probe"])

    @property
    def tiny(self) -> dict:
        return self.data["tiny"]

    @property
    def prefix_aliases(self) -> tuple[tuple[str, str], ...]:
        """``(prefix, means)`` pairs of the published checkpoints' names, longest prefix first."""
        pairs = ((a["prefix"], a["means"]) for a in self.data.get("checkpoint", {}).get("prefix_aliases", ()))
        return tuple(sorted(pairs, key=lambda p: -len(p[0])))

    @property
    def ignore_prefixes(self) -> tuple[str, ...]:
        return tuple(self.data.get("checkpoint", {}).get("ignore_prefixes", ()))

    @property
    def fused_orientation(self) -> str | None:
        """``standard`` / ``transposed``: how the published checkpoints store packed experts (None: not said)."""
        return self.data.get("checkpoint", {}).get("fused_orientation")

    def release(self, fmt: str) -> dict | None:
        """How this family's ``fmt`` release stores its experts (``layout``, ``quantization_config``), when it is not
        the generic per-expert layout."""
        return self.data.get("checkpoint", {}).get("releases", {}).get(fmt)

    @property
    def layer_renames(self) -> tuple[tuple[str, str], ...]:
        """``(published, means)`` pairs inside ``model.layers.L.`` (the spec's ``checkpoint.layer_renames``)."""
        return tuple((r["published"], r["means"]) for r in self.data.get("checkpoint", {}).get("layer_renames", ()))

    def canonical_name(self, name: str) -> str:
        """A published tensor name as the reference model names it (``model.language_model.x`` -> ``model.x``;
        inside a layer, the spec's ``layer_renames``: DeepSeek-V4's ``attn.wq_a.`` -> ``self_attn.q_a_proj.``)."""
        for prefix, means in self.prefix_aliases:
            if name.startswith(prefix):
                name = means + name[len(prefix):]
                break
        return _rename_in_layer(name, self.layer_renames)

    def published_name(self, name: str) -> str:
        """The inverse of :meth:`canonical_name`: the layer renames undone, then the first alias whose meaning
        starts ``name``."""
        name = _rename_in_layer(name, tuple((m, p) for p, m in self.layer_renames))
        for alias in self.data.get("checkpoint", {}).get("prefix_aliases", ()):
            if alias["means"] and name.startswith(alias["means"]):
                return alias["prefix"] + name[len(alias["means"]):]
        return name


def _rename_in_layer(name: str, pairs: tuple[tuple[str, str], ...]) -> str:
    """``model.layers.L.<old>rest`` -> ``model.layers.L.<new>rest`` for the longest matching ``old``."""
    if not pairs or not name.startswith("model.layers."):
        return name
    head, _, rest = name[len("model.layers."):].partition(".")
    best = max((p for p in pairs if rest.startswith(p[0])), key=lambda p: len(p[0]), default=None)
    if best is None:
        return name
    return f"model.layers.{head}.{best[1]}{rest[len(best[0]):]}"


def _load(path: Path, shown: str) -> FamilySpec:
    loaded = load_data_file(path, SCHEMA, "family spec", shown)
    data = loaded.data
    if data["family"] != path.stem:
        line, col = loaded.where(("family",))
        raise InputError(f"family {data['family']!r} does not match the file name", path=shown,
                         where=f"{line}:{col}", fix=f"name the file {data['family']}.yaml or the family {path.stem}")
    return FamilySpec(data["family"], data, shown)


#: More directories of family specs (``os.pathsep``-separated), read after the shipped ones: a new family that
#: reuses existing mechanisms is one spec file there, with no code change (``tests/test_family_as_data.py``).
PATH_VARIABLE = "KTCONVERT_FAMILY_PATH"


def _spec_files() -> list[tuple[Path, str]]:
    shipped = [(p, f"rules/{SPEC_DIR}/{p.name}") for p in sorted((rules_dir() / SPEC_DIR).glob("*.yaml"))]
    extra = []
    for d in filter(None, os.environ.get(PATH_VARIABLE, "").split(os.pathsep)):
        if not Path(d).is_dir():
            raise InputError("not a directory of family specs", path=d, where=PATH_VARIABLE,
                             fix=f"point {PATH_VARIABLE} at directories holding <family>.yaml specs")
        extra += [(p, str(p)) for p in sorted(Path(d).glob("*.yaml"))]
    return shipped + extra


@lru_cache(maxsize=None)
def _registry() -> dict[str, FamilySpec]:
    specs: dict[str, FamilySpec] = {}
    for path, shown in _spec_files():
        s = _load(path, shown)
        if s.family in specs:
            raise InputError(f"family {s.family!r} is already defined by {specs[s.family].shown}", path=shown,
                             where="family", fix="give the new family a name of its own")
        specs[s.family] = s
    return dict(sorted(specs.items(), key=lambda kv: (kv[1].data["order"], kv[0])))


def families() -> tuple[str, ...]:
    """Every family with a spec, in the specs' listing order."""
    return tuple(_registry())


def spec(family: str) -> FamilySpec:
    """The spec of ``family``; an unknown name is a usage problem naming the known ones."""
    reg = _registry()
    if family not in reg:
        raise UsageProblem(f"unknown family {family!r}", fix=f"choose one of {', '.join(reg)}")
    return reg[family]


def find(family: Any) -> FamilySpec | None:
    """The spec of ``family`` or ``None`` (no error: callers with a fallback for other model types)."""
    return _registry().get(family) if isinstance(family, str) else None


def family_of(raw: dict) -> str | None:
    """The family a ``config.json`` dict belongs to: its model_type, else its ``architectures``."""
    reg = _registry()
    mt = raw.get("model_type")
    if mt in reg:
        return mt
    for arch in raw.get("architectures") or ():
        for s in reg.values():
            if arch in s.architectures:
                return s.family
    return None


def family_of_class(type_id: str) -> str | None:
    """The family whose upstream class names start with ``type_id``'s prefix (``DeepseekV3MoE`` -> its family): the
    longest prefix wins (``DeepseekV32Indexer`` is DeepSeek-V3.2's, not DeepSeek-V3's), then the listing order."""
    best = None
    for s in _registry().values():
        if type_id.startswith(s.prefix) and (best is None or len(s.prefix) > len(best.prefix)):
            best = s
    return best.family if best else None


def spec_for_arch(family: str, arch: str) -> FamilySpec:
    """The spec whose GGUF facts describe ``arch``: ``family``'s own, else the first family written as ``arch``
    (what llama.cpp reads depends on the architecture, not on which family the checkpoint came from)."""
    own = spec(family)
    if own.gguf_arch == arch:
        return own
    for s in _registry().values():
        if s.gguf_arch == arch:
            return s
    raise UsageProblem(f"no family is written as llama.cpp architecture {arch!r}",
                       fix=f"choose one of {', '.join(sorted({s.gguf_arch for s in _registry().values()}))}")


def permutes_qk(arch: str) -> bool:
    """llama.cpp's converter for ``arch`` reorders q/k rows into rotary pairs per head (its llama architecture)."""
    return any(s.gguf_arch == arch and s.gguf.permute_qk for s in _registry().values())


def ffn_is_expert_width(arch: str) -> bool:
    """``{arch}.feed_forward_length`` holds the routed experts' width (a family spec of ``arch`` says so)."""
    return any(s.gguf_arch == arch and s.gguf.feed_forward_length == "moe_intermediate_size"
               for s in _registry().values())


def gguf_arch(family: Any) -> str | None:
    s = find(family)
    return s.gguf_arch if s else None
