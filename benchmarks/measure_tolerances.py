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
         "top1_agreement": min, "top1_agreement_raw": min, "topk_overlap_mean": min, "hidden_nmse_max": max}


def main() -> None:
    from ktconvert.gate import default_suite_path, load_suite
    from ktconvert.gate.runner import _tiny_model, _tiny_model_dir, _adapter_dir, convert_case, verify_run
    from ktconvert.verify import load_profile

    ap = argparse.ArgumentParser()
    ap.add_argument("suite", nargs="?", default=None)
    ap.add_argument("-k", dest="select")
    args = ap.parse_args()
    suite = load_suite(args.suite or default_suite_path(), check_profiles=False)
    worst: dict[str, dict] = defaultdict(dict)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "open.yaml"
        path.write_text(OPEN)
        cases = suite.select(args.select)
        with_lora = {c.tiny for c in cases if c.lora}
        converted = {}
        for case in cases:  # the gate's own conversion and verify (ktconvert.gate.runner), under an open profile
            model = _tiny_model_dir(case.tiny, tmp)
            if not model.is_dir():
                _tiny_model(case, tmp, lora=case.tiny in with_lora)
            key = (case.tiny, case.conversion)
            if key not in converted:
                converted[key] = convert_case(case, model, tmp)
            # the near-tie margin is the case's profile's: the open profile has no nmse_max to derive it from
            real = load_profile(case.tolerance).for_family(case.family)
            margin = real.logits.get("top1_tie_margin")
            open_profile = load_profile(str(path))
            open_profile.data["logits"]["nmse_max"] = real.logits.get("nmse_max", 1e9)
            if margin is not None:
                open_profile.data["logits"]["top1_tie_margin"] = margin
            report = verify_run(case, model, converted[key], _adapter_dir(case.tiny, tmp) if case.lora == "verify"
                                else None, profile=open_profile)
            row, ties = {}, {}
            for phase in report.phases:
                stats = phase.as_dict()["logits"]
                hidden = max((v for _, v in phase.layers if v is not None and math.isfinite(v)), default=0.0)
                stats = {**stats, "hidden_nmse_max": hidden}
                ties[phase.name] = (stats["top1_near_ties"], stats["top1_near_tie_flips"])
                for metric, pick in WORST.items():
                    v = stats.get(metric)
                    if v is None:
                        continue
                    row[metric] = v if metric not in row else pick(row[metric], v)
            variant = {r["variant"] for r in (report.as_dict().get("kernel") or {}).get("layers", [])}
            print(f"{case.name:<28} " + " ".join(f"{m}={row.get(m, float('nan')):.4g}" for m in WORST)
                  + (f" variant={','.join(sorted(variant))}" if variant else ""))
            print(f"{'':<28} near-ties set aside (flipped): "
                  + "; ".join(f"{ph} {t} ({f})" for ph, (t, f) in ties.items()))
            fam_key = f"{case.tolerance} ({'deepseek' if case.family.startswith('deepseek') else 'others'})"
            for metric, v in row.items():
                w = worst[fam_key]
                w[metric] = v if metric not in w else WORST[metric](w[metric], v)
    print("\nworst per profile and family group (both phases):")
    for key in sorted(worst):
        print(f"{key:<24} " + " ".join(f"{m}={worst[key][m]:.4g}" for m in WORST if m in worst[key]))


if __name__ == "__main__":
    main()
