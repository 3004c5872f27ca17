"""What an input checkpoint holds, restated as the output tensors a conversion makes from it.

Each output tensor is an :class:`Item`: its llama.cpp name, its element shape in kernel order, and the
:class:`Segment` s that say which rows of which input tensors fill which of its rows. The segment vocabulary is
deliberately small, and every layout reduces to it:

* ``rows``: output rows are a contiguous run of the source's rows (renames, per-expert stacking, merged GGUF
  slabs, the gate and up halves of an ``[E, 2I, H]`` fused tensor, legacy per-expert GGUF);
* ``transpose``: output rows are columns of one expert's slab (the ``[E, H, 2I]`` fused orientation);
* ``permute``: output rows are the source rows reordered within attention heads (llama.cpp's rope layout for
  llama-arch q/k, the permutation ``convert_hf_to_gguf`` applies).

A ``rows`` or ``transpose`` segment with ``col_step`` takes every ``col_step``-th source column from ``src_col``
(gpt-oss' interleaved gate/up halves of a fused expert tensor and of its bias).

Nothing here reads tensor data; everything comes from headers, ``config.json`` and the naming maps, so a bad
input fails here, before any output exists.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from ktconvert import families
from ktconvert.formats import transforms
from ktconvert.errors import InputError
from ktconvert.formats import Checkpoint, LayoutReport, NamingMap, detect_layout, naming_map
from ktconvert.formats.release import Release, checkpoint_of
from ktconvert.formats import quantized
from ktconvert.formats.config import load_config
from ktconvert.convert.items import Item, Segment  # noqa: F401 (planners import them from here too)
from ktconvert.convert.kt_amx_io import expert_items, nonexpert_item

PROJ_ORDER = ("gate", "up", "down")


@dataclass
class SourceModel:
    """The analysed input: its checkpoint, architecture, config, layout report and output items."""

    checkpoint: Checkpoint
    path: Path
    arch: str
    model_type: str | None
    config: dict | None
    config_path: str | None
    n_layers: int | None
    layout: LayoutReport
    items: list[Item]
    notes: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


def analyze(src: str | Path, config: str | Path | dict | None = None) -> SourceModel:
    """Open ``src`` (anything :func:`ktconvert.formats.open_checkpoint` reads, or a
    :class:`~ktconvert.formats.release.Release` already opened) and derive the output items.

    Raises :class:`InputError` for anything that would make a wrong or partial conversion: errors of the
    layout detection (missing or extra experts, shapes that disagree with each other or with ``config.json``,
    mixed layouts), an orientation the shapes and config cannot decide, quantized weights whose scales are
    missing or do not fit (:mod:`ktconvert.formats.quantized`; checked first, so the error names the tensor),
    tensor names no naming map knows.
    """
    ck = checkpoint_of(src)  # a Release the caller opened: its checkpoint and config, not opened again
    shown = str(src)
    cfg_dict, cfg_path = None, None
    if isinstance(config, dict):
        cfg_dict = config
    elif config is not None:

        cfg_dict, cfg_path = load_config(config), str(config)
    elif ck.config is not None:
        cfg_dict, cfg_path = ck.config, str(ck.config_path)
    if ck.container == "safetensors" and cfg_dict is None:
        raise InputError("no config.json beside the checkpoint: the hyperparameters and the expert geometry come "
                         "from it", path=shown, fix="pass --config path/to/config.json")
    if ck.container == "safetensors":  # another model is refused here, before layout detection, as check-rules does
        families.require_family(cfg_dict, cfg_path)
    own = isinstance(src, Release) and config is None  # its analysis of the same headers and config
    qmap = quantized.require(ck, cfg_dict, shown, analysis=src.quant if own else None)
    report = detect_layout(ck, cfg_path if cfg_path is not None else cfg_dict)  # its errors name the file
    if report.arch is None:
        raise InputError("cannot tell which architecture this is (no general.architecture, no model_type, and "
                         "the tensor names fit no naming map)", path=shown,
                         fix="pass --config with the model's config.json")
    nm = naming_map(report.arch)
    # the place is the layer; a message that starts by naming it again loses that start
    fix = "ktconvert inspect shows the layout problems; fix or re-download the checkpoint"
    errors = [(p.message.removeprefix(f"layer {p.extra['layer']}: "), f"layer {p.extra['layer']}", fix)
              if p.extra["layer"] is not None
              else (p.message, None, fix)
              for p in report.all_problems
              if p.severity == "error" or p.id == "ambiguous-orientation"]
    if errors:
        raise InputError.first_of(errors, shown)
    kt = "kt-amx" in report.layouts

    model_type = report.dims.model_type
    n_layers = report.dims.n_layers or report.n_layers
    notes = [f"{p.id}: {p.message}" for p in report.all_problems
             if p.severity == "warning" and p.id != "ambiguous-orientation"]
    skipped: list[str] = []
    outside_lm: list[str] = []
    spec = families.find(model_type)
    outside = spec.ignore_prefixes if spec is not None else ()
    hf = ck.container == "safetensors"
    cfg = _heads(cfg_dict, ck) if hf and families.permutes_qk(report.arch) else None

    items: list[Item] = []
    interleaved = (families.find(model_type) is not None
                   and families.find(model_type).experts.interleaved_gate_up)
    split_biases: dict[str, list[tuple[int, str]]] = {}
    for name, m in report.matches.items():
        if m.group in ("experts", "expert_scales"):
            continue
        if m.group == "expert_biases" and m.side == "hf" and not (m.layer is not None and n_layers is not None
                                                                  and m.layer >= n_layers):
            if m.layout == "hf-split":  # one [rows] bias per expert: stacked like the weights
                split_biases.setdefault(m.gguf_name, []).append((m.expert, name))
                continue
            if m.projection == "gate_up":
                items.extend(_gate_up_bias_items(name, m, nm, ck, interleaved, shown))
                continue
        if m.layer is not None and n_layers is not None and m.layer >= n_layers:
            skipped.append(name)
            continue
        info = ck[name]
        shape = info.shape or (1,)
        seg = Segment(0, _rows(shape), name)
        out = m.gguf_name
        if out.endswith(".ffn_gate_inp_shexp.weight") and len(shape) == 2 and shape[0] == 1:
            shape = shape[1:]  # llama.cpp and transformers' GGUF loader read Qwen2-MoE's [1, H] shared gate as [H]
        if cfg is not None and m.side == "hf" and out.endswith((".attn_q.weight", ".attn_k.weight")):
            heads = cfg[0] if out.endswith(".attn_q.weight") else cfg[1]
            if shape[0] % (2 * heads):
                raise InputError(f"{shape[0]} rows cannot be split into {heads} heads of rotary pairs",
                                 path=shown, where=f"tensor {name}", fix="check num_attention_heads in config.json")
            seg = Segment(0, shape[0], name, op="permute", heads=heads)
        if m.transform and m.side == "hf":
            for sib in (nm.hf_siblings(m) if transforms.splits(m.transform) else [m]):
                sshape, segs = transforms.apply(name, tuple(shape), dict(sib.transform), cfg_dict, seg, f"tensor {name}")
                items.append(Item(sib.gguf_name, sib.hf_name, tuple(sshape), segs, info.dtype, sib.group, sib.layer))
            continue
        items.append(Item(out, m.hf_name, tuple(shape), (seg,), info.dtype, m.group, m.layer))
    for name in report.unknown:
        if name in qmap.scales:  # read with its quantized weight
            continue
        if kt:  # upstream's converter copies non-expert tensors under shortened HF names (model.layers. -> blk.)

            it = nonexpert_item(name, nm, ck)
            if it is not None and not (it.layer is not None and n_layers is not None and it.layer >= n_layers):
                items.append(it)
            else:
                skipped.append(name)
            continue
        if name.endswith("rotary_emb.inv_freq"):
            skipped.append(name)
            continue
        # outside the language model (the spec's checkpoint.ignore_prefixes: an MTP head, a wrapper's vision tower and
        # projector), which llama.cpp's converters leave out too
        if hf and outside and name.startswith(outside):
            outside_lm.append(name)
            continue
        m_layer = _layer_of(name)
        if m_layer is not None and n_layers is not None and m_layer >= n_layers:
            skipped.append(name)
            continue
        if not hf:  # already a llama.cpp tensor (rope_freqs, ...): carried under its own name for the recipe
            info = ck[name]
            shape = info.shape or (1,)
            items.append(Item(name, None, tuple(shape), (Segment(0, _rows(shape), name),), info.dtype, "other", m_layer))
            continue
        raise InputError("no naming map knows this tensor, so it has no llama.cpp name", path=shown,
                         where=f"tensor {name}",
                         fix=f"add it to rules/naming/{report.arch}.yaml, or remove it from the checkpoint")
    for gname, parts in split_biases.items():
        parts.sort()
        first = ck[parts[0][1]]
        m0 = report.matches[parts[0][1]]
        items.append(Item(gname, m0.hf_name, (len(parts), *first.shape), tuple(Segment(e, 1, n) for e, n in parts),
                          first.dtype, "expert_biases", m0.layer, m0.projection))
    for ly in report.layers:
        if ly.layout is None or (n_layers is not None and ly.layer >= n_layers):
            if ly.layout is not None:
                skipped.extend(t for p in ly.projections.values() for t in p.tensors)
            continue
        items.extend(_expert_items(ly, report, nm, ck, shown, interleaved))
    if kt and not any(it.group != "experts" for it in items):
        notes.append("the kt-amx input holds only routed experts (kt-kernel takes everything else from the original "
                     "checkpoint): the output has no attention, router, norm or embedding weights")
    if skipped:
        notes.append(f"{len(skipped)} tensor(s) of layers past num_hidden_layers (multi-token-prediction) or "
                     f"rotary caches are not converted, e.g. {skipped[0]}")
    if outside_lm:
        notes.append(f"{len(outside_lm)} tensor(s) outside the language model (MTP head, vision tower, projector) are "
                     f"not converted, e.g. {outside_lm[0]}")
    if qmap.weights:
        items = [_with_scales(it, qmap) for it in items]
    act = quantized.activation_scale_note(qmap)
    if act:
        notes.append(act)
    _check_unique(items, shown)
    _check_config(items, report, shown)
    items = _ordered(items, nm, ck)
    return SourceModel(ck, Path(src), report.arch, model_type, cfg_dict, cfg_path, n_layers, report, items, notes,
                       skipped)


def _with_scales(item: Item, qmap) -> Item:
    """Segments from a quantized weight carry its format, scale and block: the worker decodes exactly those rows."""
    if not any(s.source in qmap.weights for s in item.segments):
        return item

    def quant(s: Segment) -> Segment:
        w = qmap.weights[s.source]
        block = tuple(w.block) if hasattr(w, "block") else (1, w.group)
        return replace(s, scale=w.scale, block=block, fmt=w.fmt)

    segs = tuple(quant(s) if s.source in qmap.weights else s for s in item.segments)
    return replace(item, segments=segs)


def _rows(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape[:-1]:
        n *= d
    return n


def _layer_of(name: str) -> int | None:
    parts = name.split(".")
    for a, b in zip(parts, parts[1:]):
        if a in ("layers", "blk") and b.isdigit():
            return int(b)
    return None


def _heads(cfg: dict | None, ck: Checkpoint) -> tuple[int, int]:
    c = cfg or {}
    if isinstance(c.get("text_config"), dict):
        c = c["text_config"]
    n = c.get("num_attention_heads")
    if type(n) is not int or n <= 0:
        raise InputError("config.json has no num_attention_heads; llama-arch q/k need it to reorder rotary pairs",
                         path=str(ck.path), fix="pass --config with the model's config.json")
    kv = c.get("num_key_value_heads")
    return n, kv if type(kv) is int and kv > 0 else n


def _gate_up_bias_items(name: str, m, nm: NamingMap, ck: Checkpoint, interleaved: bool, shown: str) -> list[Item]:
    """A fused ``gate_up_proj_bias [E, 2I]`` as llama.cpp's gate and up biases ``[E, I]``: even/odd columns
    (interleaved) or the two halves."""
    shape = ck[name].shape
    if len(shape) != 2 or shape[1] % 2:
        raise InputError(f"a fused gate/up bias must be [E, 2I], got {list(shape)}", path=shown, where=f"tensor {name}",
                         fix="check the checkpoint's expert biases")
    e, i = shape[0], shape[1] // 2
    out = []
    for k, p in enumerate(("gate", "up")):
        seg = Segment(0, e, name, src_col=k if interleaved else k * i, col_step=2 if interleaved else 1)
        out.append(Item(nm.expert_name("gguf-merged", p, m.layer, bias=True), nm.expert_name("hf-split", p, m.layer, expert="*", bias=True),
                        (e, i), (seg,), ck[name].dtype, "expert_biases", m.layer, p))
    return out


def _expert_items(ly, report: LayoutReport, nm: NamingMap, ck: Checkpoint, shown: str,
                  interleaved: bool = False) -> list[Item]:
    L, E, I, H = ly.layer, ly.n_experts, ly.intermediate, ly.hidden
    out: list[Item] = []
    if ly.layout == "kt-amx":

        return expert_items(ly, nm)

    def names(p: str) -> tuple[str, str | None]:
        return nm.expert_name("gguf-merged", p, L), nm.expert_name("hf-split", p, L, expert="*")

    def dtype_of(srcs) -> str:
        kinds = {ck[s].dtype for s in srcs}
        return kinds.pop() if len(kinds) == 1 else "mixed"

    if ly.layout in ("hf-split", "gguf-split"):
        for p in PROJ_ORDER:
            info = ly.projections[p]
            by_expert = {report.matches[t].expert: t for t in info.tensors}
            rows, cols = info.shape
            segs = tuple(Segment(e * rows, rows, by_expert[e]) for e in range(E))
            gname, hname = names(p)
            out.append(Item(gname, hname, (E, rows, cols), segs, dtype_of(by_expert.values()), "experts", L, p))
        return out
    projs = ly.projections
    if "gate_up" in projs:
        gu = projs["gate_up"].tensors[0]
        shape = ck[gu].shape
        transposed = ly.layout == "hf-fused" and ly.orientation == "[E,H,2I]"
        if interleaved and not transposed:
            raise InputError(f"interleaved gate/up experts stored {ly.orientation}; only [E, H, 2I] (as transformers "
                             "saves them) can be split", path=shown, where=f"tensor {gu}",
                             fix="save the checkpoint with transformers")
        for k, p in enumerate(("gate", "up")):
            gname, hname = names(p)
            if interleaved:  # [E, H, 2I], gate at even columns and up at odd ones (gpt-oss)
                segs = tuple(Segment(e * I, I, gu, op="transpose", expert=e, src_col=k, col_step=2) for e in range(E))
            elif transposed:  # [E, H, 2I]: expert e's gate rows are columns 0..I of its slab, up rows I..2I
                segs = tuple(Segment(e * I, I, gu, op="transpose", expert=e, src_col=k * I) for e in range(E))
            else:  # [E, 2I, H]: gate rows first, then up rows, per expert
                segs = tuple(Segment(e * I, I, gu, src_row=e * shape[1] + k * I) for e in range(E))
            out.append(Item(gname, hname, (E, I, H), segs, ck[gu].dtype, "experts", L, p))
    else:
        for p in ("gate", "up"):
            t = projs[p].tensors[0]
            gname, hname = names(p)
            out.append(Item(gname, hname, (E, I, H), (Segment(0, E * I, t),), ck[t].dtype, "experts", L, p))
    d = projs["down"].tensors[0]
    gname, hname = names("down")
    if ly.layout == "hf-fused" and ly.orientation == "[E,H,2I]":  # down stored [E, I, H]: transpose each expert
        segs = tuple(Segment(e * H, H, d, op="transpose", expert=e) for e in range(E))
    else:
        segs = (Segment(0, E * H, d),)
    out.append(Item(gname, hname, (E, H, I), segs, ck[d].dtype, "experts", L, "down"))
    return out


def _check_unique(items: list[Item], shown: str) -> None:
    seen: dict[str, Item] = {}
    for it in items:
        if it.name in seen:
            a, b = seen[it.name].segments[0].source, it.segments[0].source
            raise InputError(f"tensors {a} and {b} both map to llama.cpp tensor {it.name}", path=shown,
                             where=f"tensor {b}", fix="the checkpoint holds the same weight twice; remove one")
        seen[it.name] = it


def _check_config(items: list[Item], report: LayoutReport, shown: str) -> None:
    """Non-expert shapes against config.json (layout detection already checked the experts)."""
    dims = report.dims
    H, E = dims.hidden_size, dims.n_experts
    if H is None:
        return
    for it in items:
        base = it.name.rsplit(".", 2)[-2] if it.name.count(".") >= 1 else it.name
        want = None
        if it.name in ("token_embd.weight", "output.weight") and it.shape[-1] != H:
            want = f"[vocab, {H}]"
        elif base in ("attn_norm", "ffn_norm", "output_norm") and it.shape != (H,):
            want = f"[{H}]"
        elif base == "ffn_gate_inp" and it.name.endswith(".weight") and E and it.shape != (E, H):
            want = f"[{E}, {H}]"
        if want:
            raise InputError(f"{it.name} is {list(it.shape)} but {dims.source} says {want}", path=shown,
                             where=f"tensor {it.segments[0].source}",
                             fix="the weights and config.json belong to different models")


def _ordered(items: list[Item], nm: NamingMap, ck: Checkpoint) -> list[Item]:
    """GGUF input keeps its tensor order; HF input gets llama.cpp's: embeddings, layers in order (naming-map
    order within a layer, experts gate/up/down last), then the output norm and head."""
    if ck.container == "gguf":
        pos = {n: i for i, n in enumerate(ck)}
        return sorted(items, key=lambda it: (min(pos[s.source] for s in it.segments), it.name))
    order = {e.gguf: i for i, e in enumerate(nm.tensors)}

    def key(it: Item):
        if it.layer is None:
            k = order.get(it.name, len(order))
            return (0 if it.name == "token_embd.weight" else 2, 0, k, it.name)
        if it.group == "experts":
            return (1, it.layer, len(order) + PROJ_ORDER.index(it.projection), it.name)
        template = it.name.replace(f"blk.{it.layer}.", "blk.{L}.", 1)
        return (1, it.layer, order.get(template, len(order)), it.name)

    return sorted(items, key=key)

