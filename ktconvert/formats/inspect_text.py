"""The text rendering of an inspect report: consecutive identical layers folded into one block, both shape orders
labelled on every line, problems last."""

from __future__ import annotations

SHAPE_LEGEND = (
    "numpy = slowest axis first, as array.shape prints; ggml ne = fastest axis first, as GGUF stores and llama.cpp prints"
)
_SEVERITY_COLOR = {"error": "red", "warning": "yellow", "info": "cyan"}


def human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _dims(n) -> str:
    return "?" if n is None else str(n)


def _layer_head(ly: dict) -> str:
    if ly["layout"] is None:
        return "no expert tensors"
    if ly["layout"] == "mixed":
        return "mixed layouts"
    parts = [ly["layout"], f"E={_dims(ly['n_experts'])}", f"I={_dims(ly['intermediate'])}", f"H={_dims(ly['hidden'])}"]
    if ly["orientation"]:
        parts.append(f"gate_up stored {ly['orientation']}" if ly["orientation"] != "ambiguous" else "orientation AMBIGUOUS")
    if ly["quant"]:
        parts.append(ly["quant"])
    if ly["numa_parts"]:
        parts.append(f"{ly['numa_parts']} NUMA part(s)")
    return "  ".join(parts)


def _proj_lines(ly: dict) -> list[str]:
    out = []
    for proj, p in ly["projections"].items():
        shape = "varies" if p["numpy_shape"] is None else str(p["numpy_shape"])
        ne = "varies" if p["ggml_ne"] is None else str(p["ggml_ne"])
        per = "per expert" if p["tensors"] > 1 else "stacked"
        out.append(
            f"    {proj:<8} {','.join(p['dtypes']):<10} {p['tensors']:>5} tensor(s)  "
            f"numpy {shape:<18} ggml ne {ne:<18} {per:<10} {human_bytes(p['bytes']):>10}"
        )
    return out


def _fold(layers: list[dict]) -> list[tuple[int, int, dict]]:
    """Runs of consecutive layers whose descriptions are identical, as (first, last, layer)."""
    runs: list[tuple[int, int, dict]] = []
    for ly in layers:
        key = {k: v for k, v in ly.items() if k not in ("layer", "router", "score_bias", "shared_experts")}
        if runs and runs[-1][1] == ly["layer"] - 1 and runs[-1][2]["_key"] == key:
            runs[-1] = (runs[-1][0], ly["layer"], runs[-1][2])
        else:
            runs.append((ly["layer"], ly["layer"], {**ly, "_key": key}))
    return runs


