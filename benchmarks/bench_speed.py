"""Issue 35's comparison in one command: ktconvert against the converters users would pick, on one synthetic
Qwen3-30B-A3B-shaped BF16 checkpoint, interleaved, the page cache dropped before each run.

    python benchmarks/bench_speed.py [--size-gib 6] [--dir DIR] [--jobs 2] [--max-memory 2GiB]

Runs, in this order (who goes first alternates from one comparison to the next):

1. AMXINT8: ``ktconvert quantize --to kt-amx -j 2``, kt-kernel's converter flow (``benchmarks/kt_upstream_flow.py``,
   as ``bench_kt_amx.py`` and the tests run kt-kernel's packer: per layer every expert loaded with safetensors'
   torch reader, stacked, packed by kt-kernel's compiled code with 2 threads into a /dev/shm scratch tree, one shard
   per layer), then ``ktconvert -j 1``; every expert tensor compared byte for byte with upstream's, ``-j 1``'s
   manifest sha256 with ``-j 2``'s.
2. AMXINT4: upstream first, then ktconvert ``-j 2``; compared byte for byte.
3. Q4_K_M: llama.cpp's flow first (``convert_hf_to_gguf.py --outtype bf16`` from the pinned llama-cpp-python sdist,
   then ``llama-quantize ... Q4_K_M 2`` from the cached build: ``tests/llamacpp_convert.py``,
   ``tests/llamacpp_tools.py``; its BF16 GGUF deleted once quantized; the page cache dropped before the convert
   only, as a user runs the two back to back), then ``ktconvert quantize --recipe Q4_K_M -j 2``; every GGUF
   tensor compared (name, type, bytes); then ``-j 1`` (``-j 2``'s scaling where the quantizers are the work),
   its manifest sha256 compared with ``-j 2``'s.
4. Three outputs (Q4_K_M, AMXINT4, Q8_0): three separate ``-j 2`` runs, then one ``--output ...`` run; each
   output's manifest sha256 compared with its separate run's (the manifests hash the bytes on disk).

Each run is a fresh process tree: wall time, user and system CPU (the process and its workers, from ``wait4``),
peak RSS sampled every 20 ms over the whole tree (and upstream's tmpfs scratch, which is memory too), the load
average when it ended. The cold read rate is one pass over every safetensors file with 64 MiB reads after a
drop; ktconvert's kt-amx MB/s (expert bytes / wall) is given as a share of it. The cold write rate is 1 GiB of
random bytes written around the page cache; a kt-amx run's read + written bytes per wall second are held
against both. Every drop is followed by a 3 s settle (``bench_convert.SETTLE_S``). Every output is deleted as soon
as it is compared, so the disk holds the checkpoint plus at most two outputs (or llama.cpp's BF16 GGUF and its
Q4_K_M). The checkpoint gets the tiny qwen3_moe model's tokenizer (both GGUF writers need one; it touches no
tensor). Prints one JSON line per run, then the summary.
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

import bench_convert as bc  # noqa: E402
from bench_kt_amx import compare as compare_kt_amx  # noqa: E402

PY = sys.executable
GOALS = {"kt_amx_int8": 3.0, "kt_amx_int4": 3.0, "q4_k_m": 5.0, "three_outputs": 2.0, "cold_read_share": 0.30}


def _run(name: str, cmd: list[str], *, drop: bool = True, scratch: Path | None = None, env: dict | None = None,
         log: list | None = None) -> dict:
    m = bc.measure(cmd, scratch, drop=drop, env=env)
    cpu = m["user_s"] + m["sys_s"]
    r = {"run": name, "wall_s": round(m["wall"], 2), "user_s": round(m["user_s"], 2), "sys_s": round(m["sys_s"], 2),
         "sys_share": round(m["sys_s"] / cpu, 3) if cpu else 0.0, "peak_rss_tree_mib": m["peak_rss_mib"],
         "scratch_peak_mib": m["scratch_peak_mib"], "page_cache_dropped": m["page_cache_dropped"],
         "load_average_1m": round(os.getloadavg()[0], 2)}
    print(json.dumps(r), flush=True)
    if log is not None:
        log.append(r)
    return r


def _sum(name: str, parts: list[dict]) -> dict:
    cpu = sum(p["user_s"] + p["sys_s"] for p in parts)
    sys_s = sum(p["sys_s"] for p in parts)
    return {"run": name, "wall_s": round(sum(p["wall_s"] for p in parts), 2), "user_s": round(cpu - sys_s, 2),
            "sys_s": round(sys_s, 2), "sys_share": round(sys_s / cpu, 3) if cpu else 0.0,
            "peak_rss_tree_mib": max(p["peak_rss_tree_mib"] for p in parts)}


def cold_read_rate(src: Path) -> dict:
    """Bytes per second of one pass over every safetensors file, page cache dropped first (64 MiB reads)."""
    bc._drop_caches()
    buf = bytearray(64 << 20)
    view = memoryview(buf)
    total, t0 = 0, time.monotonic()
    for f in sorted(src.glob("*.safetensors")):
        fd = os.open(f, os.O_RDONLY)
        try:
            off = 0
            while n := os.preadv(fd, [view], off):
                off += n
            total += off
        finally:
            os.close(fd)
    dt = time.monotonic() - t0
    return {"bytes": total, "seconds": round(dt, 2), "mb_per_s": round(total / dt / 1e6)}


def cold_write_rate(where: Path, nbytes: int = 1 << 30) -> dict:
    """Bytes per second of writing ``nbytes`` of random bytes around the page cache (``O_DIRECT`` 64 MiB writes,
    where the filesystem allows it, else through it with an fsync), after a drop: the disk's write rate, beside the
    cold read rate (a kt-amx conversion reads the experts and writes about half (AMXINT8) or a quarter (AMXINT4) of
    their bytes again)."""
    import mmap

    buf = mmap.mmap(-1, 64 << 20)
    buf.write(os.urandom(64 << 20))
    path = where / "write-rate.bin"
    bc._drop_caches()
    t0 = time.monotonic()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | getattr(os, "O_DIRECT", 0), 0o644)
    except OSError:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        off = 0
        while off < nbytes:
            off += os.pwrite(fd, buf, off)
        os.fsync(fd)
    finally:
        os.close(fd)
        path.unlink()
    dt = time.monotonic() - t0
    return {"bytes": nbytes, "seconds": round(dt, 2), "mb_per_s": round(nbytes / dt / 1e6)}


def _ours(src: Path, out: Path | None, args: list[str], jobs: int, budget: str) -> list[str]:
    where = [str(out)] if out is not None else []
    return [PY, "-m", "ktconvert", "-q", "quantize", str(src), *where, *args, "--jobs", str(jobs),
            "--max-memory", budget]


def _upstream(src: Path, out: Path, method: str, layers: int, threads: int, job_file: Path) -> tuple[list, Path]:
    scratch = Path("/dev/shm") / f"kt_bench_speed_{os.getpid()}"
    job_file.write_text(json.dumps({"job": "upstream", "method": method, "src": str(src), "out": str(out),
                                    "scratch": str(scratch), "E": bc.E, "H": bc.H, "I": bc.I, "P": 2,
                                    "threads": threads, "layers": list(range(layers))}))
    return [PY, str(HERE / "kt_upstream_flow.py"), str(job_file)], scratch


def _moved(read: int, written: int, *runs: dict) -> dict:
    """A kt-amx run's disk traffic: the expert bytes it read and the bytes it wrote, and their sum per wall second
    of each run (the disk reads and writes in the same seconds: the figure to hold against its rates)."""
    return {"written_bytes": written,
            "read_plus_written_mb_per_s": [round((read + written) / r["wall_s"] / 1e6) for r in runs]}


def _files(out: Path) -> dict:
    return {n: f["sha256"] for n, f in json.loads((out / "manifest.json").read_text())["files"].items()}


def _rm(*paths: Path) -> None:
    for p in paths:
        shutil.rmtree(p, ignore_errors=True)
        if p.is_file():
            p.unlink()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=None, help="where to write the checkpoint (default: a temp dir)")
    ap.add_argument("--size-gib", type=float, default=6.0)
    ap.add_argument("--layers", type=int, default=0, help="this many layers instead of --size-gib's")
    ap.add_argument("--vocab", type=int, default=bc.VOCAB, help="vocabulary (smaller: a quick trial run)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2, help="kt-kernel's and llama-quantize's threads")
    ap.add_argument("--max-memory", default="2GiB")
    ap.add_argument("--skip", nargs="*", default=[], choices=["int8", "int4", "q4", "outputs"])
    a = ap.parse_args(argv)
    bc.VOCAB = a.vocab
    layers = a.layers or bc.layers_for(a.size_gib)
    base = Path(tempfile.mkdtemp(prefix="bench-speed-", dir=a.dir))
    log: list[dict] = []
    rep: dict = {"cpu": bc._cpu_model(), "cpus": os.cpu_count(), "load_average_start": list(os.getloadavg())}
    try:
        src = base / "src"
        t0 = time.monotonic()
        size = bc.write_checkpoint(src, layers)
        from ktconvert.model.tiny import write_tiny_model

        write_tiny_model("qwen3_moe", base / "tiny")
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(base / "tiny" / f, src / f)
        _rm(base / "tiny")
        experts = layers * bc.E * 3 * bc.I * bc.H * 2
        rep["checkpoint"] = {"layers": layers, "vocab": a.vocab, "bytes": size, "gb": round(size / 1e9, 2),
                             "expert_bytes": experts, "write_s": round(time.monotonic() - t0, 1)}
        print(json.dumps(rep["checkpoint"]), flush=True)
        need = 2.4 * size
        free = shutil.disk_usage(base).free
        if free - need < 8e9:
            raise SystemExit(f"{base}: {free / 1e9:.1f} GB free; this run needs about {need / 1e9:.1f} GB more and "
                             f"8 GB must stay free: pass a smaller --size-gib")
        rep["cold_read"] = cold_read_rate(src)
        rep["cold_write"] = cold_write_rate(base)
        print(json.dumps({"cold_read": rep["cold_read"], "cold_write": rep["cold_write"]}), flush=True)
        job = base / "job.json"
        kt = ["--to", "kt-amx", "--threadpool-count", "2"]
        res: dict = {}

        if "int8" not in a.skip:
            ours2 = _run("ktconvert AMXINT8 -j2", _ours(src, base / "k8", [*kt, "--type", "AMXINT8"], a.jobs,
                                                          a.max_memory), log=log)
            cmd, shm = _upstream(src, base / "u8", "AMXINT8", layers, a.threads, job)
            up = _run("kt-kernel converter AMXINT8", cmd, scratch=shm, log=log)
            _rm(shm)
            out8 = bc._dir_bytes(base / "k8")
            same = compare_kt_amx(base / "k8", base / "u8")
            _rm(base / "u8")
            ours1 = _run("ktconvert AMXINT8 -j1", _ours(src, base / "k8j1", [*kt, "--type", "AMXINT8"], 1,
                                                          a.max_memory), log=log)
            j_same = _files(base / "k8j1") == _files(base / "k8")
            _rm(base / "k8", base / "k8j1")
            res["kt_amx_int8"] = {"ours": ours2, "upstream": up, "ratio": round(up["wall_s"] / ours2["wall_s"], 2),
                                  "bytes_equal": same, "ours_j1": ours1, "j1_j2_identical": j_same,
                                  "j2_over_j1": round(ours1["wall_s"] / ours2["wall_s"], 2),
                                  "mb_per_s": round(experts / ours2["wall_s"] / 1e6),
                                  "cold_read_share": round(experts / ours2["wall_s"] / 1e6
                                                           / rep["cold_read"]["mb_per_s"], 3),
                                  **_moved(experts, out8, ours2, ours1)}
        if "int4" not in a.skip:
            cmd, shm = _upstream(src, base / "u4", "AMXINT4", layers, a.threads, job)
            up = _run("kt-kernel converter AMXINT4", cmd, scratch=shm, log=log)
            _rm(shm)
            ours2 = _run("ktconvert AMXINT4 -j2", _ours(src, base / "k4", [*kt, "--type", "AMXINT4"], a.jobs,
                                                          a.max_memory), log=log)
            out4 = bc._dir_bytes(base / "k4")
            same = compare_kt_amx(base / "k4", base / "u4")
            _rm(base / "k4", base / "u4")
            res["kt_amx_int4"] = {"ours": ours2, "upstream": up, "ratio": round(up["wall_s"] / ours2["wall_s"], 2),
                                  "bytes_equal": same, "mb_per_s": round(experts / ours2["wall_s"] / 1e6),
                                  "cold_read_share": round(experts / ours2["wall_s"] / 1e6
                                                           / rep["cold_read"]["mb_per_s"], 3),
                                  **_moved(experts, out4, ours2)}
        if "q4" not in a.skip:
            import llamacpp_convert
            import llamacpp_tools

            root = llamacpp_convert.sources()
            exe = llamacpp_tools.build(("llama-quantize",)) / "llama-quantize"
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            conv = _run("llama.cpp convert_hf_to_gguf bf16",
                        [PY, "-c", llamacpp_convert.CHILD, str(root), str(src), str(base / "bf16.gguf"), "bf16", "0"],
                        env=env, log=log)
            quant = _run("llama.cpp llama-quantize Q4_K_M", [str(exe), str(base / "bf16.gguf"),
                                                               str(base / "llama-q4.gguf"), "Q4_K_M",
                                                               str(a.threads)], drop=False, log=log)
            _rm(base / "bf16.gguf")
            ours2 = _run("ktconvert Q4_K_M -j2", _ours(src, base / "q4", ["--recipe", "Q4_K_M"], a.jobs,
                                                         a.max_memory), log=log)
            same, total = bc._same_tensors(base / "q4" / "model.gguf", base / "llama-q4.gguf")
            _rm(base / "llama-q4.gguf")
            # the same conversion with one process: -j 2's scaling where the work is the quantizers' (compute),
            # beside AMXINT8's, where it is the read
            ours1 = _run("ktconvert Q4_K_M -j1", _ours(src, base / "q4j1", ["--recipe", "Q4_K_M"], 1, a.max_memory),
                         log=log)
            j_same = _files(base / "q4j1") == _files(base / "q4")
            _rm(base / "q4", base / "q4j1")
            flow = _sum("llama.cpp convert + quantize", [conv, quant])
            res["q4_k_m"] = {"ours": ours2, "upstream": flow, "ratio": round(flow["wall_s"] / ours2["wall_s"], 2),
                             "tensors_identical": f"{same}/{total}", "ours_j1": ours1, "j1_j2_identical": j_same,
                             "j2_over_j1": round(ours1["wall_s"] / ours2["wall_s"], 2)}
        if "outputs" not in a.skip:
            outs = [("Q4_K_M", ["--recipe", "Q4_K_M"]), ("AMXINT4", [*kt, "--type", "AMXINT4"]),
                    ("Q8_0", ["--recipe", "Q8_0"])]
            sep, hashes = [], {}
            for t, args in outs:
                sep.append(_run(f"ktconvert {t} -j2 (separate)", _ours(src, base / f"s-{t}", args, a.jobs,
                                                                       a.max_memory), log=log))
                hashes[t] = _files(base / f"s-{t}")
                _rm(base / f"s-{t}")
            multi = [x for t, _ in outs for x in ("--output", f"{t}={base / f'o-{t}'}")]
            kt_opt = ["--threadpool-count", "2"]
            one = _run("ktconvert three outputs, one read -j2",
                       _ours(src, None, [*multi, *kt_opt], a.jobs, a.max_memory), log=log)
            same = {t: _files(base / f"o-{t}") == hashes[t] for t, _ in outs}
            _rm(*(base / f"o-{t}" for t, _ in outs))
            three = _sum("three separate runs", sep)
            res["three_outputs"] = {"one_read": one, "separate": three,
                                    "ratio": round(three["wall_s"] / one["wall_s"], 2), "identical": same}
        rep["results"] = res
        rep["goals"] = GOALS
        rep["load_average_end"] = list(os.getloadavg())
        print(json.dumps(rep, indent=2))
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
