"""Which of the five expert layouts each layer uses, and E (experts), I (expert width), H (hidden size) per layer.

Names say the layout and projection (via the naming maps); shapes give E, I and H. Shapes alone cannot always say
which axis is I and which is H: a fused ``gate_up_proj`` is ``[E, 2I, H]`` in transformers 5 but ``[E, H, 2I]`` in
some checkpoints, and when ``H == 2I`` the two look identical. The ``down`` tensor usually decides; otherwise
``config.json`` does, then the family spec's ``checkpoint.fused_orientation`` (how its releases store them); when
none can, the layer's orientation is reported as ambiguous rather than guessed.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from ktconvert.diagnostics import Diagnostic
from ktconvert.formats.checkpoint import COMPANION, Checkpoint
from ktconvert.formats.completeness import missing_everywhere, missing_tensors
from ktconvert.formats.config import ModelDims, load_config
from ktconvert.formats.fp8 import CHANNEL_SUFFIX, SCALE_SUFFIX
from ktconvert.formats.naming import LAYOUTS, NameMatch, NamingMap, guess_arch, key_of_name, naming_maps
from ktconvert.formats.tensor_info import TensorInfo

ORIENT_STD = "[E,2I,H]"
ORIENT_T = "[E,H,2I]"
AMBIGUOUS = "ambiguous"


def problem(kind: str, severity: str, message: str, layer: int | None = None,
            tensors: tuple[str, ...] = ()) -> Diagnostic:
    """One layout finding: ``kind`` (its ``id``) is a stable kebab-case id; ``severity`` is ``error``, ``warning`` or
    ``info``; ``extra`` holds the ``layer`` (``None``: the model) and the ``tensors`` it is about."""
    return Diagnostic(kind, severity, message, extra={"layer": layer, "tensors": tuple(tensors)})


@dataclass(frozen=True)
class ProjectionInfo:
    """The stored tensors of one projection in one layer.

    ``shape`` / ``ne`` are of one stored tensor (a single expert's matrix for per-expert layouts, the whole stack for
    merged/fused ones) in numpy and ggml order; ``None`` when the tensors disagree. ``dtypes`` are the distinct
    storage types (safetensors dtype or ggml type name).
    """

    projection: str
    tensors: tuple[str, ...]
    dtypes: tuple[str, ...]
    shape: tuple[int, ...] | None
    ne: tuple[int, ...] | None
    nbytes: int
    experts: tuple[int, ...] | None = None  # expert indices present, for per-expert layouts


@dataclass(frozen=True)
class LayerLayout:
    """One layer's routed experts. ``layout`` is one of :data:`~ktconvert.formats.naming.LAYOUTS`, ``"mixed"`` or
    ``None`` (no expert tensors). ``orientation`` is set for ``hf-fused`` (``"[E,2I,H]"``, ``"[E,H,2I]"`` or
    ``"ambiguous"``). ``quant`` is the kt-kernel method deduced from AMX blob sizes."""

    layer: int
    layout: str | None
    n_experts: int | None = None
    intermediate: int | None = None
    hidden: int | None = None
    orientation: str | None = None
    quant: str | None = None
    numa_parts: int | None = None
    projections: dict[str, ProjectionInfo] = field(default_factory=dict)
    router: str | None = None
    score_bias: str | None = None
    shared_experts: tuple[str, ...] = ()
    problems: tuple[Diagnostic, ...] = ()


@dataclass(frozen=True)
class LayoutReport:
    """Result of :func:`detect_layout`. ``matches`` classifies every recognised tensor name; ``unknown`` lists the
    names no naming map recognises. ``layers`` covers every layer that has expert tensors or should have them."""

    arch: str | None
    arch_source: str
    dims: ModelDims
    n_layers: int | None
    layers: tuple[LayerLayout, ...]
    problems: tuple[Diagnostic, ...]
    matches: dict[str, NameMatch]
    unknown: tuple[str, ...]

    @property
    def layouts(self) -> set[str]:
        return {ly.layout for ly in self.layers if ly.layout}

    def layer(self, index: int) -> LayerLayout | None:
        return next((ly for ly in self.layers if ly.layer == index), None)

    @property
    def all_problems(self) -> list[Diagnostic]:
        return [*self.problems, *(p for ly in self.layers for p in ly.problems)]


def detect_layout(checkpoint: Checkpoint, config: str | Path | dict | None = None) -> LayoutReport:
    """Classify every tensor and describe each layer's experts; problems are reported, never raised."""
    dims = checkpoint.dims(config)
    arch, arch_source = _architecture(checkpoint, dims)
    maps = naming_maps()
    primary: NamingMap | None = maps.get(arch) if arch else None
    others = [m for a, m in maps.items() if a != arch]

    matches: dict[str, NameMatch] = {}
    unknown: list[str] = []
    for name in checkpoint:
        key = key_of_name(name)  # once per name, whatever the number of maps tried
        m = primary.lookup(name, key) if primary else None
        if m is None:
            for other in others:
                cand = other.lookup(name, key)
                if cand is not None and (primary is None or cand.group in ("experts", "expert_scales")):
                    m = cand
                    break
        if m is None:
            # an FP8 weight's scale is read with it (formats.fp8); a .ggml_type companion is its tensor's type
            if not _is_fp8_scale(checkpoint, name) and not is_type_companion(checkpoint, name):
                unknown.append(name)
        else:
            matches[name] = m

    by_layer: dict[int, list[tuple[NameMatch, TensorInfo]]] = defaultdict(list)
    extras: dict[int, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    layer_ids: set[int] = set()
    for name, m in matches.items():
        if m.layer is not None:
            layer_ids.add(m.layer)
        if m.group in ("experts", "expert_scales"):
            by_layer[m.layer].append((m, checkpoint[name]))
        elif m.layer is not None and m.group in ("router", "score_bias", "shared_experts"):
            extras[m.layer][m.group].append(name)

    n_layers = max(layer_ids) + 1 if layer_ids else None
    wanted = set(by_layer)
    if dims.moe_layers is not None:
        wanted |= set(dims.moe_layers)
    layers = []
    for L in sorted(wanted):
        ly = _analyze_layer(L, by_layer.get(L, []), dims)
        ex = extras.get(L, {})
        layers.append(
            LayerLayout(
                **{
                    **ly.__dict__,
                    "router": (ex.get("router") or [None])[0],
                    "score_bias": (ex.get("score_bias") or [None])[0],
                    "shared_experts": tuple(sorted(ex.get("shared_experts", []))),
                    "problems": ly.problems + _layer_expectations(L, ly, dims),
                }
            )
        )
    problems = _global_problems(layers, dims, n_layers, unknown, checkpoint)
    problems.extend(_missing(checkpoint, config, arch, matches, layers, dims, set(by_layer)))
    return LayoutReport(arch, arch_source, dims, n_layers, tuple(layers), tuple(problems), matches, tuple(unknown))


def is_type_companion(ck: Checkpoint, name: str) -> bool:
    """``NAME.ggml_type`` beside ``NAME.weight`` (or ``NAME``) in kernel-order safetensors."""
    if not name.endswith(COMPANION):
        return False
    base = name[: -len(COMPANION)]
    return base + ".weight" in ck or base in ck


def _is_fp8_scale(ck: Checkpoint, name: str) -> bool:
    """A scale or other companion read with its quantized weight (an FP8 ``_scale_inv`` / per-channel ``_scale``,
    a packed weight's scales, zero points, shape)."""
    if name in getattr(ck, "packed_parts", ()):
        return True
    for suffix in (SCALE_SUFFIX, CHANNEL_SUFFIX):
        base = name[: -len(suffix)] if name.endswith(suffix) else None
        if base is not None and base in ck and ck[base].dtype.startswith("F8_"):
            return True
    return False


def _architecture(ck: Checkpoint, dims: ModelDims) -> tuple[str | None, str]:
    if ck.container == "gguf" and isinstance(ck.metadata.get("general.architecture"), str):
        return ck.metadata["general.architecture"], "general.architecture"
    if dims.arch:
        return dims.arch, f"model_type {dims.model_type} in {dims.source}"
    guessed = guess_arch(ck)
    return guessed, ("guessed from tensor names" if guessed else "unknown")


# --- per layer ------------------------------------------------------------------------------------------------------


def _proj_info(proj: str, items: list[tuple[NameMatch, TensorInfo]], per_expert: bool) -> ProjectionInfo:
    items = sorted(items, key=lambda it: (it[0].expert or 0, it[0].numa or 0, it[1].name))
    shapes = {t.shape for _, t in items}
    shape = next(iter(shapes)) if len(shapes) == 1 else None
    return ProjectionInfo(
        projection=proj,
        tensors=tuple(t.name for _, t in items),
        dtypes=tuple(sorted({t.dtype for _, t in items})),
        shape=shape,
        ne=tuple(reversed(shape)) if shape is not None else None,
        nbytes=sum(t.nbytes for _, t in items),
        experts=tuple(sorted({m.expert for m, _ in items})) if per_expert else None,
    )


def _analyze_layer(L: int, items: list[tuple[NameMatch, TensorInfo]], dims: ModelDims) -> LayerLayout:
    weights = [it for it in items if it[0].group == "experts"]
    if not weights:
        return LayerLayout(layer=L, layout=None)
    counts = Counter(m.layout for m, _ in weights)
    if len(counts) > 1:
        desc = ", ".join(f"{lay} ({n} tensors)" for lay, n in sorted(counts.items()))
        return LayerLayout(
            layer=L,
            layout="mixed",
            problems=(problem("mixed-layouts", "error", f"layer {L} mixes expert layouts: {desc}", L),),
        )
    layout = next(iter(counts))
    by_proj: dict[str, list] = defaultdict(list)
    for it in weights:
        by_proj[it[0].projection].append(it)
    if layout in ("hf-split", "gguf-split"):
        return _per_expert(L, layout, by_proj, dims)
    if layout == "kt-amx":
        scales: dict[str, list] = defaultdict(list)
        for it in items:
            if it[0].group == "expert_scales":
                scales[it[0].projection].append(it)
        return _kt_amx(L, by_proj, scales, dims)
    return _stacked(L, layout, by_proj, dims)


def _missing_projection_problems(L: int, by_proj: dict, layout: str) -> list[Diagnostic]:
    have = set(by_proj)
    if "down" not in have or not ({"gate", "up"} <= have or "gate_up" in have):
        need = ["gate", "up", "down"] if layout != "hf-fused" else ["gate_up", "down"]
        missing = [p for p in need if p not in have]
        return [problem("missing-projection", "error", f"layer {L} ({layout}) has no {'/'.join(missing)} tensor", L)]
    return []


def _per_expert(L: int, layout: str, by_proj: dict, dims: ModelDims) -> LayerLayout:
    problems = _missing_projection_problems(L, by_proj, layout)
    projections = {p: _proj_info(p, its, True) for p, its in by_proj.items()}
    present = {p: {m.expert for m, _ in its} for p, its in by_proj.items()}
    union = set().union(*present.values())
    n_found = max(union) + 1
    n_experts = dims.n_experts or n_found
    for p in sorted(present):
        missing = sorted(set(range(n_experts)) - present[p])
        if missing:
            problems.append(
                problem(
                    "missing-experts",
                    "error",
                    f"layer {L} {p}: {len(missing)} of {n_experts} experts missing ({_ids(missing)})",
                    L,
                )
            )
        extra = sorted(e for e in present[p] if e >= n_experts)
        if extra:
            problems.append(
                problem(
                    "extra-experts",
                    "error",
                    f"layer {L} {p}: expert index {_ids(extra)} beyond the {n_experts} experts "
                    f"{'config.json declares' if dims.n_experts else 'found'}",
                    L,
                    tuple(t.name for m, t in by_proj[p] if m.expert in extra),
                )
            )
    for p, its in by_proj.items():
        shapes = Counter(t.shape for _, t in its)
        if len(shapes) > 1:
            common = shapes.most_common(1)[0][0]
            odd = [t for _, t in its if t.shape != common]
            problems.append(
                problem(
                    "unequal-expert-shapes",
                    "error",
                    f"layer {L} {p}: {len(odd)} expert(s) differ from the common shape {list(common)}, "
                    f"e.g. {odd[0].name} is {list(odd[0].shape)}",
                    L,
                    tuple(t.name for t in odd),
                )
            )
        dts = {t.dtype for _, t in its}
        if len(dts) > 1:
            problems.append(
                problem("mixed-dtypes", "warning", f"layer {L} {p}: experts stored as {', '.join(sorted(dts))}", L)
            )
    inter = hidden = None
    gate = _common_shape(by_proj.get("gate") or by_proj.get("up") or [])
    down = _common_shape(by_proj.get("down", []))
    if gate is not None and len(gate) == 2:
        inter, hidden = gate
    elif down is not None and len(down) == 2:
        hidden, inter = down
    up = _common_shape(by_proj.get("up", []))
    if gate is not None and up is not None and gate != up or (
        gate is not None and down is not None and tuple(reversed(gate)) != down
    ):
        problems.append(
            problem(
                "inconsistent-projections",
                "error",
                f"layer {L}: per-expert shapes gate {_fmt(gate)}, up {_fmt(up)}, down {_fmt(down)} do not fit "
                "gate/up [I,H] and down [H,I]",
                L,
            )
        )
    return LayerLayout(
        layer=L,
        layout=layout,
        n_experts=n_found,
        intermediate=inter,
        hidden=hidden,
        projections=projections,
        problems=tuple(problems),
    )


def _stacked(L: int, layout: str, by_proj: dict, dims: ModelDims) -> LayerLayout:
    """gguf-merged and hf-fused: one 3-D tensor per projection, experts on the first axis."""
    problems = _missing_projection_problems(L, by_proj, layout)
    projections = {p: _proj_info(p, its, False) for p, its in by_proj.items()}
    shapes = {p: info.shape for p, info in projections.items()}
    bad = {p: s for p, s in shapes.items() if s is None or len(s) != 3}
    if bad:
        problems.append(
            problem(
                "inconsistent-projections",
                "error",
                f"layer {L}: {layout} tensors must be 3-D [E, rows, cols]; "
                + ", ".join(f"{p} is {_fmt(s)}" for p, s in bad.items()),
                L,
            )
        )
        return LayerLayout(layer=L, layout=layout, projections=projections, problems=tuple(problems))
    n_exp = {s[0] for s in shapes.values()}
    if len(n_exp) > 1:
        problems.append(
            problem(
                "inconsistent-projections",
                "error",
                f"layer {L}: projections disagree on the expert count: "
                + ", ".join(f"{p} {list(s)}" for p, s in shapes.items()),
                L,
            )
        )
    E = shapes["down"][0] if "down" in shapes else next(iter(n_exp))
    inter = hidden = orientation = None
    if layout == "gguf-merged":
        inter, hidden, ok = _merged_dims(shapes)
        if not ok:
            problems.append(
                problem(
                    "inconsistent-projections",
                    "error",
                    f"layer {L}: merged shapes (numpy order) "
                    + ", ".join(f"{p} {list(s)}" for p, s in shapes.items())
                    + " do not fit gate/up [E,I,H], gate_up [E,2I,H] and down [E,H,I]",
                    L,
                )
            )
    else:
        inter, hidden, orientation, why = _fused_orientation(shapes, dims)
        if orientation == AMBIGUOUS:
            problems.append(problem("ambiguous-orientation", "warning", f"layer {L}: {why}", L))
        elif orientation is None:
            problems.append(problem("inconsistent-projections", "error", f"layer {L}: {why}", L))
    return LayerLayout(
        layer=L,
        layout=layout,
        n_experts=E,
        intermediate=inter,
        hidden=hidden,
        orientation=orientation,
        projections=projections,
        problems=tuple(problems),
    )


def _merged_dims(shapes: dict) -> tuple[int | None, int | None, bool]:
    gate = shapes.get("gate") or shapes.get("up")
    down = shapes.get("down")
    gu = shapes.get("gate_up")
    if gate is not None:
        inter, hidden = gate[1], gate[2]
    elif gu is not None and gu[1] % 2 == 0:
        inter, hidden = gu[1] // 2, gu[2]
    elif down is not None:
        hidden, inter = down[1], down[2]
    else:
        return None, None, False
    ok = all(shapes[p][1:] == (inter, hidden) for p in ("gate", "up") if p in shapes)
    ok &= "gate_up" not in shapes or shapes["gate_up"][1:] == (2 * inter, hidden)
    ok &= down is None or down[1:] == (hidden, inter)
    return inter, hidden, ok


def _fused_orientation(shapes: dict, dims: ModelDims) -> tuple[int | None, int | None, str | None, str]:
    """``(I, H, orientation, explanation)`` of an hf-fused layer; orientation ``None`` means the shapes do not fit."""
    gu, down = shapes.get("gate_up"), shapes.get("down")
    if gu is None:
        return None, None, None, "no gate_up_proj tensor"
    a, b = gu[1], gu[2]
    candidates = []
    if a % 2 == 0:
        candidates.append((ORIENT_STD, a // 2, b))
    if b % 2 == 0:
        candidates.append((ORIENT_T, b // 2, a))
    if down is not None:  # down [E,H,I] goes with [E,2I,H]; down [E,I,H] with [E,H,2I]
        candidates = [
            c
            for c in candidates
            if (c[0] == ORIENT_STD and down[1:] == (c[2], c[1])) or (c[0] == ORIENT_T and down[1:] == (c[1], c[2]))
        ]
    cfg_i, cfg_h = dims.moe_intermediate_size, dims.hidden_size
    if len(candidates) > 1 and cfg_i and cfg_h:
        candidates = [c for c in candidates if (c[1], c[2]) == (cfg_i, cfg_h)] or candidates
    if len(candidates) > 1 and dims.fused_orientation:  # the family spec says how its releases store them
        want = ORIENT_STD if dims.fused_orientation == "standard" else ORIENT_T
        candidates = [c for c in candidates if c[0] == want] or candidates
    if len(candidates) == 1:
        o, inter, hidden = candidates[0]
        return inter, hidden, o, ""
    if not candidates:
        return None, None, None, (
            f"gate_up_proj {list(gu)} and down_proj {_fmt(down)} fit neither [E,2I,H]+[E,H,I] nor [E,H,2I]+[E,I,H]"
        )
    return None, None, AMBIGUOUS, (
        f"gate_up_proj {list(gu)} could be [E,2I,H] or [E,H,2I] (H == 2I) and "
        + ("there is no down_proj" if down is None else "down_proj cannot tell")
        + ("; config.json does not decide either" if cfg_i and cfg_h else "; pass --config with config.json to decide")
    )


def _kt_amx(L: int, by_proj: dict, scales: dict, dims: ModelDims) -> LayerLayout:
    """kt-kernel AMX blobs: I and H follow from scale lengths (one float32 per output row and NUMA part)."""
    problems = _missing_projection_problems(L, by_proj, "kt-amx")
    projections = {p: _proj_info(p, its, True) for p, its in by_proj.items()}
    experts = sorted({m.expert for its in by_proj.values() for m, _ in its})
    parts = sorted({m.numa for its in by_proj.values() for m, _ in its})
    E, N = len(experts), len(parts)
    want = {(e, n) for e in experts for n in parts}
    if experts != list(range(E)) or parts != list(range(N)):
        problems.append(
            problem(
                "missing-experts",
                "error",
                f"layer {L}: expert indices {_ids(experts)} / NUMA parts {_ids(parts)} are not contiguous from 0",
                L,
            )
        )
    for kind, table in (("weight", by_proj), ("scale", scales)):
        for p in ("gate", "up", "down"):
            have = {(m.expert, m.numa) for m, _ in table.get(p, [])}
            if have != want:
                problems.append(
                    problem(
                        "missing-experts",
                        "error",
                        f"layer {L} {p}: {len(want - have)} of {len(want)} (expert, NUMA part) {kind} blobs missing",
                        L,
                    )
                )
    sizes = {p: Counter(t.nbytes for _, t in its) for p, its in by_proj.items()}
    scale_len = {p: Counter(t.n_elements for _, t in its) for p, its in scales.items()}
    inter = hidden = quant = None
    try:
        hidden = _only(scale_len["down"])
        part_i = _only(scale_len["gate"])
        inter = part_i * N
        bits = 8 * _only(sizes["gate"]) / (part_i * hidden)
        quant = {8.0: "AMXINT8", 4.0: "AMXINT4"}.get(bits)
        ok = quant is not None and _only(sizes["down"]) * 8 == hidden * part_i * bits
        ok &= _only(sizes["up"]) == _only(sizes["gate"]) and _only(scale_len["up"]) == part_i
        if not ok:
            problems.append(
                problem(
                    "inconsistent-projections",
                    "error",
                    f"layer {L}: AMX blob sizes fit neither INT8 nor INT4 per-row quantization of gate/up "
                    f"[{part_i},{hidden}] and down [{hidden},{part_i}] per NUMA part",
                    L,
                )
            )
    except (KeyError, ValueError):
        problems.append(
            problem("inconsistent-projections", "error", f"layer {L}: AMX blobs or scales differ in size", L)
        )
    return LayerLayout(
        layer=L,
        layout="kt-amx",
        n_experts=E,
        intermediate=inter,
        hidden=hidden,
        quant=quant,
        numa_parts=N,
        projections=projections,
        problems=tuple(problems),
    )


def _layer_expectations(L: int, ly: LayerLayout, dims: ModelDims) -> tuple[Diagnostic, ...]:
    out = []
    src = dims.source
    expected = dims.is_moe_layer(L)
    if ly.layout is None:
        if expected:
            out.append(problem("missing-experts", "error", f"layer {L} has no expert tensors but {src} makes it an MoE layer", L))
        return tuple(out)
    if dims.n_layers is not None and L >= dims.n_layers:
        out.append(
            problem(
                "extra-layer",
                "info",
                f"layer {L} is beyond num_hidden_layers={dims.n_layers} of {src} (an MTP / next-token layer?)",
                L,
            )
        )
    elif expected is False:
        out.append(problem("config-mismatch", "warning", f"layer {L} has experts but {src} makes it a dense layer", L))
    for what, got, want in (
        ("E (experts)", ly.n_experts, dims.n_experts),
        ("I (expert intermediate size)", ly.intermediate, dims.moe_intermediate_size),
        ("H (hidden size)", ly.hidden, dims.hidden_size),
    ):
        if got is not None and want is not None and got != want:
            out.append(problem("config-mismatch", "error", f"layer {L}: {what} is {got} but {src} says {want}", L))
    return tuple(out)


def _missing(ck: Checkpoint, config, arch: str | None, matches, layers, dims: ModelDims, expert_layers) -> list[Diagnostic]:
    """The spec's non-expert tensors the checkpoint lacks (:mod:`ktconvert.formats.completeness`), one error per
    layer (and one for the model-wide tensors), when a config says what the model is; a GGUF without one is checked
    for what its metadata settles (``missing_everywhere``). kt-kernel's AMX files hold the experts only: nothing
    else is expected there."""
    if any(ly.layout == "kt-amx" for ly in layers):
        return []
    raw = config if isinstance(config, dict) else load_config(config) if config is not None else ck.config
    by_layer: dict[int | None, list[str]] = defaultdict(list)
    what = ""
    if isinstance(raw, dict):
        for name in missing_tensors(raw, arch, matches) or ():
            parts = name.split(".")
            layer = next((int(b) for a, b in zip(parts, parts[1:]) if a == "layers" and b.isdigit()), None)
            by_layer[layer].append(name)
        what = f"the {arch} spec requires"
    elif ck.container == "gguf" and dims.n_layers is not None:
        n = dims.n_layers - dims.n_mtp_layers
        shared = bool(dims.n_shared_experts or dims.shared_expert_width)
        for layer, name in missing_everywhere(arch, n, expert_layers, matches, shared) or ():
            by_layer[layer].append(name)
        what = f"that every {arch} GGUF of block_count {dims.n_layers} holds"
    return [problem("missing-tensor", "error", f"{'layer ' + str(L) if L is not None else 'model'}: "
                    f"{len(names)} tensor(s) {what} are missing: {', '.join(names[:4])}"
                    f"{', ...' if len(names) > 4 else ''}", L, tuple(names))
            for L, names in sorted(by_layer.items(), key=lambda kv: -1 if kv[0] is None else kv[0])]


def _global_problems(layers, dims: ModelDims, n_layers, unknown, ck: Checkpoint) -> list[Diagnostic]:
    out = []
    layouts = Counter(ly.layout for ly in layers if ly.layout and ly.layout != "mixed")
    if len(layouts) > 1:
        desc = ", ".join(f"{lay} in {n} layer(s)" for lay, n in sorted(layouts.items()))
        out.append(problem("mixed-layouts", "error", f"layers use different expert layouts: {desc}"))
    geo = Counter((ly.n_experts, ly.intermediate, ly.hidden) for ly in layers if ly.layout and ly.n_experts)
    if len(geo) > 1:
        desc = "; ".join(f"E={e} I={i} H={h} in {n} layer(s)" for (e, i, h), n in geo.most_common())
        out.append(problem("unequal-layers", "warning", f"expert geometry differs between layers: {desc}"))
    if dims.n_layers is not None and n_layers is not None and n_layers < dims.n_layers:
        out.append(
            problem(
                "config-mismatch",
                "error",
                f"tensors cover {n_layers} layers but {dims.source} says num_hidden_layers={dims.n_layers}",
            )
        )
    if layouts.get("gguf-split"):
        out.append(
            problem(
                "legacy-layout",
                "warning",
                f"{layouts['gguf-split']} layer(s) store experts as legacy per-expert GGUF tensors (blk.L.ffn_*.E); "
                "llama.cpp stopped loading these in late 2024 (b3990) and ktransformers reads only 8 of them; "
                "merge them into blk.L.ffn_*_exps (a byte-level stack) or re-convert",
            )
        )
    if layouts.get("kt-amx"):
        out.append(
            problem(
                "opaque-layout",
                "info",
                "kt-amx blobs are kt-kernel's tile-packed AMX format: sizes are checked here, --scan dequantizes "
                "them, quantize unpacks them; the NUMA part count must equal the launch's --kt-threadpool-count "
                "(nothing on disk records it, and a mismatch runs silently wrong)",
            )
        )
    rows = _row_lengths([ly for ly in layers if ly.layout != "kt-amx"])
    if rows:
        out.append(rows)
    if unknown:
        out.append(
            problem(
                "unknown-tensors",
                "info",
                f"{len(unknown)} tensor name(s) are in no naming map, e.g. {unknown[0]}",
                tensors=tuple(unknown),
            )
        )
    out.extend(problem("reader-note", "warning", note) for note in ck.notes)
    return out


def _row_lengths(layers) -> Diagnostic | None:
    """Which block-quant families the expert rows could be quantized to (rows run along H for gate/up, I for down)."""
    rows = {}
    for ly in layers:
        if ly.hidden:
            rows.setdefault(f"H={ly.hidden} (gate/up rows)", ly.hidden)
        if ly.intermediate:
            rows.setdefault(f"I={ly.intermediate} (down rows)", ly.intermediate)
    no_k = [k for k, v in rows.items() if v % 256]
    no_32 = [k for k, v in rows.items() if v % 32]
    if not no_k:
        return None

    def are(keys: list[str]) -> str:
        return f"{keys[0]} is not a multiple of" if len(keys) == 1 else f"{', '.join(keys)} are not multiples of"

    msg = f"row length {are(no_k)} 256: K-quants (Q2_K..Q6_K) cannot hold {'it' if len(no_k) == 1 else 'them'}"
    if no_32:
        msg += f"; {are(no_32)} 32 either: only F32/F16/BF16 can"
    return problem("row-length", "warning" if no_32 else "info", msg)


def _common_shape(items) -> tuple[int, ...] | None:
    c = Counter(t.shape for _, t in items)
    return c.most_common(1)[0][0] if c else None


def _only(counter: Counter) -> int:
    if len(counter) != 1:
        raise ValueError("sizes differ")
    return next(iter(counter))


def _fmt(shape) -> str:
    return "none" if shape is None else str(list(shape))


def _ids(ids: list[int]) -> str:
    return ", ".join(map(str, ids[:8])) + (f", ... ({len(ids)} in all)" if len(ids) > 8 else "")


__all__ = ["LAYOUTS", "LayerLayout", "LayoutReport", "problem", "ProjectionInfo", "detect_layout"]
