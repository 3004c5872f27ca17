"""Time `ktconvert check-rules` on the upstream corpus against the baseline of merely parsing it.

The baseline is what upstream itself does before its 20-minute model load: ``yaml.load(FullLoader)`` of the
rule file. Both are measured in this one run, in process (best of N) and as a cold CLI start.

    python benchmarks/bench_check_rules.py [CORPUS_DIR] [--repeat N]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def best_of(fn, repeat: int) -> tuple[float, float]:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times), statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("corpus", nargs="?", default=str(REPO.parent / "shared" / "corpus" / "ktransformers-optimize-rules"))
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    corpus = Path(args.corpus)
    files = sorted(corpus.rglob("*.yaml"))
    if not files:
        sys.exit(f"no rule files under {corpus}")

    from ktconvert.rules import lint
    from ktconvert.rules.catalog import load_catalog

    catalog = load_catalog()

    def parse_only():
        for f in files:
            yaml.load(f.read_text(), Loader=yaml.FullLoader)

    def check_all():
        lint.check_paths([corpus], lint.Options(), catalog)

    rows = [("PyYAML FullLoader parse (upstream baseline)",) + best_of(parse_only, args.repeat),
            ("ktconvert check-rules, in process",) + best_of(check_all, args.repeat)]
    cold = []
    for _ in range(args.repeat):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "ktconvert", "-q", "check-rules", str(corpus)], check=True, capture_output=True)
        cold.append(time.perf_counter() - t)
    rows.append(("ktconvert check-rules, cold CLI start (python -m)", min(cold), statistics.median(cold)))
    print(f"{len(files)} rule files from {corpus.name}, best / median of {args.repeat}")
    print(f"{'what':<52} {'best s':>8} {'median s':>9}")
    for name, best, med in rows:
        print(f"{name:<52} {best:>8.3f} {med:>9.3f}")


if __name__ == "__main__":
    main()
