"""Preflight checks for a kt-kernel launch: one function per concern, each returning findings.

Everything reads headers only (config.json, GGUF and safetensors headers, file names and sizes), except the
MoE LoRA file, whose values are read to check they are finite (adapters are small). What each check guards
against is listed in ``docs/commands/preflight.md``: none of these is caught by the launch before
the weights load, some crash, some run and print garbage, some silently run without kt.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ktconvert import families
from ktconvert.diagnostics import ERROR, INFO, WARNING, Diagnostic
from ktconvert.errors import InputError
from ktconvert.formats import quantized
from ktconvert.formats.checkpoint import open_checkpoint
from ktconvert.formats.config import dims_from_hf_config, load_config
from ktconvert.formats.sniff import describe, sniff
from ktconvert.io.datafile import load_yaml, read_json
from ktconvert.formats.kt_amx_dir import header_entries, scan_ktamx_dir
from ktconvert.formats.kt_amx import parse_name as parse_ktamx_name
from ktconvert.formats.kt_amx import tensor_name
from ktconvert.kernel.methods import FP8_BLOCK, LOADER_NAMES, METHODS, RELEASE_METHOD, shape_problems, type_problems
from ktconvert.preflight.launch import (
    SGLANG_METHOD_DEFAULT,
    SGLANG_THREADPOOLS_DEFAULT,
    Launch,
    nearest_flag,
)

PROJS = ("gate", "up", "down")
# methods whose SFT (LoRA) classes exist in kt-kernel 0.7.2 (AMXBF16/AMXInt8/AMXInt4/AMXInt4_KGroup/AMXFP8/MXFP4 _SFT_MOE)
SFT_METHODS = ("BF16", "AMXINT8", "AMXINT4", "RAWINT4", "FP8", "MXFP4")
OTHER_METHODS = ("MOE_INT4", "MOE_INT8", "SYCL_GPTQ_INT4")  # valid upstream, not in the 0.7.2 wheel / not here


@dataclass
class Ctx:
    """What the checks share: the launch, typed numbers, the model's dims and the weight dir's format."""

    launch: Launch
    method: str
    threadpools: int | None
    cpuinfer: int | None
    gpu_experts: int | None
    dims: object | None = None  # ktconvert.formats.config.ModelDims
    weights_format: str | None = None  # gguf | kt-amx | kt-tree | hf | None
    ktamx: object | None = None  # KtAmxDir
    amx_bits: int | None = None


def _int(flag: str, value, out: list[Diagnostic]) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        out.append(Diagnostic("PF101", ERROR, f"{value!r} is not an integer", f"pass a whole number to {flag}", flag))
        return None


def check_flags(launch: Launch, out: list[Diagnostic]) -> Ctx:
    method = (launch.method or SGLANG_METHOD_DEFAULT).upper()
    if launch.method is None and launch.weight_path:
        out.append(Diagnostic("PF102", WARNING, f"--kt-method not given: sglang-kt uses {SGLANG_METHOD_DEFAULT}",
                              "name the method that reads your --kt-weight-path", "--kt-method"))
    if method not in METHODS and method not in OTHER_METHODS:
        near = [m for m in METHODS if m.startswith(method[:4])]
        out.append(Diagnostic("PF103", ERROR, f"unknown kt-kernel method {launch.method!r}",
                              f"use one of {', '.join(near or METHODS)}", "--kt-method"))
    elif method in OTHER_METHODS:
        out.append(Diagnostic("PF104", ERROR, f"{method} is not in the kt-kernel 0.7.2 wheel",
                              "use AMXINT4/AMXINT8 with a kt-amx dir, or LLAMAFILE with a GGUF", "--kt-method"))
    threadpools = _int("--kt-threadpool-count", launch.threadpools, out)
    if threadpools is None and launch.threadpools is None:
        threadpools = SGLANG_THREADPOOLS_DEFAULT
    cpuinfer = _int("--kt-cpuinfer", launch.cpuinfer, out)
    gpu = _int("--kt-num-gpu-experts", launch.gpu_experts, out)
    ctx = Ctx(launch, method, threadpools, cpuinfer, gpu)
    if not launch.weight_path:
        out.append(Diagnostic("PF105", ERROR, "no --kt-weight-path: kt-kernel is off for this launch",
                              "pass the CPU expert weights (kt-amx dir, GGUF, or the HF dir for BF16/FP8)",
                              "--kt-weight-path"))
    if launch.cpuinfer is None:
        out.append(Diagnostic("PF106", ERROR, "--kt-cpuinfer not given: None reaches the kt wrapper (TypeError at load, "
                              "after the model has loaded)", "pass --kt-cpuinfer N (CPU threads for the experts)",
                              "--kt-cpuinfer"))
    if launch.gpu_experts is None and launch.gpu_ratio is None:
        out.append(Diagnostic("PF107", ERROR, "neither --kt-num-gpu-experts nor --kt-gpu-experts-ratio: sglang-kt warns "
                              "and does not install the kt wrapper (the model runs without kt-kernel)",
                              "pass --kt-num-gpu-experts N (0 for all experts on the CPU)", "--kt-num-gpu-experts"))
    if gpu is not None and gpu < 0:
        out.append(Diagnostic("PF108", ERROR, f"--kt-num-gpu-experts {gpu} is negative", "pass 0 or more",
                              "--kt-num-gpu-experts"))
    if launch.gpu_ratio is not None:
        try:
            ratio = float(launch.gpu_ratio)
            if not 0.0 <= ratio <= 1.0:
                raise ValueError
        except ValueError:
            out.append(Diagnostic("PF109", ERROR, f"--kt-gpu-experts-ratio {launch.gpu_ratio!r} is not in 0..1",
                                  "pass a fraction between 0 and 1", "--kt-gpu-experts-ratio"))
    if threadpools is not None and threadpools < 1:
        out.append(Diagnostic("PF110", ERROR, f"--kt-threadpool-count {threadpools} is not positive", "pass 1 or more",
                              "--kt-threadpool-count"))
        ctx.threadpools = None
    if cpuinfer is not None and ctx.threadpools:
        if cpuinfer < ctx.threadpools:
            out.append(Diagnostic("PF111", ERROR, f"--kt-cpuinfer {cpuinfer} < --kt-threadpool-count {ctx.threadpools}: "
                                  "a threadpool would get no thread", "give every threadpool at least one thread",
                                  "--kt-cpuinfer"))
        elif cpuinfer % ctx.threadpools:
            out.append(Diagnostic("PF112", WARNING, f"--kt-cpuinfer {cpuinfer} does not divide into {ctx.threadpools} "
                                  "threadpools: the first pools get one thread more",
                                  f"use a multiple of {ctx.threadpools}", "--kt-cpuinfer"))
        cores = os.cpu_count() or 0
        if cores and cpuinfer > cores:
            out.append(Diagnostic("PF113", WARNING, f"--kt-cpuinfer {cpuinfer} is above the {cores} CPUs here",
                                  f"use at most {cores} (fewer if the GPU side needs CPU threads)", "--kt-cpuinfer"))
    if launch.numa_nodes is not None and ctx.threadpools and len(launch.numa_nodes) != ctx.threadpools:
        out.append(Diagnostic("PF114", ERROR, f"{len(launch.numa_nodes)} --kt-numa-nodes for {ctx.threadpools} threadpools",
                              "give one NUMA node per threadpool", "--kt-numa-nodes"))
    for flag in launch.unknown_flags:
        near = nearest_flag(flag)
        out.append(Diagnostic("PF115", ERROR, f"{flag} is not a flag of sglang-kt 0.7.2 (argparse refuses the launch)",
                              f"did you mean {near}?" if near else "remove it", flag))
    for pair in launch.abbreviated:
        short, full = pair.split("=")
        out.append(Diagnostic("PF117", WARNING, f"{short} is an abbreviation that argparse reads as {full}",
                              f"write {full} in full (an abbreviation breaks when a longer flag is added)", short))
    if launch.seed_flags:
        out.append(Diagnostic("PF116", WARNING, f"{', '.join(sorted(launch.seed_flags))}: seed-era MoE-LoRA flags of the "
                              "development branch; sglang-kt 0.7.2 has no such flags and refuses them",
                              "on 0.7.2 serve the converted adapter with --kt-expert-lora-path (expert-only) or "
                              "--lora-paths (merged): ktconvert convert-lora", sorted(launch.seed_flags)[0]))
    return ctx


def check_model(ctx: Ctx, out: list[Diagnostic]) -> None:

    mp = ctx.launch.model_path
    if not mp:
        out.append(Diagnostic("PF120", ERROR, "no --model-path: the model's H, I, E and MoE layers cannot be checked",
                              "pass --model-path HF_DIR (the launch needs it too)", "--model-path"))
        return
    cfg_path = Path(mp) / "config.json"
    if not cfg_path.is_file():
        out.append(Diagnostic("PF121", ERROR, "no config.json", "--model-path takes the Hugging Face model directory",
                              str(cfg_path)))
        return
    raw = load_config(cfg_path)
    dims = dims_from_hf_config(raw, str(cfg_path))
    if not (dims.hidden_size and dims.moe_intermediate_size and dims.n_experts and dims.moe_layers):
        out.append(Diagnostic("PF122", ERROR, "config.json does not give H, I, the expert count and the MoE layers",
                              "is this a MoE model's config?", str(cfg_path)))
        return
    ctx.dims = dims
    if ctx.gpu_experts is not None and ctx.gpu_experts > dims.n_experts:
        out.append(Diagnostic("PF123", ERROR, f"--kt-num-gpu-experts {ctx.gpu_experts} > the model's {dims.n_experts} "
                              "experts per layer", f"pass 0..{dims.n_experts}", "--kt-num-gpu-experts"))
    if ctx.method in METHODS and ctx.threadpools:
        for p in shape_problems(ctx.method, hidden=dims.hidden_size, inter=dims.moe_intermediate_size,
                                parts=ctx.threadpools):
            out.append(Diagnostic("PF124", ERROR, p.message, p.fix, "--kt-method"))
    _check_activation(ctx, raw, str(cfg_path), out)


def _check_activation(ctx: Ctx, raw: dict, where: str, out: list[Diagnostic]) -> None:
    """Experts with a clamped SwiGLU under a method that computes silu(gate) * up would load and run, wrong: the
    family's spec lists the methods sglang-kt passes the clamp to (``moe.activation.kt_methods``)."""
    sp = families.find(families.family_of(raw))
    act = sp.activation if sp is not None else None
    if not act or ctx.method not in METHODS or ctx.method in act.kt_methods:
        return
    limit = act.limit_in(families.text_view(raw))
    allowed = act.kt_methods
    fix = (f"launch with --kt-method {' or '.join(allowed)} on the release in that format" if allowed
           else "serve this model without kt-kernel (no kt-kernel 0.7.2 method computes its experts' activation)")
    out.append(Diagnostic("PF167", ERROR, f"{sp.family}'s experts use a clamped SwiGLU ({act.kind}, limit {limit}); "
                          f"sglang-kt 0.7.2 gives the clamp to kt-kernel only under {'/'.join(allowed) or 'no method'}, "
                          f"so {ctx.method} would compute silu(gate) * up and run with wrong outputs", fix, "--kt-method"))


