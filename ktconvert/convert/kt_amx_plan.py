"""The plan of a ``--to kt-amx`` conversion: kt-kernel's AMXINT8/AMXINT4 expert directory.

Only routed experts are written (kt-kernel reads nothing else from this directory; the launch takes every other
weight from the original checkpoint through ``--model-path``). One safetensors shard per MoE layer, named as
upstream's converter names its layer shards, each expert projection's parts laid out together:
``numa.0.weight, numa.0.scale, numa.1.weight, ...``. That group is one unit of work: one expert's matrix is read
once (as float32, rounded to bf16 as upstream's ``.to(torch.bfloat16)`` does), packed into every part, and
written with one ``pwrite`` at the group's offset, so memory is bounded by one expert matrix whatever the model.

Everything that would make the kernel throw or misbehave is checked here, before the output directory exists:
H and I/P must be multiples of the method's tile width, P must divide I, every expert present, every layer the
same geometry.
"""

from __future__ import annotations

import json

from ktconvert import __version__, families
from ktconvert.convert.plan import Plan, PlanTensor, _segment_bytes, fingerprints, place_shards
from ktconvert.convert.recipe import Recipe
from ktconvert.convert.source import Segment, SourceModel
from ktconvert.errors import InputError, UsageProblem
from ktconvert.families.config import family_of, text_view
from ktconvert.formats import kt_amx

LAUNCH_NOTE = ("kt-amx output holds the routed experts only: launch with --kt-weight-path OUT --kt-method {method} "
               "--kt-threadpool-count {parts} and --model-path pointing at the original Hugging Face checkpoint "
               "(attention, router, norms, shared experts and embeddings come from there)")


def kt_amx_recipe(method: str) -> Recipe:
    """A recipe object that only names the method (the manifest and fingerprint record it)."""
    return Recipe(name=method, rules=(), source="--to kt-amx", description=f"kt-kernel {method} experts",
                  format="kt-amx")


def _expert_segments(item, e: int, rows: int) -> tuple[Segment, ...]:
    """The segments of ``item`` (a stacked ``[E, rows, cols]`` expert tensor) covering expert ``e``, rebased to 0."""
    lo, hi = e * rows, (e + 1) * rows
    out = []
    for s in item.segments:
        a, b = max(lo, s.start), min(hi, s.start + s.rows)
        if a >= b:
            continue
        shift = a - s.start
        if s.op == "rows":
            # a quantized release weight keeps its scale, block and format (the worker decodes those rows exactly)
            out.append(Segment(a - lo, b - a, s.source, "rows", src_row=s.src_row + shift, scale=s.scale,
                               block=s.block, fmt=s.fmt, lora=s.lora))
        elif s.op == "transpose":
            out.append(Segment(a - lo, b - a, s.source, "transpose", expert=s.expert,
                               src_col=s.src_col + shift * (s.col_step or 1), col_step=s.col_step, scale=s.scale,
                               block=s.block, fmt=s.fmt))  # a stacked release weight (gpt-oss MXFP4) keeps its scale
        elif s.op == "kt-amx":  # a kt-amx input: dequantized, then packed again (for another part count)
            out.append(Segment(a - lo, b - a, s.source, "kt-amx", src_row=s.src_row + shift, parts=s.parts,
                               method=s.method))
        else:
            raise InputError(f"expert tensor {s.source} cannot be read row by row ({s.op})")
    return tuple(out)


def _refuse_clamped_activation(src: SourceModel, method: str) -> None:
    """kt-kernel 0.7.2's AMX methods compute silu(gate) * up: its swiglu_limit / swiglu_alpha reach only the FP8,
    MXFP4, MXFP8 and LLAMAFILE methods (AMXINT4/8 raise on them), so experts with a clamped SwiGLU (a spec's
    moe.activation: gpt-oss, MiniMax-M3's swigluoai) would run the wrong activation from a kt-amx directory."""
    if not src.config:
        return
    sp = families.find(family_of(src.config))
    act = sp.activation if sp else None
    if act and act.limit_in(text_view(src.config), default=1) != 0:
        raise UsageProblem(
            f"{method} cannot run these experts: kt-kernel's AMX methods compute silu(gate) * up, and this model's "
            f"experts use {act.kind} (kt-kernel passes swiglu_limit / swiglu_alpha only to FP8, MXFP4, MXFP8 and "
            "LLAMAFILE)", fix="write a GGUF for --kt-method LLAMAFILE (ktconvert quantize --type Q8_0), or serve the "
                              "release as is (MiniMax-M3: --kt-method MXFP8)")


