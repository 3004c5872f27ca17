"""Everything ``ktconvert inspect`` shows, as plain JSON-ready data (``schemas/inspect-report.schema.json``)."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from ktconvert import __version__
from ktconvert.diagnostics import Diagnostic
from ktconvert.errors import InputError, UsageProblem
from ktconvert.io.userregex import FIX as USER_REGEX_FIX, backtracking_risk
from ktconvert.formats.checkpoint import open_checkpoint
from ktconvert.formats.config import dims_from_hf_config, load_config
from ktconvert.formats.kt_tree import check_kt_tree, is_kt_tree
from ktconvert.formats.fp8 import DEFAULT_BLOCK, Fp8Map
from ktconvert.formats.quantized import QuantMap, analyze as analyze_quant, describe
from ktconvert.formats.layout import LayerLayout, detect_layout, is_type_companion, problem
from ktconvert.formats.scan import scan_checkpoint

MAX_LISTED_TENSORS = 50  # per problem, so that one broken layer of 256 experts does not drown the report

_SCAN_SEVERITY = {"nan": ("nan", "error"), "inf": ("inf", "error"), "all-zero": ("zero-expert", "warning"),
                  **{f"scale-{k}": ("fp8-scale-values", "error") for k in ("nan", "inf", "zero", "negative")}}
_SCALE_WHAT = {"scale-nan": "NaN scale(s)", "scale-inf": "Inf scale(s)", "scale-zero": "zero scale(s) (the block "
               "decodes to zeros)", "scale-negative": "negative scale(s) (a scale is a magnitude)"}


def compile_tensor_filter(pattern: str | None) -> re.Pattern | None:
    if pattern is None:
        return None
    try:
        compiled = re.compile(pattern)
    except re.error as exc:
        raise UsageProblem(f"--tensors {pattern!r} is not a valid regex: {exc}", fix="fix the pattern") from None
    risk = backtracking_risk(pattern)
    if risk is not None:
        raise UsageProblem(f"--tensors {pattern!r} has {risk}: matching it against the tensor names could run for "
                           "hours", fix=USER_REGEX_FIX)
    return compiled


def build_inspect_report(
    path: str | Path,
    config: str | Path | None = None,
    tensors: str | None = None,
    scan: bool = False,
    progress_factory: Callable[[int], Callable[[int], None]] | None = None,
) -> dict:
    """Open ``path``, detect its layout and (with ``scan``) read its data; return the report as a dict.

    ``tensors`` is a regex (``re.search``) selecting the tensors listed in the report and scanned; without it no
    tensor list is included and every tensor is scanned. ``progress_factory(total_bytes)`` returns the callback the
    scan reports progress to.
    """
    if is_kt_tree(path):
        return kt_tree_report(path, config)
    selector = compile_tensor_filter(tensors)
    ck = open_checkpoint(path)
    lay = detect_layout(ck, config)
    fp8, fp8_problems = _fp8(ck, config)
    selected = [n for n in ck if selector.search(n)] if selector else None

    problems = list(lay.all_problems) + fp8_problems
    scan_part = None
    if scan:
        names = selected if selected is not None else list(ck)
        total = sum(ck[n].nbytes for n in names)
        progress = progress_factory(total) if progress_factory else None
        result = scan_checkpoint(ck, names, lay.matches, progress, fp8=fp8)
        scan_part = {
            "scanned_tensors": result.scanned_tensors,
            "scanned_bytes": result.scanned_bytes,
            "findings": [
                {"kind": f.kind, "tensor": f.tensor, "expert": f.expert, "count": f.count} for f in result.findings
            ],
            "skipped": [{"tensor": t, "why": why} for t, why in result.skipped],
        }
        for f in result.findings:
            kind, severity = _SCAN_SEVERITY[f.kind]
            what = f"{f.count} NaN value(s)" if f.kind == "nan" else f"{f.count} Inf value(s)" if f.kind == "inf" else \
                f"{f.count} {_SCALE_WHAT[f.kind]}" if f.kind in _SCALE_WHAT else "all zeros"
            m = lay.matches.get(f.tensor) or lay.matches.get(fp8.scales.get(f.tensor, ""))
            problems.append(problem(kind, severity, f"{f.where}: {what}", m.layer if m else None, (f.tensor,)))

    dims = lay.dims
    quant: dict[str, dict] = {}
    groups: dict[str, dict] = {}
    for name, info in ck.items():
        q = quant.setdefault(info.dtype, {"tensors": 0, "bytes": 0})
        q["tensors"] += 1
        q["bytes"] += info.nbytes
        m = lay.matches.get(name)
        g = groups.setdefault(m.group if m else "fp8_scales" if name in fp8.scales or name in ck.packed_parts else
                              "ggml_types" if is_type_companion(ck, name) else "unknown",
                              {"tensors": 0, "bytes": 0})
        g["tensors"] += 1
        g["bytes"] += info.nbytes

    code = exit_code(problems)
    report = {
        "tool": "ktconvert inspect",
        "version": __version__,
        "status": "ok" if code == 0 else "fail",
        "exit_code": code,
        "path": str(path),
        "container": ck.container,
        "gguf_version": ck.gguf_version,
        "files": [{"path": str(f), "bytes": f.stat().st_size} for f in ck.files],
        "n_tensors": len(ck),
        "total_bytes": ck.total_bytes,
        "architecture": {"arch": lay.arch, "source": lay.arch_source, "model_type": dims.model_type},
        "config": {
            "source": dims.source,
            "hidden_size": dims.hidden_size,
            "moe_intermediate_size": dims.moe_intermediate_size,
            "n_experts": dims.n_experts,
            "n_experts_used": dims.n_experts_used,
            "n_shared_experts": dims.n_shared_experts,
            "n_layers": dims.n_layers,
            # the layers the config gives a dense MLP instead of experts (None: it does not say)
            "dense_layers": (None if dims.moe_layers is None or dims.n_layers is None
                             else [i for i in range(dims.n_layers) if i not in dims.moe_layers]),
        },
        "n_layers": lay.n_layers,
        "layouts": sorted(lay.layouts),
        "layers": [_layer(ly) for ly in lay.layers],
        "quant_types": dict(sorted(quant.items(), key=lambda kv: -kv[1]["bytes"])),
        "groups": dict(sorted(groups.items(), key=lambda kv: -kv[1]["bytes"])),
        "problems": [_problem(p) for p in problems],
        "fp8": fp8.fp8.summary() if fp8.fp8 else None,
        "quantized": _quant_summary(ck, fp8) if fp8.weights else None,
        "scan": scan_part,
    }
    if selected is not None:
        report["tensors"] = [_tensor(ck[n], lay.matches.get(n), fp8) for n in selected]
    return report


def kt_tree_report(path, config=None) -> dict:
    """kt-kernel's persistent INT8 tree: its manifest and every file checked (names, sizes, sha256, inventory), and
    with ``config`` E, H, I and the MoE layers against the model."""
    tree = check_kt_tree(path)
    problems = []
    if config is not None:
        dims = dims_from_hf_config(load_config(config), str(config))
        for what, got, want in (("expert_num", tree.experts, dims.n_experts), ("hidden_size", tree.hidden,
                                dims.hidden_size), ("intermediate_size", tree.intermediate, dims.moe_intermediate_size)):
            if want is not None and got != want:
                problems.append({"kind": "kt-tree-geometry", "severity": "error", "message": f"{what} {got}, the "
                                 f"model's config says {want}", "layer": None, "tensors": []})
        if dims.moe_layers is not None and set(dims.moe_layers) != set(tree.layers):
            problems.append({"kind": "kt-tree-layers", "severity": "error", "message": f"layers {tree.layers}, the "
                             f"model's MoE layers are {sorted(dims.moe_layers)}", "layer": None, "tensors": []})
    code = 1 if problems else 0
    return {"tool": "ktconvert inspect", "version": __version__, "status": "ok" if code == 0 else "fail",
            "exit_code": code, "path": str(path), "container": "kt-tree",
            "kt_tree": {"schema_version": 2, "layout": tree.manifest["layout"], "layers": tree.layers,
                        "experts": tree.experts, "hidden_size": tree.hidden, "intermediate_size": tree.intermediate,
                        "threadpool_count": tree.parts, "files": tree.files, "bytes": tree.bytes,
                        "hashes": "verified"},
            "problems": problems}


def exit_code(problems: list[Diagnostic]) -> int:
    """1 when any problem is an error (a scan's NaN/Inf included), else 0; warnings and notes do not fail."""
    return 1 if any(p.severity == "error" for p in problems) else 0


def _layer(ly: LayerLayout) -> dict:
    return {
        "layer": ly.layer,
        "layout": ly.layout,
        "n_experts": ly.n_experts,
        "intermediate": ly.intermediate,
        "hidden": ly.hidden,
        "orientation": ly.orientation,
        "quant": ly.quant,
        "numa_parts": ly.numa_parts,
        "projections": {
            p: {
                "tensors": len(info.tensors),
                "dtypes": list(info.dtypes),
                "numpy_shape": list(info.shape) if info.shape is not None else None,
                "ggml_ne": list(info.ne) if info.ne is not None else None,
                "bytes": info.nbytes,
            }
            for p, info in sorted(ly.projections.items())
        },
        "router": ly.router,
        "score_bias": ly.score_bias,
        "shared_experts": list(ly.shared_experts),
    }


def _problem(p: Diagnostic) -> dict:
    """A layout problem in inspect's JSON (``schemas/inspect-report.schema.json``): the ``id`` is its ``kind``."""
    tensors = p.extra.get("tensors", ())
    return {
        "kind": p.id,
        "severity": p.severity,
        "message": p.message,
        "layer": p.extra.get("layer"),
        "tensors": list(tensors[:MAX_LISTED_TENSORS]),
        "n_tensors": len(tensors),
    }


def _fp8(ck, config) -> tuple[QuantMap, list[Diagnostic]]:
    """Quantized release weights and their scales, and their problems as findings (a bad ``weight_block_size`` is
    one too)."""
    cfg = load_config(config) if isinstance(config, (str, Path)) else config
    try:
        fm = analyze_quant(ck, cfg)
    except InputError as exc:
        fm = QuantMap(Fp8Map(DEFAULT_BLOCK, "default (declared block unusable)"))
        return fm, [problem("fp8-scale", "error", f"{exc.where}: {exc.message} ({exc.fix})")]
    return fm, [problem("fp8-scale", "error", f"{p.where}: {p.message} ({p.fix})", _layer_of(p.where), (p.where,))
                for p in fm.problems]


def _layer_of(name: str) -> int | None:
    parts = name.split(".")
    return next((int(b) for a, b in zip(parts, parts[1:]) if a == "layers" and b.isdigit()), None)


def _quant_summary(ck, qm: QuantMap) -> dict:
    """Per format: weights, group sizes, scale dtypes, and the logical shapes of the packed weights (never the
    packed widths)."""
    out = qm.summary()
    for f in out.values():
        f["scale_dtypes"] = {}
        f["shapes"] = []
    for w in qm.weights.values():
        f = out[w.fmt]
        d = ck[w.scale].dtype if w.scale in ck else "?"
        f["scale_dtypes"][d] = f["scale_dtypes"].get(d, 0) + 1
        if list(w.shape) not in f["shapes"]:
            f["shapes"].append(list(w.shape))
    return out


def _tensor(info, m, fp8: QuantMap) -> dict:
    return {
        "name": info.name,
        "dtype": info.dtype,
        "numpy_shape": list(info.shape),
        "ggml_ne": list(info.ne),
        "bytes": info.nbytes,
        "offset": info.offset,
        "file": info.file.name,
        "group": m.group if m else "fp8_scales" if info.name in fp8.scales else "unknown",
        "quant": describe(fp8.weights[info.name]) if info.name in fp8.weights else None,
        "layer": m.layer if m else None,
        "expert": m.expert if m else None,
        "gguf_name": m.gguf_name if m else None,
        "hf_name": m.hf_name if m else None,
        "fp8_scale": fp8.weights[info.name].scale if info.name in fp8.weights else None,
    }