def _detect_format(path: Path) -> str | None:

    if path.is_file():
        return "gguf" if path.suffix == ".gguf" else None
    if not path.is_dir():
        return None
    if any(path.glob("*.gguf")):
        return "gguf"
    st = sorted(path.rglob("*.safetensors"))
    if st:
        try:
            names = _safetensors_names(st[0])
        except Exception:
            names = []
        if any(parse_ktamx_name(n) for n in names) or any(".numa." in n for n in names):
            return "kt-amx"
        return "hf"
    if any(path.glob("_layer_*/_numa_*/*.kt")):
        return "kt-tree"
    return None


def _safetensors_names(f: Path) -> list[str]:

    return [e.name for e in header_entries(f)]


def check_weights(ctx: Ctx, out: list[Diagnostic]) -> None:
    wp = ctx.launch.weight_path
    if not wp:
        return
    path = Path(wp)
    if not path.exists():
        out.append(Diagnostic("PF130", ERROR, "the weight path does not exist", "pass the converted expert weights",
                              wp))
        return
    fmt = _detect_format(path)
    ctx.weights_format = fmt
    m = ctx.method
    want = METHODS[m].fmt if m in METHODS else None
    if fmt is None:
        out.append(Diagnostic("PF131", ERROR, "neither a GGUF, a kt-amx dir, a .kt tree nor a safetensors checkpoint",
                              "pass the directory the converter wrote", wp))
        return
    if want == "gguf" and fmt != "gguf":
        out.append(Diagnostic("PF132", ERROR, f"LLAMAFILE reads .gguf files; this is {_format_words(fmt)} "
                              "(the launch fails: no .gguf found)",
                              _method_for(fmt), wp))
        return
    if want and want.startswith("kt-amx") and fmt not in ("kt-amx", "kt-tree"):
        out.append(Diagnostic("PF133", ERROR, f"{m} reads a kt-amx directory; this is {_format_words(fmt)} "
                              "(it would look for _layer_L/_numa_N/*.kt files and fail)", _method_for(fmt), wp))
        return
    if want in ("hf-bf16", "hf-fp8", "hf-release") and fmt != "hf":
        out.append(Diagnostic("PF134", ERROR, f"{m} reads the HF checkpoint as released; this is {_format_words(fmt)}",
                              _method_for(fmt), wp))
        return
    if fmt == "gguf":
        _check_gguf(ctx, path, out)
    elif fmt == "kt-amx":
        _check_ktamx(ctx, path, out)
    elif fmt == "kt-tree":
        _check_kt_tree(ctx, path, out)
    elif fmt == "hf":
        _check_hf(ctx, path, out)