def build_kt_amx_plan(src: SourceModel, method: str, parts: int) -> Plan:
    """The plan, or :class:`InputError` naming the problem (alignment, geometry) before anything is written."""
    try:
        m = kt_amx.method(method)
    except InputError as exc:
        raise UsageProblem(exc.message, fix="pass --type AMXINT8 or --type AMXINT4 with --to kt-amx") from None
    if type(parts) is not int or parts < 1:
        raise UsageProblem(f"--threadpool-count {parts} must be a positive integer")
    shown = str(src.path)
    _refuse_clamped_activation(src, method)
    by_layer: dict[int, dict[str, object]] = {}
    for it in src.items:
        if it.group == "experts":
            by_layer.setdefault(it.layer, {})[it.projection] = it
    if not by_layer:
        raise InputError("no routed expert tensors: a kt-amx directory holds nothing else", path=shown,
                         fix="convert a Mixture-of-Experts checkpoint")
    ck = src.checkpoint
    groups = []  # (layer, expert, proj, rows, cols, segments, in_bytes)
    for L in sorted(by_layer):
        projs = by_layer[L]
        missing = [p for p in kt_amx.PROJECTIONS if p not in projs]
        if missing:
            raise InputError(f"layer {L} has no {missing[0]} experts", path=shown, where=f"layer {L}",
                             fix="ktconvert inspect shows the layer's tensors; the checkpoint is incomplete")
        E, I, H = projs["gate"].shape
        if projs["up"].shape != (E, I, H) or projs["down"].shape != (E, H, I):
            raise InputError(f"layer {L}: gate {list(projs['gate'].shape)}, up {list(projs['up'].shape)} and down "
                             f"{list(projs['down'].shape)} are not [E,I,H], [E,I,H], [E,H,I]", path=shown,
                             where=f"layer {L}", fix="ktconvert inspect shows the layer's tensors")
        kt_amx.check_alignment(m, H, I, parts, path=shown,
                               where=f"layer {L} ({projs['gate'].segments[0].source}, H={H}, I={I})")
        for e in range(E):
            for p in kt_amx.PROJECTIONS:
                it = projs[p]
                rows, cols = it.shape[1], it.shape[2]
                segs = _expert_segments(it, e, rows)
                nbytes = sum(_segment_bytes(ck[s.source], s) for s in segs)
                groups.append((L, e, p, rows, cols, segs, nbytes, it))

    tensors: list[PlanTensor] = []
    in_bytes: dict[str, int] = {}
    for L, e, p, rows, cols, segs, nbytes, it in groups:
        I = cols if p == "down" else rows
        H = rows if p == "down" else cols
        n, k = kt_amx.part_shape(p, H, I, parts)
        wbytes, sbytes = m.weight_bytes(n, k), 4 * n
        lead = kt_amx.tensor_name(L, p, e, 0, "weight")
        in_bytes[lead] = nbytes
        for part in range(parts):
            wname, sname = kt_amx.tensor_name(L, p, e, part, "weight"), kt_amx.tensor_name(L, p, e, part, "scale")
            if part == 0:
                tensors.append(PlanTensor(
                    name=wname, shape=(wbytes,), type=m.name, nbytes=wbytes, file=L, offset=0, segments=segs,
                    hf_name=it.hf_name, group="experts", layer=L, src_dtype=it.src_dtype, st_dtype="I8",
                    st_shape=(wbytes,), kt_pack=(m.name, p, parts, rows, cols, parts * (wbytes + sbytes))))
            else:
                tensors.append(PlanTensor(name=wname, shape=(wbytes,), type=m.name, nbytes=wbytes, file=L, offset=0,
                                          group="experts", layer=L, st_dtype="I8", st_shape=(wbytes,),
                                          written_by=lead))
            tensors.append(PlanTensor(name=sname, shape=(n,), type="F32", nbytes=sbytes, file=L, offset=0,
                                      group="experts", layer=L, st_dtype="F32", st_shape=(n,), written_by=lead))

    notes = [n for n in src.notes if "holds only routed experts" not in n]
    if "kt-amx" in src.layout.layouts:
        notes.append("the input is already kt-amx: its dequantized values are rounded to bf16 and quantized again, "
                     "which is close but not lossless; convert from the original checkpoint when you have it")
    plan = Plan(source=str(src.path), container=ck.container, arch=src.arch, model_type=src.model_type,
                format="kt-amx", recipe=kt_amx_recipe(m.name), tensors=tensors, files=[],
                notes=[*notes, LAUNCH_NOTE.format(method=m.name, parts=parts)], sources=fingerprints(ck),
                input_files=[str(f) for f in ck.files])
    plan._in_bytes = in_bytes
    _lay_out(plan, src, m, parts)
    plan.tokenizer = "not written (the launch reads it from --model-path)"
    return plan


def _lay_out(plan: Plan, src: SourceModel, m: kt_amx.Method, parts: int) -> None:

    layers = sorted({t.layer for t in plan.tensors})
    count = len(layers)
    names = {L: f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i, L in enumerate(layers)}
    meta = {"format": "kt-amx", "method": m.name, "threadpool_count": str(parts), "ktconvert_version": __version__}
    weight_map = place_shards(plan, [(names[L], [t for t in plan.tensors if t.layer == L], {**meta, "layer": str(L)})
                                     for L in layers])
    index = {"metadata": {"total_size": sum(t.nbytes for t in plan.tensors), "format": "kt-amx", "method": m.name,
                          "threadpool_count": parts}, "weight_map": weight_map}
    plan.extra["model.safetensors.index.json"] = (json.dumps(index, indent=2) + "\n").encode()
    model_dir = src.path if src.path.is_dir() else src.path.parent
    p = model_dir / "config.json"
    if src.checkpoint.container == "safetensors" and p.is_file() and p.stat().st_size < 64 * 1024**2:
        plan.extra["config.json"] = p.read_bytes()
