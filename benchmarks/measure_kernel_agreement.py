"""Emulation vs the real kt-kernel, per method and weight type: ``verify --kernel both`` on the tiny models.

For each family and type, converts the tiny model (``ktconvert quantize --type T``), runs verify with the CPU
experts computed by kt-kernel (in a child process) and by ktconvert's emulation on the same inputs, and prints
the worst per-layer agreement ‖kernel − emulation‖ / ‖emulation‖ over both phases, with the verdict of the
kernel run under the type's shipped profile. HF bf16 experts run the BF16 method; kt-amx directories written
by kt-kernel's own quantizer run AMXINT8/AMXINT4 (their "emulation" is the float experts of the model, so the
number is the method's quantization error, not an agreement).

    python benchmarks/measure_kernel_agreement.py [--families qwen3_moe deepseek_v3] [--types Q8_0 Q4_K]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROFILE = {"F16": "bf16", "BF16": "bf16", "Q8_0": "q8_0", "Q6_K": "q6_k"}  # the rest: q4_k (the loosest shipped)


def main() -> None:
    from ktconvert.convert import convert
    from ktconvert.kernel import probe_kernel
    from ktconvert.kernel.kttree import ktamx_by_kernel
    from ktconvert.model.inject import EmulationOptions
    from ktconvert.model.tiny import write_tiny_model
    from ktconvert.verify import run_verify

    ap = argparse.ArgumentParser()
    ap.add_argument("--families", nargs="+", default=["qwen3_moe", "deepseek_v3"])
    ap.add_argument("--types", nargs="+", default=["F16", "BF16", "Q8_0", "Q6_K", "Q5_K", "Q5_0", "Q4_K", "Q4_0"])
    ap.add_argument("--amx", action="store_true", help="also AMXINT8/AMXINT4 on kernel-written kt-amx dirs")
    args = ap.parse_args()
    info = probe_kernel()
    print(f"kt-kernel {info['version']}, variant {info['variant']}")
    with tempfile.TemporaryDirectory() as tmp:
        for fam in args.families:
            model = Path(tmp) / fam
            write_tiny_model(fam, model)
            rules, golden = REPO / "rules" / "optimize" / f"{fam}.yaml", REPO / "golden" / fam
            runs = [(t, dict(weights=convert(model, Path(tmp) / f"{fam}-{t}", type=t).out / "model.gguf",
                             profile=PROFILE.get(t, "q4_k"))) for t in args.types]
            if args.amx:
                for m in ("AMXINT8", "AMXINT4"):
                    ktamx_by_kernel(model, Path(tmp) / f"{fam}-{m}", m, 2)
                    runs.append((m, dict(kt_weights=Path(tmp) / f"{fam}-{m}", profile=f"kt-{m.lower()}")))
            for label, kw in runs:
                kw.setdefault("profile", "auto")
                rep = run_verify(model, rules, golden, options=EmulationOptions(kernel="both"), **kw)
                rows = rep.kernel["layers"]
                worst = max(v for r in rows for v in r["agreement"].values())
                kl = max(p.logits.summary()["kl_mean"] for p in rep.phases)
                print(f"{fam:<12} {label:<8} {rows[0]['method']:<10} agreement max {worst:.3g}  "
                      f"KL mean {kl:.3g}  {'pass' if rep.passed else 'FAIL'} ({rep.profile.name})")


if __name__ == "__main__":
    main()