def _format_words(fmt: str) -> str:
    return {"gguf": "a GGUF", "kt-amx": "a kt-amx directory", "kt-tree": "a kt-kernel .kt tree",
            "hf": "a Hugging Face safetensors checkpoint"}[fmt]


def _method_for(fmt: str) -> str:
    return {"gguf": "use --kt-method LLAMAFILE for a GGUF",
            "kt-amx": "use --kt-method AMXINT8 or AMXINT4 (as the dir was written) for a kt-amx dir",
            "kt-tree": "use --kt-method AMXINT8 or AMXINT4 for a .kt tree",
            "hf": "use --kt-method BF16 (bf16 release), FP8 (FP8 release) or the method of its release format "
                  "(ktconvert inspect names it: MXFP4, MXFP8, RAWINT4, NVFP4, FP8_PERCHANNEL, GPTQ_INT4) for an HF "
                  "checkpoint, or convert it"}[fmt]


def _check_gguf(ctx: Ctx, path: Path, out: list[Diagnostic]) -> None:

    ck = open_checkpoint(path)
    dims = ctx.dims
    if dims is None:
        return
    e, i, h = dims.n_experts, dims.moe_intermediate_size, dims.hidden_size
    want = {"gate": (e, i, h), "up": (e, i, h), "down": (e, h, i)}
    missing, shown = [], False
    untyped: dict[str, list[str]] = {}  # a type LLAMAFILE cannot run -> the expert tensors stored in it
    for layer in sorted(dims.moe_layers):
        for p in PROJS:
            name = f"blk.{layer}.ffn_{p}_exps.weight"
            if name not in ck:
                missing.append(name)
                continue
            info = ck[name]
            if tuple(info.shape) != want[p] and not shown:
                shown = True
                out.append(Diagnostic("PF140", ERROR, f"shape {list(info.shape)} (numpy order), the config needs "
                                      f"{list(want[p])}", "convert from this --model-path (ktconvert quantize)", name))
            if ctx.method == "LLAMAFILE" and type_problems("LLAMAFILE", {p: info.dtype}):
                untyped.setdefault(info.dtype, []).append(name)
    for dtype, names in untyped.items():  # one line per type: its first tensor, how many, the closest type that runs
        proj = next(p for p in PROJS if f"_{p}_exps" in names[0])
        prob = type_problems("LLAMAFILE", {proj: dtype}, {proj: want[proj][2]})[0]
        more = f" (and {len(names) - 1} more expert tensor(s) in {dtype})" if len(names) > 1 else ""
        out.append(Diagnostic("PF141", ERROR, f"{prob.message}; the launch loads every weight and fails only once it "
                              f"serves{more}", prob.fix + " (ktconvert quantize --for kt-llamafile checks it)", names[0]))
    if missing:
        out.append(Diagnostic("PF142", ERROR, f"{len(missing)} expert tensor(s) of the MoE layers missing, first "
                              f"{missing[0]}", "convert the whole model", str(path)))


