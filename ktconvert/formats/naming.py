"""llama.cpp <-> Hugging Face tensor names, driven by the YAML maps in ``rules/naming/`` (data, not code).

A template is a dotted name whose components are literals or placeholders (``{L}`` layer, ``{E}`` expert, ``{N}``
NUMA part). Literal components are never all digits, so a concrete name is looked up in O(1) by replacing its
numeric components with ``#`` and indexing the result; this keeps classification fast on checkpoints with 100k+
tensors, where trying a list of regexes per name would not be.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

from ktconvert import families
from ktconvert.errors import InputError
from ktconvert.io import resources
from ktconvert.io.datafile import load_data_file

LAYOUTS = ("hf-split", "hf-fused", "gguf-merged", "gguf-split", "kt-amx")
PROJECTIONS = ("gate", "up", "down", "gate_up")
_SIDE = {"hf-split": "hf", "hf-fused": "hf", "gguf-merged": "gguf", "gguf-split": "gguf", "kt-amx": "kt"}
_NEEDS = {  # placeholders each layout's templates must carry (and no others)
    "hf-split": {"L", "E"},
    "gguf-split": {"L", "E"},
    "kt-amx": {"L", "E", "N"},
    "hf-fused": {"L"},
    "gguf-merged": {"L"},
}


@dataclass(frozen=True)
class TensorEntry:
    """A non-expert tensor of one architecture: its GGUF template and HF template(s), the first canonical."""

    gguf: str
    hf: tuple[str, ...]
    group: str
    model_types: tuple[str, ...] | None = None
    derived: str | None = None  # how the GGUF tensor is computed from the HF one, when it is not a plain rename
    transform: tuple[tuple[str, object], ...] = ()  # llama.cpp's value/shape changes (schema: tensor.transform)


@dataclass(frozen=True, slots=True)  # one per tensor: 10^6 of them in the largest headers
class NameMatch:
    """What a tensor name means.

    ``side`` says whose naming it is in (``"gguf"``, ``"hf"`` or ``"kt"`` for kt-kernel's AMX files). ``gguf_name``
    is the llama.cpp tensor holding this data (for a per-expert name: the merged ``*_exps`` tensor, slice
    ``expert``); ``hf_name`` is the canonical HF tensor holding it (``None`` where no single HF tensor does, e.g. a
    merged GGUF gate whose HF counterpart is one tensor per expert). ``derived`` is set when the counterpart is
    computed, not renamed.
    """

    name: str
    arch: str
    group: str  # a tensor group, or "experts" / "expert_scales"
    side: str
    layer: int | None = None
    expert: int | None = None
    numa: int | None = None
    projection: str | None = None
    layout: str | None = None
    gguf_name: str | None = None
    hf_name: str | None = None
    derived: str | None = None
    via_alias: bool = False
    transform: tuple[tuple[str, object], ...] = ()


@dataclass(frozen=True)
class _Slot:
    template: str
    placeholders: tuple[str, ...]
    side: str
    group: str
    entry: TensorEntry | None = None
    projection: str | None = None
    layout: str | None = None


def _key_of_template(t: str) -> tuple[str, tuple[str, ...]]:
    parts = t.split(".")
    holes = tuple(p[1] for p in parts if p.startswith("{"))
    return ".".join("#" if p.startswith("{") else p for p in parts), holes


def _key_of_name(name: str) -> tuple[str, tuple[int, ...]]:
    parts = name.split(".")
    values = []
    for i, p in enumerate(parts):  # one pass: this runs once per tensor of checkpoints with 10^6 of them
        if p.isdigit() and p.isascii():
            values.append(int(p))
            parts[i] = "#"
    return ".".join(parts), tuple(values)


#: A name's lookup key and the numbers it holds (``model.layers.#.mlp.gate.weight``, ``(3,)``).
key_of_name = _key_of_name


def _plain(prefix: str) -> bool:
    """A prefix of whole literal components (empty, or ending in a dot, no all-digit part)."""
    return prefix == "" or (prefix.endswith(".") and not any(p.isdigit() for p in prefix[:-1].split(".")))


def _render(template: str, **values) -> str:
    if "{" not in template:  # a model-wide name: nothing to fill
        return template
    return template.format(**{k: v for k, v in values.items() if v is not None})


class NamingMap:
    """The naming map of one llama.cpp architecture; see ``schemas/naming-map.schema.json``."""

    def __init__(self, data: dict, source: str):
        self.source = source
        self.arch: str = data["arch"]
        self.description: str = data.get("description", "")
        self.hf_model_types: tuple[str, ...] = tuple(data["hf_model_types"])
        self.aliases: tuple[tuple[str, str], ...] = tuple(
            (a["prefix"], a["means"]) for a in data.get("hf_prefix_aliases", [])
        )
        self.tensors: tuple[TensorEntry, ...] = tuple(
            TensorEntry(
                gguf=t["gguf"],
                hf=_as_tuple(t["hf"]),
                group=t["group"],
                model_types=tuple(t["model_types"]) if "model_types" in t else None,
                derived=t.get("derived"),
                transform=tuple(sorted((k, tuple(v) if isinstance(v, list) else v)  # lists (unsqueeze) hashable
                                       for k, v in (t.get("transform") or {}).items())),
            )
            for t in data["tensors"]
        )
        self.experts: dict[str, dict[str, tuple[str, ...]]] = _forms(data["experts"])
        self.expert_scales: dict[str, dict[str, tuple[str, ...]]] = _forms(data.get("expert_scales", {}))
        self.expert_biases: dict[str, dict[str, tuple[str, ...]]] = _forms(data.get("expert_biases", {}))
        self.guess_requires: frozenset[str] = frozenset(_key_of_template(t)[0] for t in data.get("guess_requires", ()))
        self.unquantized: str | None = data.get("unquantized")  # llama-quantize's per-architecture keep list
        self._index: dict[str, list[_Slot]] = {}
        self._plain_aliases = frozenset((p, m) for p, m in self.aliases if _plain(p) and _plain(m))
        self._build_index()

    def __repr__(self) -> str:
        return f"NamingMap({self.arch!r}, {len(self.tensors)} tensors)"

    # --- index ----------------------------------------------------------------------------------------------------
    def _add(self, slot: _Slot) -> None:
        key, holes = _key_of_template(slot.template)
        if len(set(holes)) != len(holes):
            self._bad(f"template {slot.template!r} repeats a placeholder")
        if slot.entry is not None and set(holes) - {"L"}:
            self._bad(f"template {slot.template!r}: non-expert tensors may only use {{L}}")
        if slot.layout is not None and set(holes) != _NEEDS[slot.layout]:
            want = ", ".join(f"{{{h}}}" for h in sorted(_NEEDS[slot.layout]))
            self._bad(f"template {slot.template!r}: layout {slot.layout} needs exactly {want}")
        existing = self._index.setdefault(key, [])
        for other in existing:
            both_same_hf = other.entry is not None and slot.entry is not None and other.side == slot.side == "hf"
            if not (both_same_hf and (other.entry.derived or slot.entry.derived)):
                self._bad(f"templates {other.template!r} and {slot.template!r} cannot be told apart")
        existing.append(slot)
        existing.sort(key=lambda s: s.entry is not None and s.entry.derived is not None)  # plain renames first

    def _build_index(self) -> None:
        for e in self.tensors:
            self._add(_Slot(e.gguf, _key_of_template(e.gguf)[1], "gguf", e.group, entry=e))
            for h in e.hf:
                self._add(_Slot(h, _key_of_template(h)[1], "hf", e.group, entry=e))
        for group, table in (("experts", self.experts), ("expert_scales", self.expert_scales),
                             ("expert_biases", self.expert_biases)):
            for proj, forms in table.items():
                for layout, templates in forms.items():
                    for t in templates:
                        self._add(
                            _Slot(t, _key_of_template(t)[1], _SIDE[layout], group, projection=proj, layout=layout)
                        )
        if "down" not in self.experts or not ({"gate", "up"} <= set(self.experts) or "gate_up" in self.experts):
            self._bad("experts must name down and either gate and up or gate_up")

    def _bad(self, msg: str):
        raise InputError(msg, path=self.source, fix="fix the naming map")

    # --- lookups --------------------------------------------------------------------------------------------------
    def lookup(self, name: str, key: tuple[str, tuple[int, ...]] | None = None) -> NameMatch | None:
        """What ``name`` is under this map (trying ``hf_prefix_aliases`` if it matches no template), or ``None``.
        ``key``: the name's :func:`key_of_name`, when the caller tries several maps (computed once, not per map)."""
        key = key or _key_of_name(name)
        m = self._lookup_direct(name, key)
        if m is not None:
            return m
        for prefix, means in self.aliases:
            if name.startswith(prefix):
                # a prefix and its meaning made of whole literal components: the aliased key is the name's key
                # with the prefix replaced (no second pass over the name)
                akey = (means + key[0][len(prefix):], key[1]) if (prefix, means) in self._plain_aliases else None
                m = self._lookup_direct(means + name[len(prefix) :], akey)
                if m is not None and m.side == "hf":
                    return replace(m, name=name, via_alias=True)
        return None

    def hf_siblings(self, m: NameMatch) -> list[NameMatch]:
        """Every non-expert match of HF tensor ``m.name`` (one HF tensor that llama.cpp splits into several)."""
        key, values = _key_of_name(m.hf_name or m.name)
        out = []
        for slot in self._index.get(key, []):
            if slot.entry is None or slot.side != "hf":
                continue
            e, L = slot.entry, dict(zip(slot.placeholders, values)).get("L")
            out.append(NameMatch(name=m.name, arch=self.arch, group=e.group, side="hf", layer=L,
                                 gguf_name=_render(e.gguf, L=L), hf_name=_render(e.hf[0], L=L), derived=e.derived,
                                 via_alias=m.via_alias, transform=e.transform))
        return out

    def _lookup_direct(self, name: str, key: tuple[str, tuple[int, ...]] | None = None) -> NameMatch | None:
        key, values = key or _key_of_name(name)
        slots = self._index.get(key)
        if not slots:
            return None
        slot = slots[0]
        v = dict(zip(slot.placeholders, values))
        L, E, N = v.get("L"), v.get("E"), v.get("N")
        if slot.entry is not None:
            e = slot.entry
            return NameMatch(
                name=name,
                arch=self.arch,
                group=e.group,
                side=slot.side,
                layer=L,
                gguf_name=_render(e.gguf, L=L),
                hf_name=_render(e.hf[0], L=L),
                derived=e.derived,
                transform=e.transform,
            )
        weights = (self.expert_biases if slot.group == "expert_biases" else self.experts).get(slot.projection, {})
        gguf_t = weights.get("gguf-merged") if slot.group in ("experts", "expert_biases") or slot.layout == "kt-amx" else None
        if slot.layout == "kt-amx":  # weight and scale blobs both derive from the expert's HF weight
            hf_t = weights.get("hf-split")
        elif slot.group == "expert_scales":  # an FP8 scale is its own HF tensor
            hf_t = (slot.template,)
        else:
            hf_t = weights.get("hf-split" if slot.layout in ("hf-split", "gguf-split") else "hf-fused")
        return NameMatch(
            name=name,
            arch=self.arch,
            group=slot.group,
            side=slot.side,
            layer=L,
            expert=E,
            numa=N,
            projection=slot.projection,
            layout=slot.layout,
            gguf_name=_render(gguf_t[0], L=L) if gguf_t else None,
            hf_name=_render(hf_t[0], L=L, E=E) if hf_t else None,
            derived="kt-kernel AMX tile-packed quantization of the expert" if slot.layout == "kt-amx" else None,
        )

    def to_gguf(self, name: str) -> str | None:
        """The llama.cpp name of the tensor holding ``name``'s data (for a per-expert HF name: the merged tensor)."""
        m = self.lookup(name)
        return m.gguf_name if m else None

    def to_hf(self, name: str) -> str | None:
        """The canonical HF name of the tensor holding ``name``'s data, or ``None`` when no single HF tensor does."""
        m = self.lookup(name)
        return m.hf_name if m else None

    def expert_name(
        self, layout: str, projection: str, layer: int, expert: int | None = None, numa: int | None = None,
        scale: bool = False, bias: bool = False,
    ) -> str | None:
        """Render the canonical name of an expert tensor (its scale, its bias) in ``layout``; ``None`` if the map
        has no such form."""
        table = self.expert_scales if scale else self.expert_biases if bias else self.experts
        templates = table.get(projection, {}).get(layout)
        if not templates:
            return None
        missing = _NEEDS[layout] - {k for k, v in (("L", layer), ("E", expert), ("N", numa)) if v is not None}
        if missing:
            raise ValueError(f"layout {layout} needs {', '.join(sorted(missing))}")
        return _render(templates[0], L=layer, E=expert, N=numa)

    def tensor_entries(self, model_type: str | None = None) -> tuple[TensorEntry, ...]:
        """Non-expert entries, restricted to those a given HF ``model_type`` has when one is given."""
        return tuple(e for e in self.tensors if model_type is None or e.model_types is None or model_type in e.model_types)


def _as_tuple(v) -> tuple[str, ...]:
    return (v,) if isinstance(v, str) else tuple(v)


def _forms(data: dict) -> dict[str, dict[str, tuple[str, ...]]]:
    return {proj: {layout: _as_tuple(t) for layout, t in forms.items()} for proj, forms in data.items()}


def load_naming_map(path: str | Path) -> NamingMap:
    """Load one naming map YAML file, validated against ``naming-map.schema.json`` and for template collisions."""

    return NamingMap(load_data_file(path, "naming-map", "naming map").data, str(path))


@lru_cache(maxsize=None)
def naming_maps() -> dict[str, NamingMap]:
    """All shipped naming maps, keyed by llama.cpp architecture name."""
    maps = {}
    for f in sorted((resources.rules_dir() / "naming").glob("*.yaml")):
        m = load_naming_map(f)
        maps[m.arch] = m
    return maps


def naming_map(arch_or_model_type: str) -> NamingMap:
    """The map for a llama.cpp architecture (``"deepseek2"``) or HF model type (``"deepseek_v3"``)."""
    maps = naming_maps()
    if arch_or_model_type in maps:
        return maps[arch_or_model_type]
    for m in maps.values():
        if arch_or_model_type in m.hf_model_types:
            return m
    arch = families.gguf_arch(arch_or_model_type)  # a family whose spec names the architecture it is written as
    if arch in maps:
        return maps[arch]
    known = sorted(set(maps) | {t for m in maps.values() for t in m.hf_model_types})
    raise InputError(
        f"no naming map for {arch_or_model_type!r} (known: {', '.join(known)})",
        fix="add rules/naming/<arch>.yaml for this architecture",
    )


def to_gguf_name(name: str, arch: str) -> str | None:
    return naming_map(arch).to_gguf(name)


def to_hf_name(name: str, arch: str) -> str | None:
    return naming_map(arch).to_hf(name)


def guess_arch(names) -> str | None:
    """The architecture whose map recognises the most of ``names``, or ``None`` when that is not a single one.

    Maps that recognise equally many names are told apart by how much of each map the names use (the share of its
    non-expert entries seen): a Qwen3-MoE checkpoint's names are all GLM-4.5 names too, but leave GLM's biases,
    shared experts and score bias unused. A tie on both is still refused."""
    maps = naming_maps()
    # a name matches a map exactly when its key (numbers replaced by #) is in the map's index: classify one name
    # per distinct key and weigh it by the key's count (a 10^6-tensor header has a few hundred distinct keys)
    counts: dict[str, int] = {}
    first: dict[str, str] = {}
    for n in names:
        k = _key_of_name(n)[0]
        if k not in counts:
            counts[k], first[k] = 0, n
        counts[k] += 1
    keys = set(counts)
    hits = {arch: {k: m._lookup_direct(first[k]) for k in keys if k in m._index} for arch, m in maps.items()
            if not m.guess_requires or m.guess_requires & keys}
    scores = {arch: sum(counts[k] for k in hs) for arch, hs in hits.items()}
    best = max(scores.values(), default=0)
    winners = [a for a, s in scores.items() if s == best]
    if not best:
        return None
    if len(winners) > 1:
        def used(arch: str) -> float:
            seen = {h.gguf_name.split(".", 2)[-1] if h.layer is not None else h.gguf_name
                    for h in hits[arch].values() if h.group not in ("experts", "expert_scales") and h.gguf_name}
            return len(seen) / max(1, len({e.gguf for e in maps[arch].tensors}))

        usage = {a: used(a) for a in winners}
        top = max(usage.values())
        winners = [a for a in winners if usage[a] == top]
    return winners[0] if len(winners) == 1 else None