def render_text(report: dict, style=lambda s, **kw: s) -> str:
    r = report
    lines = [style(f"ktconvert inspect: {r['path']}", bold=True)]
    if r["container"] == "kt-tree":
        t = r["kt_tree"]
        lines.append(f"  container     kt-kernel persistent INT8 tree (kt-weight-manifest.json schema 2, {t['layout']}), "
                     f"{t['files']} .kt files, {human_bytes(t['bytes'])}, sha256 verified")
        lines.append(f"  experts       E={t['experts']} H={t['hidden_size']} I={t['intermediate_size']}, "
                     f"{t['threadpool_count']} numa part(s), layers {t['layers']}")
        lines.append(f"  launch        kt-kernel's INT8 SFT path with --kt-threadpool-count {t['threadpool_count']}")
        lines += [f"  error  {p['message']}" for p in r["problems"]]
        return "\n".join(lines)
    files = r["files"]
    container = r["container"] + (f" v{r['gguf_version']}" if r.get("gguf_version") else "")
    lines.append(
        f"  container     {container}, {len(files)} file(s), {r['n_tensors']} tensors, {human_bytes(r['total_bytes'])}"
    )
    arch = r["architecture"]
    lines.append(f"  architecture  {arch['arch'] or 'unknown'} ({arch['source']})")
    c = r["config"]
    if c["source"] != "none":
        used = f" top-{c['n_experts_used']}" if c["n_experts_used"] else ""
        shared = f" +{c['n_shared_experts']} shared" if c["n_shared_experts"] else ""
        lines.append(
            f"  config        H={_dims(c['hidden_size'])} I={_dims(c['moe_intermediate_size'])} "
            f"E={_dims(c['n_experts'])}{used}{shared}, {_dims(c['n_layers'])} layers (from {c['source']})"
        )
    else:
        lines.append("  config        none found (pass --config config.json to check shapes against it)")
    with_experts = [ly for ly in r["layers"] if ly["layout"]]
    lines.append(
        f"  layers        {_dims(r['n_layers'])} in the tensors; experts in {len(with_experts)}"
        + (f" ({', '.join(r['layouts'])})" if r["layouts"] else "")
        + _dense(c.get("dense_layers"))
    )

    lines.append("")
    lines.append(style("experts per layer", bold=True) + f"  ({SHAPE_LEGEND})")
    if not r["layers"]:
        lines.append("  (no expert tensors)")
    for first, last, ly in _fold(r["layers"]):
        label = f"layer {first}" if first == last else f"layers {first}-{last}"
        lines.append(f"  {label:<14} {_layer_head(ly)}")
        lines.extend(_proj_lines(ly))

    lines.append("")
    lines.append(style("quant types", bold=True))
    for name, q in r["quant_types"].items():
        lines.append(f"  {name:<12} {q['tensors']:>7} tensor(s) {human_bytes(q['bytes']):>12}")
    lines.append(style("bytes per tensor group", bold=True))
    for name, g in r["groups"].items():
        lines.append(f"  {name:<15} {g['tensors']:>7} tensor(s) {human_bytes(g['bytes']):>12}")

    if r.get("fp8"):
        f = r["fp8"]
        dts = ", ".join(f"{k} {v}" for k, v in sorted(f["scale_dtypes"].items()))
        lines.append(style("fp8 block-scaled", bold=True)
                     + f"  {f['weights']} F8_E4M3 weight(s) with {f['scales']} _scale_inv scale(s) ({dts}), "
                     f"block {f['block'][0]}x{f['block'][1]} ({f['block_source']}); read as exact float32")

    for fmt, q in (r.get("quantized") or {}).items():
        dts = ", ".join(f"{k} {v}" for k, v in sorted(q["scale_dtypes"].items()))
        shapes = ", ".join(str(s) for s in q["shapes"][:4]) + (", ..." if len(q["shapes"]) > 4 else "")
        lines.append(style(f"{fmt:<15}", bold=True) + f" {q['weights']} weight(s), group(s) {q['groups']} input "
                     f"column(s) per scale, scales {dts}; logical shapes {shapes}; read as exact float32")

    if "tensors" in r:
        lines.append("")
        lines.append(style(f"tensors ({len(r['tensors'])} matching)", bold=True) + f"  ({SHAPE_LEGEND})")
        for t in r["tensors"]:
            lines.append(
                f"  {t['name']}  {t['dtype']}  numpy {t['numpy_shape']}  ggml ne {t['ggml_ne']}  "
                f"{human_bytes(t['bytes'])}  @ {t['file']}:{t['offset']}"
                + (f"  {t['quant']['format']} group {t['quant']['group']} with {', '.join(t['quant']['companions'])}"
                   if t.get("quant") else "")
            )

    if r["scan"] is not None:
        s = r["scan"]
        lines.append("")
        lines.append(
            style("scan", bold=True)
            + f"  {s['scanned_tensors']} tensor(s), {human_bytes(s['scanned_bytes'])} read; "
            f"{len(s['findings'])} finding(s); {len(s['skipped'])} skipped"
        )
        for sk in s["skipped"][:10]:
            lines.append(f"  skipped {sk['tensor']}: {sk['why']}")
        if len(s["skipped"]) > 10:
            lines.append(f"  ... and {len(s['skipped']) - 10} more skipped")

    probs = r["problems"]
    counts = {sev: sum(p["severity"] == sev for p in probs) for sev in ("error", "warning", "info")}
    lines.append("")
    lines.append(
        style("problems", bold=True)
        + f"  {counts['error']} error(s), {counts['warning']} warning(s), {counts['info']} note(s)"
    )
    for p in probs:
        sev = p["severity"]
        lines.append(f"  {style(sev, fg=_SEVERITY_COLOR[sev])}{' ' * (8 - len(sev))} [{p['kind']}] {p['message']}")
    return "\n".join(lines)


def _dense(layers: list | None) -> str:
    """``; dense layer 0`` / ``; dense layers 0-2`` where the config (or GGUF metadata) gives layers a dense MLP instead of experts."""
    if not layers:
        return ""
    span = str(layers[0]) if len(layers) == 1 else (f"{layers[0]}-{layers[-1]}" if layers == list(range(layers[0], layers[-1] + 1))
                                                    else ", ".join(map(str, layers)))
    return f"; dense layer{'s' if len(layers) > 1 else ''} {span}"
