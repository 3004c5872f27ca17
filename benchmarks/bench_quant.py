"""Quantizer throughput: ktconvert (one core and all cores) vs the ``gguf`` package vs ggml's C reference.

MB/s are megabytes (1e6) of float32 input per second, best of ``--repeat`` runs after a warm-up, all
measured in this one process on the same array. Single-threaded columns divide by CPU seconds (the
per-core speed, robust to other processes sharing the machine); the all-cores column by wall seconds. The C reference is ``ggml_quantize_chunk`` (no
importance matrix) from the pinned ggml built by ``tests/ggml_ref.py``, called single-threaded through
ctypes; torch is limited to one intra-op thread so "1 core" really is one core.

    python benchmarks/bench_quant.py [--rows 1024] [--cols 4096] [--repeat 3] [--types Q4_K,Q6_K]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from ktconvert import quant as Q  # noqa: E402

ALL = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]


def best_time(fn, repeat: int, clock=time.perf_counter) -> float:
    fn()  # warm-up (imports, allocator, caches)
    best = float("inf")
    for _ in range(repeat):
        t0 = clock()
        fn()
        best = min(best, clock() - t0)
    return best


def cpu_time(fn, repeat: int) -> float:
    """Best CPU seconds of this process: for single-threaded runs, MB per CPU-second is the per-core
    speed even when other processes share the cores (wall time would count their turns too)."""
    return best_time(fn, repeat, time.process_time)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--types", default=",".join(ALL))
    ap.add_argument("--no-ref", action="store_true", help="skip the C reference column")
    args = ap.parse_args(argv)

    import torch
    from gguf import quants as gq

    torch.set_num_threads(1)
    x = (np.random.default_rng(0).standard_normal((args.rows, args.cols)) * 0.02).astype(np.float32)
    mb = x.nbytes / 1e6
    ref = None
    ref_note = "skipped (--no-ref)"
    if not args.no_ref:
        try:
            import ggml_ref

            ref = ggml_ref.load()
            ref_note = f"ggml from llama-cpp-python {ggml_ref.LLAMA_CPP_PYTHON_VERSION} ({ref.path.name})"
        except Exception as exc:  # noqa: BLE001 - the table is still useful without the C column
            ref_note = f"unavailable: {str(exc).splitlines()[0]}"
    ncores = Q.cpu_count()

    def fmt(v: float | None, note: str = "-") -> str:
        return f"{v:9.1f}" if v is not None else f"{note:>9}"

    import os

    print(f"input: float32 {args.rows}x{args.cols} ({mb:.1f} MB), gaussian*0.02, best of {args.repeat}; "
          f"{ncores} cores; numpy {np.__version__}, torch {torch.__version__}; "
          f"load average {os.getloadavg()[0]:.2f} at start")
    print(f"C reference: {ref_note}")
    print("single-threaded columns: MB per CPU-second (per-core speed); all-cores column: MB per wall second")
    head = (f"| {'type':5} | {'ours 1 core':>11} | {'ours ' + str(ncores) + ' cores':>12} | {'gguf':>9} | "
            f"{'C ref 1 thr':>11} | {'ours/C':>6} | {'ours/gguf':>9} |")
    print(head)
    print("|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|")
    for name in args.types.split(","):
        qt = Q.as_qtype(name)
        ours1 = mb / cpu_time(lambda: Q.quantize(x, qt, workers=1), args.repeat)
        oursn = mb / best_time(lambda: Q.quantize_parallel(x, qt), args.repeat)
        gg = None
        gg_note = "-"
        if qt.name == "F32":
            gg_note = "no-op"  # gguf returns the float32 input itself: nothing to compare
        else:
            try:
                gq.quantize(x[:1], qt)
                gg = mb / cpu_time(lambda: gq.quantize(x, qt), args.repeat)
            except NotImplementedError:
                pass
        cr = mb / cpu_time(lambda: ref.quantize(x, qt), args.repeat) if ref is not None else None
        r_c = f"{ours1 / cr:6.2f}" if cr else f"{'-':>6}"
        r_g = f"{ours1 / gg:9.2f}" if gg else f"{'-':>9}"
        print(f"| {qt.name:5} | {fmt(ours1):>11} | {fmt(oursn):>12} | {fmt(gg, gg_note)} | {fmt(cr):>11} | {r_c} | {r_g} |",
              flush=True)
    print(f"load average {os.getloadavg()[0]:.2f} at end (other processes share these cores: all numbers move with it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
