"""Rendering a verify report: text for people, JSON (``schemas/verify-report.schema.json``) for machines,
and an optional per-layer error plot (matplotlib, when installed)."""

from __future__ import annotations

import json
import math

from ktconvert.io.sizes import format_size
from ktconvert.optional import require


def _g(v, digits: int = 3) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float) and not math.isfinite(v):
        return "NaN/Inf"
    if v == 0:
        return "0"
    return f"{v:.{digits}g}" if abs(v) < 1e4 else f"{v:.3e}"


def render_json(report) -> str:
    return json.dumps(report.as_dict(), indent=2, allow_nan=False)


def render_text(report) -> str:
    d = report.as_dict()
    lines = []
    w = d["weights"]
    lines.append(f"verify {d['model']['family']}  model {d['model']['dir']}")
    lines.append(f"  rules   {d['rules']}")
    lines.append(f"  weights {w['path']} ({w['container']}; experts "
                 + ", ".join(sorted({'/'.join(v.values()) for v in w['expert_types'].values()})) + ")"
                 + (f"; prefill ops read {w['prefill_path']}" if w["prefill_path"] else ""))
    lines.append(f"  golden  {d['golden']['dir']} ({d['golden']['positions']} positions)")
    lines.append(f"  profile {d['profile']['name']} ({d['profile']['source']})")
    o = d["options"]
    lines.append(f"  numerics: compute {o['compute_dtype']}, CPU experts hidden {o['cpu_hidden_dtype']}, "
                 f"activation quantization {'on' if o['cpu_act_quant'] else 'off'}, {o['threads']} thread(s)")
    inj = d["injection"]
    thr = inj["layerwise_prefill_threshold"]
    lines.append(f"  prefill: {'layer-wise, prefill_op' if inj['layerwise_prefill'] else 'generate_op'} "
                 f"(model operator {(inj['model_operator'] or 'default').rsplit('.', 1)[-1]}, threshold {thr}); "
                 "decode: generate_op")
    lines.append("operators:")
    for u in inj["operators"]:
        if u["slot"] is None and u["emulated"] and u["emulation"] in ("identity", "moe-block"):
            continue
        op = f" {u['slot']}={u['op']}" if u["slot"] else ""
        mark = "" if u["emulated"] else "  NOT EMULATED"
        lines.append(f"  {u['operator'].rsplit('.', 1)[-1]}{op} x{len(u['modules'])}: {u['emulation']} ({u['detail']}){mark}")
    kept = sorted({u["operator"].rsplit(".", 1)[-1] for u in inj["operators"]
                   if u["slot"] is None and u["emulated"] and u["emulation"] in ("identity", "moe-block")})
    if kept:
        lines.append(f"  reference numerics: {', '.join(kept)}")
    lines.append("")
    hdr = f"{'phase':8} {'max|d|':>9} {'NMSE max':>9} {'KL mean':>9} {'KL p99':>9} {'KL max':>9} {'top-1':>6} {'top-k':>6}"
    lines.append(hdr)
    for name, ph in d["phases"].items():
        s = ph["logits"]
        lines.append(f"{name:8} {_g(s['max_abs_diff']):>9} {_g(s['nmse_max']):>9} {_g(s['kl_mean']):>9} "
                     f"{_g(s['kl_p99']):>9} {_g(s['kl_max']):>9} {_g(s['top1_agreement']):>6} "
                     f"{_g(s['topk_overlap_mean']):>6}")
    for name, ph in d["phases"].items():
        s = ph["logits"]
        if s["top1_near_ties"]:
            flips = s["top1_near_tie_flips"]
            lines.append(f"{name}: top-1 judged on {s['top1_positions_judged']} of {s['positions']} positions; near-ties "
                         f"set aside (golden top-2 gap under the margin, up to {_g(s['top1_tie_margin_max'])}): "
                         f"{', '.join(map(str, s['top1_near_ties']))}"
                         + (f"; flipped there: {', '.join(map(str, flips))}" if flips else "")
                         + f"; raw top-1 {_g(s['top1_agreement_raw'])}")
    names = [x["layer"] for x in next(iter(d["phases"].values()))["layers"]]
    lines.append("")
    if names:  # none against a KL-divergence base file (it holds no hidden states; a note says so)
        lines.append("hidden-state NMSE per layer (prefill / decode):")
    for i, name in enumerate(names):
        vals = " / ".join(_g(ph["layers"][i]["nmse"]) for ph in d["phases"].values())
        lines.append(f"  {name:10} {vals}")
    if all(ph.get("forced") for ph in d["phases"].values()):
        lines.append("teacher-forced NMSE per layer, each layer alone on the reference's input (prefill / decode):")
        for i, name in enumerate(names):
            vals = " / ".join(_g(ph["forced"][i]["nmse"]) for ph in d["phases"].values())
            lines.append(f"  {name:10} {vals}")
    for name, ph in d["phases"].items():
        loc = ph["localization"]
        if ph["nonfinite"]:
            nf = ph["nonfinite"]
            lines.append(f"{name}: first NaN/Inf in {nf['where']} {nf['layer'] or ''} at position {nf['position']}, "
                         f"index {nf['index']}")
        if loc and loc["breach"]:
            where = loc["layer"] or "?"
            mod = loc.get("module")
            if mod:
                where += (f", module {mod} ({(loc.get('operator') or 'default').rsplit('.', 1)[-1]}; "
                          f"NMSE in {_g(loc.get('module_nmse_in'))} -> out {_g(loc.get('module_nmse_out'))})")
            lines.append(f"{name}: error jumps at {where}")
        if loc and loc.get("forced_layer"):
            lines.append(f"{name}: {loc['forced_layer']} alone adds NMSE {_g(loc['forced_layer_nmse'])} on the "
                         "reference's input (teacher-forced), over the hidden-state limit")
        if loc and loc["breach"] and loc.get("expert") is not None:
            lines.append(f"{name}: worst routed expert of {loc.get('forced_layer') or loc['layer']}: expert "
                         f"{loc['expert']} (NMSE {_g(loc['expert_nmse'])} over the {loc['expert_tokens']} rows the "
                         "reference routed to it, on the reference's expert input)")
        if loc and loc.get("outlier"):
            o = loc["outlier"]
            times = f"{o['ratio']:.1f}x" if o["ratio"] is not None else "infinitely many times"
            lines.append(f"{name}: expert {o['expert']} of {o['layer']} stands out: NMSE {_g(o['nmse'])} over "
                         f"{o['tokens']} rows, {times} the median of that layer's experts ({_g(o['median'])})")
    if d.get("kernel") and not d["kernel"]["layers"]:
        lines.append("CPU experts by kt-kernel: none (no module runs a CPU experts op under this rule file)")
    elif d.get("kernel"):
        lines.append(f"CPU experts by kt-kernel ({d['kernel']['mode']}):")
        for r in d["kernel"]["layers"]:
            agree = ""
            if r.get("agreement") is not None:
                agree = "; vs emulation " + ", ".join(f"{ph} {_g(v)}" for ph, v in r["agreement"].items())
            lines.append(f"  layer {r['layer']:<3} {r['kernel']} {r['version']} {r['method']} "
                         f"({r['variant']}, {r['threadpools']} threadpool(s)){agree}")
    if d.get("lora"):
        lo = d["lora"]
        lines.append(f"LoRA {lo['path']} ({lo['form']}, r {lo['rank']}, alpha {lo['alpha']:g}, sha256 {lo['sha256'][:12]}) "
                     f"applied as W + {lo['scale']:g} * B @ A; in the golden it moves the logits by max |diff| "
                     f"{_g(lo['golden_effect']['logits_max_abs_diff'])}, NMSE {_g(lo['golden_effect']['logits_nmse'])}")
        for name, b in lo["against_base"].items():
            lines.append(f"  {name} against the base golden: {b['verdict'].upper()} (max |diff| {_g(b['max_abs_diff'])}, "
                         f"KL mean {_g(b['kl_mean'])}, top-1 {_g(b['top1_agreement'])})")
    for n in d["notes"]:
        lines.append(f"note: {n}")
    ne = inj["not_emulated"]
    if ne:
        lines.append(f"warning: {len(ne)} operator use(s) not emulated; their numbers are the fallback's "
                     f"(profile policy: {d['profile']['limits'].get('not_emulated', 'warn')})")
    r = d.get("run")
    if r is not None:
        budget = f"budget {format_size(r['max_memory'])}" + (" (default: half the memory available)"
                                                            if r["max_memory_default"] else "")
        if r["mode"] == "stream":
            lines.append(f"streamed layer by layer within {budget}: {format_size(r['bytes_read'])} read, peak "
                         f"{format_size(r['peak_resident_weights'])} of weights resident, {r['experts_loaded']} "
                         f"expert loads; {_rss(r)}")
        else:
            lines.append(f"resident: both models in memory within {budget}; {_rss(r)}")
    lines.append("")
    if report.passed:
        lines.append(f"PASS ({report.seconds:.2f} s)")
    else:
        lines.append(f"FAIL: {len(report.breaches)} limit(s) broken ({report.seconds:.2f} s)")
        for b in report.breaches:
            lines.append(f"  {b.line()}")
    return "\n".join(lines)


