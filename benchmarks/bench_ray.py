"""``quantize --executor ray`` with 1 and 2 local Ray workers, in one run: wall time and each worker's peak RSS.

The checkpoint is bench_convert's synthetic Qwen3-30B-A3B-shaped BF16 checkpoint (written for real, removed after).
It is converted once by the local executor (``--jobs 1``, the reference bytes and time), then, for each N of
``--workers``, on a fresh local Ray instance of N CPUs (``ray.init(address="local", num_cpus=N)``) with ``--jobs N``
and the same ``--max-memory``: each Ray task asks for ``--max-memory / N``. The page cache is dropped before each
conversion when the benchmark may. Each worker's peak RSS is its VmHWM (workers are the ``ray::`` processes
descended from this process, which started the instance), read before the instance is shut down; every output's
sha256 is checked against the local one.

    python benchmarks/bench_ray.py [--dir DIR] [--size-gib 2] [--type Q8_0] [--max-memory 1GiB] [--workers 1 2]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_convert import _drop_caches, layers_for, write_checkpoint  # noqa: E402


def _descendants(pid: int) -> list[int]:
    out, stack = [], [pid]
    while stack:
        p = stack.pop()
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as fh:
                    kids = [int(c) for c in fh.read().split()]
                out += kids
                stack += kids
        except (FileNotFoundError, ProcessLookupError):
            continue
    return out


def _worker_peaks() -> list[int]:
    """VmHWM in MiB of this process's Ray workers (title ``ray::...``)."""
    peaks = []
    for pid in _descendants(os.getpid()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                if not fh.read().startswith(b"ray::"):
                    continue
            with open(f"/proc/{pid}/status") as fh:
                hwm = next(line for line in fh if line.startswith("VmHWM:"))
        except (FileNotFoundError, StopIteration):
            continue
        peaks.append(round(int(hwm.split()[1]) / 1024))
    return sorted(peaks)


def _convert(src: Path, out: Path, args, **kw) -> dict:
    from ktconvert.convert import convert

    dropped = _drop_caches()
    t0 = time.monotonic()
    result = convert(src, out, type=args.type, max_memory=args.max_memory, **kw)
    wall = time.monotonic() - t0
    files = {k: v["sha256"] for k, v in result.manifest["files"].items()}
    shutil.rmtree(out)
    return {"wall_s": round(wall, 1), "mb_per_s": round(result.in_bytes / wall / 1e6, 1), "units": result.units,
            "page_cache_dropped": dropped, "sha256": files}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=None, help="where to write the checkpoint (default: a temp dir)")
    ap.add_argument("--size-gib", type=float, default=2.0)
    ap.add_argument("--type", default="Q8_0")
    ap.add_argument("--max-memory", default="1GiB")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import ray

    from ktconvert.convert.execute import ray_task_memory
    from ktconvert.io.sizes import parse_size

    base = Path(tempfile.mkdtemp(prefix="bench-ray-", dir=args.dir))
    try:
        src = base / "ckpt"
        layers = layers_for(args.size_gib)
        t0 = time.monotonic()
        total = write_checkpoint(src, layers)
        report = {"machine": {"cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0]},
                  "checkpoint": {"layers": layers, "gib": round(total / 2**30, 2), "write_s": round(time.monotonic() - t0, 1)},
                  "type": args.type, "max_memory": args.max_memory, "runs": []}
        local = _convert(src, base / "out-local", args, jobs=1)
        report["runs"].append({"executor": "local", "jobs": 1, **local})
        print(json.dumps(report["runs"][-1]), flush=True)
        for n in args.workers:
            t0 = time.monotonic()
            ray.init(address="local", num_cpus=n, include_dashboard=False, object_store_memory=100 * 2**20,
                     logging_level=logging.ERROR, log_to_driver=False)
            start = time.monotonic() - t0
            try:
                r = _convert(src, base / f"out-ray-{n}", args, jobs=n, executor="ray")
                peaks = _worker_peaks()
            finally:
                ray.shutdown()
            row = {"executor": "ray", "workers": n, "jobs": n, "ray_start_s": round(start, 1), **r,
                   "task_memory_mib": ray_task_memory(parse_size(args.max_memory), n) // 2**20,
                   "worker_peak_rss_mib": peaks, "identical_to_local": r["sha256"] == local["sha256"]}
            report["runs"].append(row)
            print(json.dumps(row), flush=True)
        print("\n| executor | workers (= --jobs) | wall | MB/s read | memory asked per task | peak RSS per worker | same bytes as local |")
        print("|---|---|---|---|---|---|---|")
        for r in report["runs"]:
            print(f"| {r['executor']} | {r.get('workers', '-')} | {r['wall_s']} s | {r['mb_per_s']} | "
                  f"{r.get('task_memory_mib', '-')} MiB | {', '.join(map(str, r.get('worker_peak_rss_mib', []))) or '-'} MiB | "
                  f"{r.get('identical_to_local', '-')} |")
        print(json.dumps({k: v for k, v in report.items() if k != "runs"}))
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