def _check_ktamx(ctx: Ctx, path: Path, out: list[Diagnostic]) -> None:

    d = scan_ktamx_dir(path)
    ctx.ktamx = d
    parts = d.parts
    if len(parts) > 1:
        out.append(Diagnostic("PF150", ERROR, f"layers were written for different numa part counts {sorted(parts)}",
                              "write the whole directory with one threadpool count", str(path)))
    p_disk = max(parts) if parts else 0
    if ctx.threadpools and p_disk and p_disk != ctx.threadpools:
        what = ("runs and prints garbage (measured rel. error 1.35)" if ctx.threadpools < p_disk
                else "crashes (segfault) at load")
        out.append(Diagnostic("PF151", ERROR, f"the dir holds {p_disk} numa part(s) per expert, --kt-threadpool-count is "
                              f"{ctx.threadpools}: kt-kernel does not check this and {what}",
                              f"launch with --kt-threadpool-count {p_disk}, or convert again for {ctx.threadpools}",
                              "--kt-threadpool-count"))
    dims = ctx.dims
    if dims is None:
        return
    bits = d.bits(dims.hidden_size, dims.moe_intermediate_size)
    ctx.amx_bits = bits
    name_hint = next((b for b in (8, 4) if f"INT{b}" in path.name.upper()), None)
    if bits is None:
        out.append(Diagnostic("PF152", ERROR, "expert tensor sizes fit neither INT8 nor INT4 for this model's H and I",
                              "pass the kt-amx dir converted from this --model-path", str(path)))
    elif ctx.method in ("AMXINT8", "AMXINT4") and int(ctx.method[-1]) != bits:
        what = ("crashes (segfault)" if bits == 4 else "runs and prints garbage (measured rel. error 3.0)")
        out.append(Diagnostic("PF153", ERROR, f"an INT{bits} kt-amx dir under --kt-method {ctx.method}: kt-kernel {what}",
                              f"use --kt-method AMXINT{bits}, or the INT{8 if bits == 4 else 4} conversion",
                              "--kt-method"))
    if bits is not None and name_hint is not None and name_hint != bits:
        out.append(Diagnostic("PF154", WARNING, f"the directory name says INT{name_hint} but the tensors are INT{bits}",
                              "rename the directory after what it holds", str(path)))
    if p_disk:
        missing = []
        for layer in sorted(dims.moe_layers):
            missing += d.missing(layer, dims.n_experts, p_disk)
        extra = sorted(set(d.layers) - set(dims.moe_layers))
        if missing:
            out.append(Diagnostic("PF155", ERROR, f"{len(missing)} kt-amx tensor(s) missing, first {missing[0]}",
                                  "the conversion is incomplete: write it again", str(path)))
        if extra:
            out.append(Diagnostic("PF156", WARNING, f"layers {extra} are not MoE layers of this model",
                                  "is this the conversion of --model-path?", str(path)))
        _check_ktamx_sizes(ctx, d, p_disk, bits, out)