def require_matplotlib():
    """matplotlib for ``--plot``, or a clear error naming the package (it is not a dependency)."""
    install = "pip install matplotlib, or leave out --plot"
    require("matplotlib", needed_for="--plot", install=install).use("Agg")
    return require("matplotlib.pyplot", needed_for="--plot", install=install)


def plot(report, path: str) -> None:
    """Per-layer hidden-state NMSE for prefill and decode, log scale, one PNG."""
    plt = require_matplotlib()
    d = report.as_dict()
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, ph in d["phases"].items():
        xs = [x["layer"] for x in ph["layers"]]
        ys = [x["nmse"] if x["nmse"] else float("nan") for x in ph["layers"]]
        ax.plot(xs, ys, marker="o", label=name)
    limit = d["profile"]["limits"].get("hidden_states", {}).get("nmse_max")
    if limit:
        ax.axhline(limit, linestyle="--", color="grey", label=f"limit {limit:g}")
    ax.set_yscale("log")
    ax.set_ylabel("hidden-state NMSE vs golden")
    ax.set_title(f"{d['model']['family']}: {'PASS' if report.passed else 'FAIL'} ({d['profile']['name']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _rss(r: dict) -> str:
    """The run's peak RSS: this process, and the whole process tree where that is more (kernel children)."""
    own, tree = r["peak_rss"], r.get("peak_rss_tree")
    if tree is None or tree <= own:
        return f"peak RSS {format_size(own)}"
    return f"peak RSS {format_size(own)} (process tree {format_size(tree)})"
