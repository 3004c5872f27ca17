"""Which ggml weight types kt-kernel's LLAMAFILE method runs here: every type, through the real kernel.

For each type, one MoE layer's experts (8 experts, top-2, H = I = 256) are quantized to it and run through
LLAMAFILE in a kt-kernel child of their own (a 64-token prefill batch and a 3-token decode batch: the kernel's
two paths), then compared with a float32 MoE on the dequantized blocks (see ktconvert/kernel/llamafile_measure.py
for the verdicts and bounds). The test blocks come from ktconvert's own quantizer for the types it writes, from
gguf-py for TQ1_0/TQ2_0/MXFP4, and from ggml's C reference (tests/ggml_ref.py, built into the ktconvert cache) for
the IQ grid types, quantized with an all-ones importance matrix (they need one).

    python benchmarks/measure_llamafile_types.py                 # print the table
    python benchmarks/measure_llamafile_types.py --write         # and record it in rules/kernels/kt-llamafile.yaml
    python benchmarks/measure_llamafile_types.py --types Q4_K IQ4_NL

--write replaces the entry of the same kt-kernel version and CPU variant and keeps the others (so a run on an
Intel AMX machine, where kt-kernel loads its ``amx`` variant, adds that variant's entry beside this one).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from ktconvert.quant import WRITABLE  # noqa: E402

GGUF_PY = ("TQ1_0", "TQ2_0", "MXFP4")
GGML_C = ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "NVFP4")
ALL = WRITABLE + GGUF_PY + GGML_C


def quantizer_for(qtype: str):
    """(name, quantizer) for ``qtype``: float32 [E, rows, cols] -> uint8 blocks."""
    from ktconvert.kernel.llamafile_measure import own_quantizer
    from ktconvert.quant import QType

    if qtype in WRITABLE:
        return "ktconvert", own_quantizer
    if qtype in GGUF_PY:
        from gguf import quants

        return "gguf-py", lambda w, t: np.asarray(quants.quantize(w, QType[t]), dtype=np.uint8)
    import ggml_ref

    ref = ggml_ref.load()

    def c_quantize(w: np.ndarray, t: str) -> np.ndarray:
        return ref.quantize(w, int(QType[t]), imatrix=np.ones(w.shape[-1], dtype=np.float32))

    return "ggml-c", c_quantize


def render(entries: list[dict]) -> str:
    """The table as YAML, one line per type (JSON scalars and flow mappings are YAML)."""
    lines = ["# Which ggml weight types kt-kernel's LLAMAFILE method runs, measured by running it on each type:",
             "# python benchmarks/measure_llamafile_types.py --write (one entry per kt-kernel version and CPU variant).",
             "# A type runs only where every entry says `runs`. error: the kernel against a float32 MoE on the",
             "# dequantized blocks (rel: the batch, token_max: the worst token); quant_error: the type's own error.",
             "# Schema: schemas/kt-llamafile-types.schema.json. Read by ktconvert/quant/kt_llamafile.py.",
             "kind: kt-llamafile-types", "version: 1", "measurements:"]
    for m in entries:
        lines += [f"  - kt_kernel: {json.dumps(m['kt_kernel'])}", f"    variant: {json.dumps(m['variant'])}",
                  f"    cpu: {json.dumps(m.get('cpu'))}", f"    date: {json.dumps(m['date'])}",
                  f"    command: {json.dumps(m['command'])}", f"    layer: {json.dumps(m['layer'])}", "    types:"]
        for t, r in m["types"].items():
            lines.append(f"      {t}: {json.dumps(r)}")
    return "\n".join(lines) + "\n"


def main() -> int:
    from ktconvert.kernel import probe_kernel
    from ktconvert.kernel.cpu import cpu_features
    from ktconvert.kernel.llamafile_measure import Shape, measure_type
    from ktconvert.quant import kt_llamafile

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--types", nargs="+", default=list(ALL), metavar="T")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--write", action="store_true", help="record the result in rules/kernels/kt-llamafile.yaml")
    args = ap.parse_args()
    info = probe_kernel()
    if not info["available"]:
        print(f"kt-kernel cannot run here: {info['error']}", file=sys.stderr)
        return 3
    shape = Shape()
    print(f"kt-kernel {info['version']}, variant {info['variant']}; layer {shape.as_dict()}")
    results: dict[str, dict] = {}
    for t in args.types:
        t0 = time.perf_counter()
        try:
            who, fn = quantizer_for(t)
            r = measure_type(t, fn, shape=shape, threads=args.threads)
        except Exception as exc:  # a type this machine cannot make test blocks of: say so, record nothing
            print(f"{t:<8} not measured: {type(exc).__name__}: {exc}")
            continue
        err = r.get("error", {})
        figures = "  ".join(f"{p} {e['rel']:.4f} (worst token {e['token_max']:.4f})" for p, e in err.items())
        print(f"{t:<8} {r['verdict']:<8} quant error {r['quant_error']:.4f}  {figures}  {r.get('detail', '')}"
              f"  [{time.perf_counter() - t0:.1f} s]", flush=True)
        row = {"verdict": r["verdict"], "quantizer": who, "quant_error": r["quant_error"], "bound": r["bound"]}
        if err:
            row["error"] = err
        if r.get("detail"):
            row["detail"] = r["detail"]
        results[t] = row
    if not args.write:
        return 0
    entry = {"kt_kernel": info["version"], "variant": info["variant"], "cpu": cpu_features()["model"],
             "date": datetime.date.today().isoformat(), "command": "python benchmarks/measure_llamafile_types.py --write",
             "layer": shape.as_dict(), "types": results}
    path = ROOT / "rules" / kt_llamafile.TABLE
    old = list(kt_llamafile.measurements(path)) if path.exists() else []
    same = [m for m in old if (m["kt_kernel"], m["variant"]) == (entry["kt_kernel"], entry["variant"])]
    if same and set(same[0]["types"]) - set(results):  # a partial run keeps the types it did not measure
        entry["types"] = {**same[0]["types"], **results}
    entries = [m for m in old if m not in same] + [entry]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".yaml.tmp")
    tmp.write_text(render(entries), encoding="utf-8")
    tmp.replace(path)
    print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