def _check_ktamx_sizes(ctx: Ctx, d, parts: int, bits: int | None, out: list[Diagnostic]) -> None:
    """dtype and byte size of every tensor: the C++ copies fixed sizes without checking the lengths."""
    dims = ctx.dims
    h, i = dims.hidden_size, dims.moe_intermediate_size
    if bits is None or i % parts:
        return

    ip = i // parts
    weight = {p: ((ip if p != "down" else h) * (h if p != "down" else ip) * bits // 8, "I8") for p in PROJS}
    scale = {p: ((ip if p != "down" else h) * 4, "F32") for p in PROJS}
    bad = [(name, dtype, nbytes) for la in d.layers.values() for name, (dtype, nbytes, _f) in la.tensors.items()
           if (dtype != (want := (weight if name.kind == "weight" else scale)[name.proj])[1] or nbytes != want[0])]
    if bad:
        name, dtype, nbytes = min(bad)
        want = (weight if name.kind == "weight" else scale)[name.proj]
        out.append(Diagnostic("PF157", ERROR, f"{dtype}, {nbytes} bytes; INT{bits} with {parts} part(s) needs "
                              f"{want[1]}, {want[0]} bytes", "the tensor was written for another shape: convert again",
                              tensor_name(*name)))


def _check_kt_tree(ctx: Ctx, path: Path, out: list[Diagnostic]) -> None:
    numa = {p.name for p in path.glob("_layer_*/_numa_*")}
    parts = len(numa)
    kinds = {f.name.split("_", 1)[0] for f in path.glob("_layer_*/_numa_*/*.kt")}
    if ctx.threadpools and parts != ctx.threadpools:
        out.append(Diagnostic("PF151", ERROR, f"the .kt tree has {parts} numa part(s), --kt-threadpool-count is "
                              f"{ctx.threadpools}", f"launch with --kt-threadpool-count {parts}", "--kt-threadpool-count"))
    if ctx.method in ("AMXINT8", "AMXINT4") and kinds and kinds != {ctx.method[3:]}:
        out.append(Diagnostic("PF153", ERROR,
                              f"a .kt tree of {'/'.join(sorted(kinds))} files under --kt-method {ctx.method}",
                              f"use --kt-method AMX{sorted(kinds)[0]}", "--kt-method"))


_LAYER_OF = re.compile(r"^(?:model\.|language_model\.model\.|model\.language_model\.)?layers\.(\d+)\.")


def _check_hf(ctx: Ctx, path: Path, out: list[Diagnostic]) -> None:

    ck = open_checkpoint(path)
    try:
        qmap = quantized.analyze(ck)
    except InputError:
        qmap = None  # a declared block size that is no block: the FP8 checks below still name the problem
    companions = qmap.scales if qmap is not None else {}
    experts = {n: info for n, info in ck.items() if ".experts." in n and not n.endswith("_scale_inv")
               and n not in companions}
    if not experts:
        out.append(Diagnostic("PF160", ERROR, "no expert tensors (…experts…) in this checkpoint",
                              "pass the MoE checkpoint", str(path)))
        return
    dtypes = {info.dtype for info in experts.values() if info.name.endswith("weight") or "proj" in info.name}
    if ctx.method == "BF16" and dtypes != {"BF16"}:
        out.append(Diagnostic("PF161", ERROR, f"BF16 reads bf16 experts; these are {'/'.join(sorted(dtypes))}",
                              "use the bf16 release, or convert (ktconvert quantize) for LLAMAFILE", str(path)))
    fmts = sorted({qmap.weights[n].fmt for n in experts if n in qmap.weights}) if qmap is not None else []
    if ctx.method == "FP8":
        if "F8_E4M3" not in dtypes or not any(n.endswith("_scale_inv") for n in ck) or fmts not in ([], ["FP8"]):
            out.append(Diagnostic("PF162", ERROR, "FP8 reads F8_E4M3 experts with weight_scale_inv block scales; "
                                  f"these are {'/'.join(fmts or sorted(dtypes))}",
                                  _release_fix(fmts, "use the FP8 release"), str(path)))
        elif qmap is not None:
            blocks = sorted({tuple(qmap.weights[n].block) for n in experts if n in qmap.weights})
            if blocks and blocks != [(FP8_BLOCK, FP8_BLOCK)]:
                out.append(Diagnostic("PF166", ERROR, f"FP8 reads {FP8_BLOCK}x{FP8_BLOCK} weight blocks; these experts "
                                      f"have {', '.join(f'{a}x{b}' for a, b in blocks)} (its kernels would misread them)",
                                      "convert (ktconvert quantize --to kt-amx, or to GGUF for LLAMAFILE)", str(path)))
    _check_release(ctx, path, experts, fmts, out)
    if ctx.dims is not None:
        # model.layers.L, a multimodal wrapper's language model (MiniMax-M3: language_model.model.layers.L) or
        # DeepSeek-V4's native layers.L
        layers = {int(m.group(1)) for m in map(_LAYER_OF.match, experts) if m}
        lacking = sorted(set(ctx.dims.moe_layers) - layers)
        if lacking:
            out.append(Diagnostic("PF163", ERROR, f"MoE layers {lacking[:5]} have no expert tensors",
                                  "pass the whole checkpoint", str(path)))




def _release_fix(fmts: list[str], default: str) -> str:
    methods = [RELEASE_METHOD[f] for f in fmts if f in RELEASE_METHOD]
    return f"use --kt-method {methods[0]} (reads {fmts[0]} as released)" if len(methods) == 1 and len(fmts) == 1 \
        else default


def _check_release(ctx: Ctx, path: Path, experts: dict, fmts: list[str], out: list[Diagnostic]) -> None:
    """A release-format method needs experts of exactly its format (and, for MXFP4/MXFP8, the names its loader
    reads); a method that reads no release format is not pointed at quantized release experts."""
    m = METHODS.get(ctx.method)
    if m is None or m.name in ("BF16", "FP8"):
        return  # PF161 / PF162 name what the experts are
    if m.release:
        if fmts != [m.release]:
            out.append(Diagnostic("PF164", ERROR, f"{m.name} reads {m.release} experts as released; these are "
                                  f"{'/'.join(fmts) or '/'.join(sorted({i.dtype for i in experts.values()}))}",
                                  _release_fix(fmts, "pass the release of that format, or convert (ktconvert quantize)"),
                                  str(path)))
        elif m.name in LOADER_NAMES and not any(LOADER_NAMES[m.name][0] in n for n in experts):
            out.append(Diagnostic("PF165", ERROR, f"kt-kernel's {m.name} loader finds experts only under "
                                  f"{LOADER_NAMES[m.name][1]}; these experts have other names (it fails: no experts)",
                                  "pass the release as published, or convert (ktconvert quantize --to kt-amx)", str(path)))
    elif fmts and m.fmt.startswith("hf"):
        out.append(Diagnostic("PF164", ERROR, f"{m.name} does not read {'/'.join(fmts)} experts",
                              _release_fix(fmts, "convert (ktconvert quantize)"), str(path)))


def check_lora(ctx: Ctx, out: list[Diagnostic]) -> None:
    lc = ctx.launch
    if lc.kt_lora_path and lc.expert_lora_path and lc.kt_lora_path != lc.expert_lora_path:
        out.append(Diagnostic("PF170", ERROR, "--kt-lora-path and --kt-expert-lora-path point to different adapters",
                              "pass one: --kt-expert-lora-path (--kt-lora-path is its deprecated alias)", "--kt-lora-path"))
    expert = lc.expert_lora_path or lc.kt_lora_path
    if expert:
        flag = "--kt-expert-lora-path" if lc.expert_lora_path else "--kt-lora-path"
        if _check_expert_adapter(ctx, Path(expert), flag, out):
            _check_adapter_content(ctx, Path(expert), out)
        if lc.lora_paths:
            out.append(Diagnostic("PF171", ERROR, "--kt-expert-lora-path cannot be combined with --lora-paths",
                                  "serve a merged adapter with --lora-paths alone, or the expert-only one alone",
                                  "--lora-paths"))
    for entry in lc.lora_paths or []:
        p = Path(entry.split("=", 1)[-1])
        if p.is_file():
            out.append(Diagnostic("PF174", ERROR, f"{p} is a file; --lora-paths expects an adapter directory",
                                  "pass the directory holding adapter_config.json", "--lora-paths"))
        elif (p / "fused_expert_lora.safetensors").is_file() and _native_manifest(p) is None:
            out.append(Diagnostic("PF175", ERROR, f"{p} is a raw KT training adapter (fused_expert_lora.safetensors)",
                                  "convert it first: ktconvert convert-lora RAW OUT", "--lora-paths"))
        elif (p / "adapter_model.safetensors").is_file() and not _not_safetensors(p / "adapter_model.safetensors", out):
            names = _safetensors_names(p / "adapter_model.safetensors")
            if names and all(_is_expert_key(n) for n in names):
                out.append(Diagnostic("PF203", ERROR, f"{p} is an expert-only adapter: sglang-kt refuses it through "
                                      "--lora-paths (no non-expert tensors)",
                                      "pass it with --kt-expert-lora-path and --kt-weight-path", "--lora-paths"))
            elif any(_is_expert_key(n) for n in names):
                _check_adapter_content(ctx, p, out)
    if expert or (lc.lora_paths and lc.weight_path):
        _check_lora_serving(ctx, out)
    if lc.moe_lora_path:
        _check_stacked_lora(ctx, Path(lc.moe_lora_path), out)
    if lc.moe_sft_method:
        sft = lc.moe_sft_method.upper()
        if sft not in SFT_METHODS:
            out.append(Diagnostic("PF176", ERROR,
                                  f"--kt-moe-sft-method {lc.moe_sft_method}: kt-kernel has no SFT path for it",
                                  f"use one of {', '.join(SFT_METHODS)}", "--kt-moe-sft-method"))
        elif ctx.weights_format and METHODS[sft].fmt.split("-int")[0] != _family(ctx):
            out.append(Diagnostic("PF177", ERROR, f"--kt-moe-sft-method {sft} reads {METHODS[sft].reads}; the weights are "
                                  f"{_format_words(ctx.weights_format)}", _method_for(ctx.weights_format),
                                  "--kt-moe-sft-method"))
        elif sft in ("AMXINT8", "AMXINT4") and ctx.amx_bits and int(sft[-1]) != ctx.amx_bits:
            out.append(Diagnostic("PF177", ERROR, f"--kt-moe-sft-method {sft} on an INT{ctx.amx_bits} kt-amx dir",
                                  f"use AMXINT{ctx.amx_bits}", "--kt-moe-sft-method"))


def _is_expert_key(name: str) -> bool:
    """sglang-kt's own split rule (``docs/commands/convert-lora.md``): an expert key names .mlp.experts. and a gate/up/down_proj."""
    return ".mlp.experts." in name and any(f".{p}_proj." in name for p in PROJS)


def _native_manifest(p: Path):
    from ktconvert.convert.lora_read import native_format

    try:
        return native_format(p)
    except InputError:
        return None


def _check_lora_serving(ctx: Ctx, out: list[Diagnostic]) -> None:
    """What an expert-LoRA launch needs besides the adapter (``docs/commands/preflight.md``): every expert on the CPU, at least
    two running requests, an SFT-capable method given by its inference name, and the weights in the form that SFT
    method reads."""
    lc = ctx.launch
    if ctx.gpu_experts not in (None, 0):
        out.append(Diagnostic("PF172", ERROR, f"expert LoRA needs --kt-num-gpu-experts 0, not {ctx.gpu_experts}",
                              "pass --kt-num-gpu-experts 0", "--kt-num-gpu-experts"))
    elif lc.gpu_ratio not in (None, "0", "0.0") and ctx.gpu_experts is None:
        out.append(Diagnostic("PF172", ERROR, f"expert LoRA needs every expert on the CPU, not --kt-gpu-experts-ratio "
                              f"{lc.gpu_ratio}", "pass --kt-num-gpu-experts 0", "--kt-gpu-experts-ratio"))
    mrr = _int("--max-running-requests", lc.max_running_requests, out)
    if mrr is not None and mrr < 2:
        out.append(Diagnostic("PF197", ERROR, f"--max-running-requests {mrr}: sglang-kt's LoRA serving needs at least 2",
                              "pass --max-running-requests 2 or more", "--max-running-requests"))
    raw = (lc.method or "").upper()
    if raw.endswith("_SFT"):
        name = {"AMXBF16_SFT": "BF16", "AMXINT8_SFT": "AMXINT8", "AMXINT4_SFT": "AMXINT4"}.get(raw, raw[:-4])
        out.append(Diagnostic("PF198", ERROR, f"--kt-method {lc.method}: sglang-kt 0.7.2 takes the inference name and maps "
                              "it to the SFT method itself; it refuses *_SFT names", f"pass --kt-method {name}",
                              "--kt-method"))
    elif ctx.method not in SFT_METHODS:
        out.append(Diagnostic("PF173", ERROR, f"expert LoRA runs through kt-kernel's SFT path, which {ctx.method} has not",
                              f"use one of {', '.join(SFT_METHODS)} with the weights it reads", "--kt-method"))
    if ctx.method == "AMXINT8" and ctx.weights_format == "kt-amx":
        out.append(Diagnostic("PF199", ERROR, "kt-kernel's INT8 SFT method reads only the persistent .kt tree "
                              "(kt-weight-manifest.json), never merged kt-amx safetensors",
                              "write it: ktconvert quantize MODEL OUT --to kt-amx --type AMXINT8 --form kt-tree",
                              lc.weight_path))
    elif ctx.method == "AMXINT8" and ctx.weights_format == "kt-tree":
        from ktconvert.formats.kt_tree import check_kt_tree

        try:
            tree = check_kt_tree(lc.weight_path)
        except InputError as exc:
            out.append(Diagnostic("PF204", ERROR, f"kt-kernel's validator would refuse the tree: {exc.message}",
                                  exc.fix or "write the tree again", exc.path or lc.weight_path))
        else:
            dims = ctx.dims
            if dims is not None and (tree.experts, tree.hidden, tree.intermediate) != \
                    (dims.n_experts, dims.hidden_size, dims.moe_intermediate_size):
                out.append(Diagnostic("PF204", ERROR, f"the tree holds E={tree.experts} H={tree.hidden} "
                                      f"I={tree.intermediate}, the model E={dims.n_experts} H={dims.hidden_size} "
                                      f"I={dims.moe_intermediate_size}", "write the tree from this model",
                                      lc.weight_path))


def _check_adapter_content(ctx: Ctx, p: Path, out: list[Diagnostic]) -> None:
    """convert-lora's checks (NaN, no effect, ranks, stray keys, PEFT options, F32, manifest, and against the model:
    every MoE layer, E, H, I) on the adapter the launch serves; alpha missing from its config is served as r."""
    from ktconvert.convert.lora_checks import check_adapter, resolve_alpha
    from ktconvert.convert.lora_read import read_adapter

    try:
        ad = read_adapter(p)
    except InputError as exc:
        out.append(Diagnostic("PF210", ERROR, exc.message, exc.fix or "convert it with ktconvert convert-lora",
                              f"{exc.path}:{exc.where}" if exc.where else (exc.path or str(p))))
        return
    alpha, found = resolve_alpha(ad, None)
    found += check_adapter(ad, alpha=alpha, dims=ctx.dims)
    out.extend(replace(f, id="PF210" if f.severity == ERROR else "PF211", where=f"{p.name}/{f.where}") for f in found)
    if "lora_alpha" not in ad.config:
        out.append(Diagnostic("PF212", ERROR, f"adapter_config.json has no lora_alpha: sglang-kt serves it with alpha = r "
                              f"= {ad.rank}, whatever it was trained with", "write the training alpha into it "
                              "(ktconvert convert-lora --lora-alpha A)", f"{p.name}/adapter_config.json:lora_alpha"))


def _family(ctx: Ctx) -> str:
    fmt = ctx.weights_format
    return {"kt-amx": "kt-amx", "kt-tree": "kt-amx", "gguf": "gguf"}.get(fmt, "hf")


def _check_expert_adapter(ctx: Ctx, p: Path, flag: str, out: list[Diagnostic]) -> bool:
    """Form checks of sglang-kt's own on the directory ``flag`` names; True when it is an expert-only adapter worth
    reading. A finding about the flag's value is placed at the flag (``error PFnnn --flag: PATH ...``)."""
    if not ctx.launch.weight_path:
        out.append(Diagnostic("PF178", ERROR, f"{flag} needs --kt-weight-path", "pass the expert weights", flag))
    if p.is_file():
        out.append(Diagnostic("PF179", ERROR, f"{p} is a file; pass the converted expert adapter directory",
                              "ktconvert convert-lora writes it", flag))
        return False
    if (p / "fused_expert_lora.safetensors").is_file():
        out.append(Diagnostic("PF175", ERROR, f"{p} is a raw KT training adapter (fused_expert_lora.safetensors)",
                              "convert it first: ktconvert convert-lora RAW OUT --expert-only --base-model MODEL", flag))
        return False
    model = p / "adapter_model.safetensors"
    if not (p / "adapter_config.json").is_file() or not model.is_file():
        out.append(Diagnostic("PF180", ERROR, f"{p} must contain adapter_config.json and adapter_model.safetensors",
                              "pass the converted adapter directory", flag))
        return False
    if _not_safetensors(model, out):
        return False
    names = _safetensors_names(model)
    expert = [n for n in names if ".mlp.experts." in n and any(f".{x}_proj." in n for x in PROJS)]
    if not expert:
        out.append(Diagnostic("PF181", ERROR, "contains no converted per-expert gate_proj/up_proj/down_proj tensors",
                              "convert the adapter for kt (ktconvert convert-lora)", str(model)))
        return False
    if len(expert) != len(names):
        out.append(Diagnostic("PF182", ERROR, "holds non-expert tensors too: --kt-expert-lora-path expects an expert-only "
                              "adapter", "pass the merged adapter through --lora-paths instead", str(model)))
        return False
    return True


def _not_safetensors(f: Path, out: list[Diagnostic]) -> bool:

    with open(f, "rb") as fh:
        kind = sniff(fh.read(16))
    if kind in ("pickle", "zip"):
        out.append(Diagnostic("PF183", ERROR, f"is {describe(kind)} under a .safetensors name (the launch fails with "
                              "'header too large')", "save it with safetensors.torch.save_file (never load pickles "
                              "you did not write)", str(f)))
        return True
    return False


def _check_stacked_lora(ctx: Ctx, f: Path, out: list[Diagnostic]) -> None:
    """The seed-era ``--kt-moe-lora-path``: kt-kernel's stacked file ``layers.L.experts.{p}_lora_{a,b}``."""

    if not f.is_file():
        out.append(Diagnostic("PF184", ERROR, "no such file", "pass the stacked MoE LoRA .safetensors", str(f)))
        return
    if _not_safetensors(f, out):
        return
    try:  # kt-kernel writes this file in BF16, which numpy's safetensors reader cannot load: decode it ourselves
        ck = open_checkpoint(f)
        tensors = {n: ck.read_float32(n) for n in ck}
    except InputError as exc:
        out.append(Diagnostic("PF185", ERROR, f"not a readable safetensors file: {exc.message}", "write it again", str(f)))
        return
    key = re.compile(r"^layers\.(\d+)\.experts\.(gate|up|down)_lora_(a|b)$")
    found: dict[tuple[int, str, str], tuple] = {}
    stray = []
    for name, arr in tensors.items():
        m = key.match(name)
        if m is None:
            stray.append(name)
        else:
            found[(int(m.group(1)), m.group(2), m.group(3))] = arr
    if not found:
        out.append(Diagnostic("PF186", ERROR, "not kt-kernel's stacked MoE LoRA form (layers.L.experts.{gate,up,down}_lora_"
                              "{a,b})", "convert it: ktconvert convert-lora", str(f)))
        return
    if stray:
        out.append(Diagnostic("PF187", WARNING, f"{len(stray)} tensor(s) outside the stacked form, first {stray[0]}",
                              "remove them (the kernel ignores them)", str(f)))
    ranks = {arr.shape[1] for (_, p, ab), arr in found.items() if ab == "a" and arr.ndim == 3}
    rank = _int("--kt-moe-lora-rank", ctx.launch.moe_lora_rank, out)
    if len(ranks) > 1:
        out.append(Diagnostic("PF188", ERROR, f"tensors disagree on the rank: {sorted(ranks)}", "write it again", str(f)))
    elif rank is not None and ranks and rank not in ranks:
        out.append(Diagnostic("PF189", ERROR, f"--kt-moe-lora-rank {rank}, the file's rank is {ranks.pop()}",
                              "pass the adapter's rank", "--kt-moe-lora-rank"))
    r = rank if rank is not None else (min(ranks) if ranks else None)
    dims = ctx.dims
    if dims is not None and r is not None:
        e, h, i = dims.n_experts, dims.hidden_size, dims.moe_intermediate_size
        want = {("gate", "a"): (e, r, h), ("up", "a"): (e, r, h), ("gate", "b"): (e, i, r), ("up", "b"): (e, i, r),
                ("down", "a"): (e, r, i), ("down", "b"): (e, h, r)}
        for layer in sorted(dims.moe_layers):
            for (p, ab), shape in want.items():
                arr = found.get((layer, p, ab))
                name = f"layers.{layer}.experts.{p}_lora_{ab}"
                if arr is None:
                    out.append(Diagnostic("PF190", ERROR, "missing: the server raises KeyError at load",
                                          "train or convert the adapter for every MoE layer", name))
                    return
                if tuple(arr.shape) != shape:
                    out.append(Diagnostic("PF191", ERROR, f"shape {list(arr.shape)}, the model needs {list(shape)} "
                                          "([E, r, H] / [E, I, r] / [E, r, I] / [E, H, r])",
                                          "is this the adapter of --model-path?", name))
                    return

    for (layer, p, ab), arr in sorted(found.items()):
        if not np.all(np.isfinite(arr.astype(np.float32))):
            out.append(Diagnostic("PF192", ERROR, "holds NaN/Inf (nothing in the stack checks this)",
                                  "the training diverged: use an earlier checkpoint",
                                  f"layers.{layer}.experts.{p}_lora_{ab}"))
            break
    cfg_path = f.parent / "adapter_config.json"
    if cfg_path.is_file():
        try:
            cfg = read_json(cfg_path, "adapter_config.json")
        except InputError as exc:
            out.append(Diagnostic("PF193", ERROR, exc.message, "fix the adapter config", str(cfg_path)))
            return
        cr, ca = cfg.get("r"), cfg.get("lora_alpha")
        if r is not None and isinstance(cr, int) and cr != r:
            out.append(Diagnostic("PF194", ERROR, f"adapter_config.json r = {cr}, the launch/file rank is {r}",
                                  "pass the rank the adapter was trained with", "--kt-moe-lora-rank"))
        alpha = ctx.launch.moe_lora_alpha
        if alpha is not None and isinstance(ca, (int, float)):
            try:
                if float(alpha) != float(ca):
                    out.append(Diagnostic("PF195", ERROR, f"--kt-moe-lora-alpha {alpha}, adapter_config.json lora_alpha = "
                                          f"{ca}: the scaling alpha/r would differ from training",
                                          f"pass --kt-moe-lora-alpha {ca}", "--kt-moe-lora-alpha"))
            except ValueError:
                out.append(Diagnostic("PF101", ERROR, f"{alpha!r} is not a number", "pass a number",
                                      "--kt-moe-lora-alpha"))
    elif ctx.launch.moe_lora_alpha is None:
        out.append(Diagnostic("PF196", WARNING, "no --kt-moe-lora-alpha and no adapter_config.json: alpha defaults to r",
                              "pass the alpha the adapter was trained with", "--kt-moe-lora-alpha"))


_BACKENDS = {"llamafile": "LLAMAFILE", "amxint8": "AMXINT8", "amxint4": "AMXINT4", "amxbf16": "BF16"}


def check_rules(ctx: Ctx, rules: str, out: list[Diagnostic]) -> None:
    """The rule file's CPU experts ``backend`` kwarg names the same kernel method as the launch."""
    try:
        data = load_yaml(rules).data
    except InputError as exc:
        out.append(Diagnostic("PF200", ERROR, f"cannot read the rule file: {exc.message}",
                              "check it with ktconvert check-rules", rules))
        return
    seen = set()
    for i, rule in enumerate(data if isinstance(data, list) else []):
        kwargs = ((rule or {}).get("replace") or {}).get("kwargs") or {}
        backend = kwargs.get("backend")
        if isinstance(backend, str):
            seen.add((i, backend))
    for i, backend in sorted(seen):
        method = _BACKENDS.get(backend.lower())
        if method and ctx.method in METHODS and method != ctx.method:
            out.append(Diagnostic("PF201", ERROR, f"rule {i} runs the CPU experts with backend {backend} ({method}), the "
                                  f"launch with --kt-method {ctx.method}", "make the rule file and the launch agree",
                                  f"{rules}:rule {i}"))


def run_checks(launch: Launch, rules: str | None = None) -> list[Diagnostic]:
    """Every finding for ``launch`` (and the rule file, if given), in check order."""
    out: list[Diagnostic] = []
    ctx = check_flags(launch, out)
    check_model(ctx, out)
    if ctx.method in METHODS or ctx.method in OTHER_METHODS:
        check_weights(ctx, out)
    check_lora(ctx, out)
    if rules:
        check_rules(ctx, rules, out)
    return out


__all__ = ["run_checks"]
