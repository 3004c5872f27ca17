"""``ktconvert quantize --to kt-amx`` vs upstream's converter path, on a synthetic checkpoint far larger than
``--max-memory``: wall time, peak RSS (and tmpfs scratch) of both, in one run, plus a byte comparison.

The checkpoint is bench_convert.py's Qwen3-30B-A3B-shaped BF16 model (H=2048, 128 experts of I=768, per-expert
tensors, 4 GiB shards), with as many layers as ``--size-gib`` needs. Upstream's path is
``benchmarks/kt_upstream_flow.py``: convert_cpu_weights.py's flow step for step (per layer:
every expert loaded with safetensors' torch reader and cast to bf16, stacked, quantized and saved by kt-kernel's
compiled packer into a /dev/shm scratch tree, read back, one safetensors shard per layer). Neither side writes
the non-expert shard. Each run is a fresh process; RSS is sampled every 20 ms over its process tree, and the
scratch directory's size with it (tmpfs pages are memory too). Page cache is dropped before each run when
possible. At the end every tensor of the two outputs is compared byte for byte.

    python benchmarks/bench_kt_amx.py [--dir DIR] [--size-gib 6] [--type AMXINT8] [--max-memory 512MiB]
                                      [--threadpool-count 2] [--jobs 1 2] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_convert import E, H, I, layers_for, measure, write_checkpoint  # noqa: E402


def _measure(cmd: list[str], scratch: Path | None = None) -> dict:
    m = measure(cmd, scratch)
    return {k: m[k] for k in ("wall_s", "peak_rss_mib", "scratch_peak_mib", "page_cache_dropped", "stdout")}


def run_ktconvert(src: Path, out: Path, method: str, parts: int, jobs: int, budget: str) -> dict:
    cmd = [sys.executable, "-m", "ktconvert", "quantize", str(src), str(out), "--to", "kt-amx", "--type", method,
           "--threadpool-count", str(parts), "--max-memory", budget, "--jobs", str(jobs), "-o", "json"]
    r = _measure(cmd)
    rep = json.loads(r.pop("stdout"))
    return {"path": "ktconvert", "command": " ".join(["ktconvert", *cmd[3:]]), "jobs": jobs, **r,
            "expert_bytes_in": rep["plan"]["input_bytes"], "bytes_out": rep["plan"]["output_bytes"]}


def run_upstream(src: Path, out: Path, method: str, parts: int, threads: int, layers: int) -> dict:
    scratch = Path("/dev/shm") / f"kt_convert_bench_{os.getpid()}"
    job = {"job": "upstream", "method": method, "src": str(src), "out": str(out), "scratch": str(scratch),
           "E": E, "H": H, "I": I, "P": parts, "threads": threads, "layers": list(range(layers))}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump(job, fh)
    try:
        r = _measure([sys.executable, str(Path(__file__).with_name("kt_upstream_flow.py")), fh.name], scratch)
    finally:
        os.unlink(fh.name)
        shutil.rmtree(scratch, ignore_errors=True)
    r.pop("stdout")
    return {"path": "upstream (kt-kernel packer, convert_cpu_weights.py flow)", "threads": threads, **r}


def compare(a: Path, b: Path) -> dict:
    """Every tensor of the two kt-amx directories, byte for byte (one tensor in memory at a time)."""
    from ktconvert.formats import open_checkpoint

    ca, cb = open_checkpoint(a), open_checkpoint(b)
    names = sorted(n for n in ca if n.startswith("blk."))
    other = sorted(n for n in cb if n.startswith("blk."))
    diff = [n for n in names if n in cb and ca.read(n).tobytes() != cb.read(n).tobytes()]
    return {"tensors": len(names), "same_names": names == other, "differing": len(diff), "first_differing": diff[:3]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=None, help="where to write the checkpoint (default: a temp dir)")
    ap.add_argument("--size-gib", type=float, default=6.0)
    ap.add_argument("--type", default="AMXINT8", choices=["AMXINT8", "AMXINT4"])
    ap.add_argument("--max-memory", default="512MiB")
    ap.add_argument("--threadpool-count", type=int, default=2)
    ap.add_argument("--jobs", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="kt-kernel threads for upstream's path")
    ap.add_argument("--skip-upstream", action="store_true")
    args = ap.parse_args(argv)

    base = Path(tempfile.mkdtemp(prefix="bench-kt-amx-", dir=args.dir))
    try:
        layers = layers_for(args.size_gib)
        t0 = time.monotonic()
        total = write_checkpoint(base / "ckpt", layers)
        results = {"machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
                   "checkpoint": {"layers": layers, "experts": E, "H": H, "I": I, "gib": round(total / 2**30, 2),
                                  "write_s": round(time.monotonic() - t0, 1)},
                   "method": args.type, "threadpool_count": args.threadpool_count, "runs": []}
        print(json.dumps(results["checkpoint"]), flush=True)
        outs = []
        for jobs in args.jobs:
            out = base / f"kt-j{jobs}"
            r = run_ktconvert(base / "ckpt", out, args.type, args.threadpool_count, jobs, args.max_memory)
            results["runs"].append(r)
            outs.append(out)
            print(json.dumps(r), flush=True)
        if not args.skip_upstream:
            up = base / "upstream"
            r = run_upstream(base / "ckpt", up, args.type, args.threadpool_count, args.threads, layers)
            results["runs"].append(r)
            print(json.dumps(r), flush=True)
            results["bytes_equal"] = compare(outs[0], up)
        for o in outs[1:]:
            results.setdefault("jobs_equal", []).append(compare(outs[0], o))
        print(json.dumps(results, indent=2))
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
