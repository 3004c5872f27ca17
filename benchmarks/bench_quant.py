"""Quantizer throughput, ours vs ggml's C reference vs the ``gguf`` package, on one core and on all cores.

Per type, in one run on the same array: ours on 1 core vs ``ggml_quantize_chunk`` on 1 thread; ours on N cores
(``quantize_parallel``, threads over row slices) vs the C on N threads (``ggml_quantize_chunk`` on N row slices
from N Python threads: ctypes releases the GIL, so this is the C's own multi-core speed); and
``gguf.quants.quantize`` where it implements the type. The C is the pinned ggml built by ``tests/ggml_ref.py``.
A type named ``Q4_K+im`` is quantized with an importance matrix (one random positive float per column, the same
for ours and the C): ggml's ``quantize_row_*_impl`` search, what ``llama-quantize --imatrix`` runs; a plain name
takes the path without one (the IQ grid types ggml quantizes only with one, IQ2_XXS and IQ2_XS, come only as
``+im``). The IQ grid types run at a few MB/s: give them fewer ``--rows``.

The measurements are interleaved (ours, C, ours, C, ... within each repeat), so a machine shared with other
work slows both sides alike, and the medians of ``--repeat`` runs are reported after a warm-up run of each
(which also compiles our kernels or loads them from numba's cache). The 1-core columns are MB per CPU-second of
this process (the per-core speed, robust to waiting for a shared core), the N-core columns MB per wall second.
MB are 1e6 bytes of float32 input.

    python benchmarks/bench_quant.py [--rows 1024] [--cols 4096] [--repeat 5] [--threads N] [--types Q4_K,Q6_K+im]
    python benchmarks/bench_quant.py --rows 128 --repeat 3 --types IQ3_XXS,IQ3_S,IQ3_XXS+im,IQ3_S+im,IQ2_XXS+im,IQ2_XS+im
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from ktconvert import quant as Q  # noqa: E402

ALL = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
       "IQ4_NL", "IQ4_XS", *(t for t in Q.IQ_GRID if Q.as_qtype(t) not in Q.IMATRIX_REQUIRED)]
IMATRIX = ["Q4_0+im", "Q4_1+im", "Q5_0+im", "Q5_1+im", "Q2_K+im", "Q3_K+im", "Q4_K+im", "Q5_K+im", "Q6_K+im",
           "IQ4_NL+im", "IQ4_XS+im", *(t + "+im" for t in Q.IQ_GRID)]


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def c_threads(ref, x: np.ndarray, qt, nthreads: int, pool: ThreadPoolExecutor | None,
              imatrix: np.ndarray | None = None) -> np.ndarray:
    """``ggml_quantize_chunk`` on ``nthreads`` row slices of ``x`` at once, into one output (as llama.cpp's
    quantizer splits a tensor's rows between its threads)."""
    im = None if imatrix is None else imatrix.ctypes.data
    n = x.shape[-1]
    nrows = x.size // n
    out = np.empty((nrows, ref.lib.ggml_row_size(int(qt), n)), dtype=np.uint8)
    ref.lib.ggml_quantize_init(int(qt))

    def part(k: int) -> None:
        r0, r1 = nrows * k // nthreads, nrows * (k + 1) // nthreads
        if r1 > r0:
            ref.lib.ggml_quantize_chunk(int(qt), x.ctypes.data, out.ctypes.data, r0 * n, r1 - r0, n, im)

    if pool is None:
        part(0)
    else:
        list(pool.map(part, range(nthreads)))
    return out


def timed(fn, clock) -> float:
    t0 = clock()
    fn()
    return clock() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="threads for the N-core columns (default: every core)")
    ap.add_argument("--types", default=",".join(ALL + IMATRIX),
                    help="comma-separated ggml types; NAME+im: with an importance matrix")
    ap.add_argument("--no-ref", action="store_true", help="skip the C reference columns")
    args = ap.parse_args(argv)

    import numba
    from gguf import quants as gq

    x = (np.random.default_rng(0).standard_normal((args.rows, args.cols)) * 0.02).astype(np.float32)
    imatrix = np.random.default_rng(1).uniform(0.1, 2.0, args.cols).astype(np.float32)
    mb = x.nbytes / 1e6
    nthr = args.threads or Q.cpu_count()
    ref, ref_note = None, "skipped (--no-ref)"
    if not args.no_ref:
        try:
            import ggml_ref

            ref = ggml_ref.load()
            ref_note = f"ggml from llama-cpp-python {ggml_ref.LLAMA_CPP_PYTHON_VERSION}, built by tests/ggml_ref.py"
        except Exception as exc:  # noqa: BLE001 - the table is still useful without the C columns
            ref_note = f"unavailable: {str(exc).splitlines()[0]}"

    print(f"CPU: {cpu_model()}, {Q.cpu_count()} cores usable; N = {nthr} threads")
    print(f"input: float32 {args.rows}x{args.cols} ({mb:.1f} MB), gaussian*0.02; median of {args.repeat} interleaved "
          f"runs after a warm-up; numpy {np.__version__}, numba {numba.__version__}; "
          f"load average {os.getloadavg()[0]:.2f} at start")
    print(f"C reference: {ref_note}")
    print("1-core columns: MB per CPU-second; N-core columns: MB per wall second")
    cols = ["type", "ours 1c", "C 1t", "ours/C 1", f"ours {nthr}c", f"C {nthr}t", f"ours/C {nthr}", "gguf 1c",
            "ours/gguf"]
    widths = [9, 9, 9, 8, 9, 9, 8, 9, 9]
    print("| " + " | ".join(f"{c:>{w}}" for c, w in zip(cols, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    pool = ThreadPoolExecutor(max_workers=nthr) if nthr > 1 else None
    cpu, wall = time.process_time, time.perf_counter
    for name in args.types.split(","):
        base, _, tag = name.partition("+")
        im = imatrix if tag == "im" else None
        qt = Q.as_qtype(base)
        has_gguf = qt.name != "F32" and im is None  # gguf returns F32 input itself; it takes no imatrix
        if has_gguf:
            try:
                gq.quantize(x[:1], qt)
            except NotImplementedError:
                has_gguf = False
        runs = {
            "o1": (lambda: Q.quantize(x, qt, imatrix=im, workers=1), cpu),
            "oN": (lambda: Q.quantize_parallel(x, qt, imatrix=im, workers=nthr), wall),
        }
        if ref is not None:
            runs["c1"] = (lambda: c_threads(ref, x, qt, 1, None, im), cpu)
            runs["cN"] = (lambda: c_threads(ref, x, qt, nthr, pool, im), wall)
        if has_gguf:
            runs["g1"] = (lambda: gq.quantize(x, qt), cpu)
        for fn, _ in runs.values():
            fn()  # warm-up: compile or load our kernel, fault in the output pages
        times: dict[str, list[float]] = {k: [] for k in runs}
        for r in range(args.repeat):
            order = list(runs) if r % 2 == 0 else list(reversed(runs))
            for k in order:
                fn, clock = runs[k]
                times[k].append(timed(fn, clock))
        med = {k: mb / statistics.median(v) for k, v in times.items()}

        def cell(k: str) -> str:
            return f"{med[k]:.1f}" if k in med else "-"

        def ratio(a: str, b: str) -> str:
            return f"{med[a] / med[b]:.2f}" if a in med and b in med else "-"

        row = [qt.name + ("+im" if im is not None else ""), cell("o1"), cell("c1"), ratio("o1", "c1"), cell("oN"), cell("cN"), ratio("oN", "cN"),
               cell("g1"), ratio("o1", "g1")]
        print("| " + " | ".join(f"{c:>{w}}" for c, w in zip(row, widths)) + " |", flush=True)
    if pool is not None:
        pool.shutdown()
    print(f"load average {os.getloadavg()[0]:.2f} at end (other processes share these cores: every number moves "
          f"with it; the ratios less, since both sides are measured interleaved)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
