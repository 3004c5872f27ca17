"""Measure the errors every gate case really has, to set the tolerance profiles from data.

Runs each case of a gate suite (convert + verify) under a profile with no effective limits and prints, per
tolerance profile, the worst value of every metric over its cases and both phases (prefill, decode). The
shipped profiles in rules/tolerances/ are set from this output with the margin stated in each file.

    python benchmarks/measure_tolerances.py [golden/suite.yaml] [-k PATTERN]
"""

from __future__ import annotations

import argparse
import math
import tempfile
from collections import defaultdict
from pathlib import Path

OPEN = """kind: tolerance-profile
version: 1
name: measure-only
description: no effective limits; records what a run measures
logits: {max_abs_diff: 1000000000}
"""

WORST = {"max_abs_diff": max, "nmse_max": max, "kl_mean": max, "kl_p99": max, "kl_max": max,
         "top1_agreement": min, "topk_overlap_mean": min, "hidden_nmse_max": max}


def main() -> None:
    from ktconvert.convert import convert
    from ktconvert.gate import default_suite_path, load_suite
    from ktconvert.model.tiny import write_tiny_model
    from ktconvert.model.inject import EmulationOptions
    from ktconvert.verify import run_verify

    ap = argparse.ArgumentParser()
    ap.add_argument("suite", nargs="?", default=None)
    ap.add_argument("-k", dest="select")
    args = ap.parse_args()
    suite = load_suite(args.suite or default_suite_path(), check_profiles=False)
    worst: dict[str, dict] = defaultdict(dict)
    with tempfile.TemporaryDirectory() as tmp:
        profile = Path(tmp) / "open.yaml"
        profile.write_text(OPEN)
        converted = {}
        for case in suite.select(args.select):
            model = Path(tmp) / "m" / case.family
            if not model.is_dir():
                write_tiny_model(case.family, model)
            key = (case.family, case.conversion)
            if key not in converted:
                out = convert(model, Path(tmp) / "c" / f"{case.family}-{len(converted)}", case.recipe, type=case.type)
                converted[key] = out.out / "model.gguf"
            report = run_verify(model, case.rules, case.golden, weights=converted[key], profile=str(profile),
                                options=EmulationOptions(kernel=case.kernel))
            row = {}
            for phase in report.phases:
                stats = phase.as_dict()["logits"]
                hidden = max((v for _, v in phase.layers if v is not None and math.isfinite(v)), default=0.0)
                stats = {**stats, "hidden_nmse_max": hidden}
                for metric, pick in WORST.items():
                    v = stats.get(metric)
                    if v is None:
                        continue
                    row[metric] = v if metric not in row else pick(row[metric], v)
            print(f"{case.name:<28} " + " ".join(f"{m}={row.get(m, float('nan')):.4g}" for m in WORST))
            fam_key = f"{case.tolerance} ({'deepseek' if case.family.startswith('deepseek') else 'others'})"
            for metric, v in row.items():
                w = worst[fam_key]
                w[metric] = v if metric not in w else WORST[metric](w[metric], v)
    print("\nworst per profile and family group (both phases):")
    for key in sorted(worst):
        print(f"{key:<24} " + " ".join(f"{m}={worst[key][m]:.4g}" for m in WORST if m in worst[key]))


if __name__ == "__main__":
    main()
