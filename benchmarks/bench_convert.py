"""Convert a synthetic checkpoint of at least 8 GiB under ``--max-memory 1GiB``: peak RSS, MB/s, --jobs 1 vs 2.

The checkpoint is Qwen3-30B-A3B-shaped (H=2048, 128 experts of I=768, 32 heads / 4 KV heads of 128, a 151936
vocabulary), BF16, per-expert tensors in 4 GiB safetensors shards with an index, and as many layers as it takes
to pass ``--size-gib``. It is written to disk for real (a 64 MiB block of random normal BF16 values repeated,
so generating it is I/O-bound, not RNG-bound) and removed afterwards, as is every output.

Each conversion is a fresh ``python -m ktconvert quantize`` process. Peak RSS is sampled from /proc every 20 ms
over the whole process tree (the parent plus its ``--jobs`` workers, summed), and also reported per process
(wait4's ru_maxrss of the parent). The fixed overhead is the peak RSS of the same command converting the
tiny qwen3_moe model (interpreter, numpy, torch, the quantizers: no working set to speak of). With
``--small-gib`` a second, smaller checkpoint is converted with the same budget, to show peak RSS does not grow
with the checkpoint.

With ``--fp8`` the checkpoint is an FP8 block-scaled release instead (as DeepSeek-V3 / Qwen3-FP8 ship: every
linear weight but the router F8_E4M3 with an F32 ``_scale_inv`` per 128x128 block, the rest BF16, config.json
with ``quantization_config``), so the run measures the exact dequantization on top of the conversion;
``--to hf`` benchmarks the FP8 -> Hugging Face BF16 form (``--type BF16``) instead of GGUF.

    python benchmarks/bench_convert.py [--dir DIR] [--size-gib 8] [--small-gib 2] [--type Q8_0] [--jobs 1 2]
                                       [--fp8] [--to gguf|hf]

With ``--vs-llama`` it instead compares a whole Q4_K_M conversion with llama.cpp's own quantizer: the checkpoint
is converted once to an F32 GGUF, then ``ktconvert quantize F32.gguf --recipe Q4_K_M --jobs N`` and
``llama_model_quantize`` (llama-cpp-python's binding of the C entry point ``llama-quantize`` calls, built by
tests/llamacpp_runner.py, ``nthread = N``) quantize that same file, interleaved, ``--repeat`` times each, page cache
left warm for both; wall time and peak RSS (process tree) medians, and whether every tensor came out with the same
type and bytes:

    python benchmarks/bench_convert.py --vs-llama [--size-gib 1.5] [--threads N] [--repeat 3] [--max-memory 2GiB]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import math

import numpy as np

H, I, E, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 2048, 768, 128, 32, 4, 128, 151936
SHARD = 4 << 30
BLOCK = 64 << 20


def _config(layers: int, fp8: bool | str = False) -> dict:
    quant = {"quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                     "weight_block_size": [128, 128]}} if fp8 is True else {}
    if fp8 == "rawint4":  # Kimi-K2-Thinking's compressed-tensors form, from the one place that writes it
        from ktconvert.model.tiny_release import RELEASES

        quant = dict(RELEASES["rawint4"][0])
    return {**quant, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": H,
            "moe_intermediate_size": I, "intermediate_size": 6144, "num_experts": E, "num_experts_per_tok": 8,
            "num_hidden_layers": layers, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
            "head_dim": HEAD_DIM, "vocab_size": VOCAB, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
            "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


def _tensors(layers: int) -> list[tuple[str, tuple[int, ...]]]:
    out = [("model.embed_tokens.weight", (VOCAB, H))]
    for L in range(layers):
        p = f"model.layers.{L}."
        out += [(p + "input_layernorm.weight", (H,)), (p + "post_attention_layernorm.weight", (H,)),
                (p + "self_attn.q_proj.weight", (HEADS * HEAD_DIM, H)),
                (p + "self_attn.k_proj.weight", (KV_HEADS * HEAD_DIM, H)),
                (p + "self_attn.v_proj.weight", (KV_HEADS * HEAD_DIM, H)),
                (p + "self_attn.o_proj.weight", (H, HEADS * HEAD_DIM)),
                (p + "self_attn.q_norm.weight", (HEAD_DIM,)), (p + "self_attn.k_norm.weight", (HEAD_DIM,)),
                (p + "mlp.gate.weight", (E, H))]
        for e in range(E):
            out += [(p + f"mlp.experts.{e}.gate_proj.weight", (I, H)), (p + f"mlp.experts.{e}.up_proj.weight", (I, H)),
                    (p + f"mlp.experts.{e}.down_proj.weight", (H, I))]
    out += [("model.norm.weight", (H,)), ("lm_head.weight", (VOCAB, H))]
    return out


_SIZE = {"BF16": 2, "F8_E4M3": 1, "F32": 4, "I32": 4}


def _nbytes(shape, dtype: str = "BF16") -> int:
    return _SIZE[dtype] * int(np.prod(shape))


def _stored(layers: int, fp8: bool | str) -> list[tuple[str, str, tuple[int, ...]]]:
    """``(name, dtype, shape)`` of every stored tensor: BF16, or FP8 weights each followed by its scale grid, or
    (``"rawint4"``) routed experts as compressed-tensors INT4 (weight_packed, weight_scale per 32, weight_shape)."""
    out = []
    for name, shape in _tensors(layers):
        if fp8 == "rawint4":
            if ".experts." in name:
                base = name[: -len("weight")]
                out += [(base + "weight_packed", "I32", (shape[0], shape[1] // 8)),
                        (base + "weight_scale", "BF16", (shape[0], shape[1] // 32)),
                        (base + "weight_shape", "I32", (2,))]
            else:
                out.append((name, "BF16", shape))
        elif fp8 and len(shape) == 2 and not name.endswith(("embed_tokens.weight", "lm_head.weight", "mlp.gate.weight")):
            out += [(name, "F8_E4M3", shape),
                    (name + "_scale_inv", "F32", (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128)))]
        else:
            out.append((name, "BF16", shape))
    return out


def layers_for(size_gib: float, fp8: bool = False) -> int:
    layers = 1
    while sum(_nbytes(s, d) for _, d, s in _stored(layers, fp8)) < size_gib * (1 << 30):
        layers += 1
    return layers


def default_raws(block: int = BLOCK) -> dict[str, np.ndarray]:
    """Per stored dtype, the block of bytes every tensor of that dtype is cut from (cycled): BF16 normal values of
    std 0.02, uniform E4M3 codes (no NaN), F32 block scales in [1e-4, 2e-4), uniform I32 bytes."""
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 256, block, dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # E4M3FN's NaN codes
    return {"BF16": ((rng.standard_normal(block // 2, dtype=np.float32) * 0.02).view(np.uint32) >> 16)
            .astype(np.uint16).view(np.uint8),
            "F8_E4M3": codes,
            "F32": (rng.random(1 << 20, dtype=np.float32) * 1e-4 + 1e-4).view(np.uint8),
            "I32": rng.integers(0, 256, block, dtype=np.uint8)}


def write_checkpoint(root: Path, layers: int, fp8: bool = False, *, config: dict | None = None,
                     stored: list | None = None, raws: dict | None = None, fill: dict | None = None) -> int:
    """Sharded safetensors + index + config.json; returns the bytes of tensor data written.

    By default the Qwen3-30B-A3B-shaped model of ``layers`` layers; ``config`` and ``stored`` (``(name, dtype,
    shape)`` per tensor) write another model, ``raws`` replaces :func:`default_raws`, and ``fill`` maps a tensor
    name to its exact bytes (norms of ones, a router row, a bias)."""
    from ktconvert.formats.safetensors_write import write_safetensors

    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(config or _config(layers, fp8), indent=2))
    raws = raws or default_raws()
    fill = fill or {}
    shapes = {n[: -len("weight")] + "weight_shape": s for n, s in _tensors(layers)} if stored is None else {}
    shards, cur, used = [], [], 0
    for name, dtype, shape in (stored if stored is not None else _stored(layers, fp8)):
        n = _nbytes(shape, dtype)
        if cur and used + n > SHARD:
            shards.append(cur)
            cur, used = [], 0
        cur.append((name, dtype, shape))
        used += n
    shards.append(cur)
    weight_map, total, pos = {}, 0, 0

    def chunks(n: int, raw: np.ndarray):
        def gen():
            nonlocal pos
            left = n
            while left:
                start = (pos % len(raw)) & ~3  # keep F32 scales aligned to whole values
                take = min(left, len(raw) - start)
                yield raw[start:start + take].tobytes()
                pos += take
                left -= take
        return gen

    for i, members in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(root / fname, [(n, d, s, _nbytes(s, d),
                                          (lambda v=fill[n]: iter([v])) if n in fill else
                                          (lambda v=shapes[n]: iter([np.array(v, "<i4").tobytes()]))
                                          if n.endswith("weight_shape") else chunks(_nbytes(s, d), raws[d]))
                                         for n, d, s in members], {"format": "pt"})
        for n, d, s in members:
            weight_map[n] = fname
            total += _nbytes(s, d)
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": weight_map}))
    return total


def _tree_rss(pid: int) -> int:
    """Sum of VmRSS over ``pid`` and its descendants, in bytes (0 if it is gone)."""
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        try:
            with open(f"/proc/{p}/status") as fh:
                for line in fh:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
                        break
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as fh:
                    stack.extend(int(c) for c in fh.read().split())
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return total


#: Seconds to wait after ``sync`` and the drop, before a timed run: a VM's disk may still be taking the last run's
#: writes from the host's cache after the guest's ``sync`` returned (a run right after llama.cpp's 12 GB BF16 GGUF
#: or kt-kernel's converter measured up to 40% slower than the same command a run later; docs/measurements.md).
SETTLE_S = 3.0


def _drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("3\n")
    except OSError:
        return False
    time.sleep(SETTLE_S)
    return True


def _dir_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.stat(os.path.join(root, f)).st_size
            except FileNotFoundError:
                pass
    return total


def measure(cmd: list[str], scratch: Path | None = None, drop: bool = True, env: dict | None = None,
            ok: tuple[int, ...] = (0,)) -> dict:
    """Run ``cmd`` as a fresh process (page cache dropped first when possible and ``drop``) and sample every 20 ms the
    RSS of its process tree and, with ``scratch``, that directory's size (tmpfs pages are memory too). Exits when
    the exit code is not in ``ok``."""
    dropped = _drop_caches() if drop else False
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    peak, shm = [0], [0]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], _tree_rss(proc.pid))
            if scratch is not None:
                shm[0] = max(shm[0], _dir_bytes(scratch))
            time.sleep(0.02)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.append(proc.stderr.read()), daemon=True)
    reader.start()
    stdout = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)  # the parent's own peak RSS, from the kernel
    wall = time.monotonic() - t0
    stop.set()
    th.join()
    reader.join()
    code = os.waitstatus_to_exitcode(status)
    if code not in ok:
        raise SystemExit(f"{cmd[:4]} failed ({code}): {''.join(err).strip()[-2000:]}")
    return {"wall_s": round(wall, 1), "peak_rss_mib": round(peak[0] / 2**20), "scratch_peak_mib": round(shm[0] / 2**20),
            "peak_rss_parent_mib": round(usage.ru_maxrss / 1024), "page_cache_dropped": dropped, "stdout": stdout,
            # user + system CPU seconds of the process and the children it waited for (a kernel child, reaped
            # workers): on a shared machine the wall time waits for other processes' turns, these do not
            "cpu_s": round(usage.ru_utime + usage.ru_stime, 1), "user_s": usage.ru_utime, "sys_s": usage.ru_stime,
            "wall": wall, "code": code, "stderr": "".join(err)}


def run(src: Path, out: Path, qtype: str, jobs: int, budget: str, to: str = "gguf") -> dict:
    cmd = [sys.executable, "-m", "ktconvert", "quantize", str(src), str(out), "--type", qtype, "--max-memory", budget,
           "--jobs", str(jobs), "--to", to, "-o", "json"]
    m = measure(cmd)
    rep = json.loads(m["stdout"])
    in_bytes = rep["plan"]["input_bytes"]
    return {"command": " ".join(["ktconvert", *cmd[3:]]), "jobs": jobs, "type": qtype, "max_memory": budget,
            "wall_s": m["wall_s"], "input_bytes": in_bytes, "output_bytes": rep["plan"]["output_bytes"],
            "mb_per_s": round(in_bytes / m["wall"] / 1e6, 1), "peak_rss_tree_mib": m["peak_rss_mib"],
            "peak_rss_parent_mib": m["peak_rss_parent_mib"], "page_cache_dropped": m["page_cache_dropped"]}


LLAMA_QUANTIZE = r"""
import json, sys
import llama_cpp
spec = json.loads(sys.argv[1])
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = spec["ftype"]
params.nthread = spec["nthread"]
rc = llama_cpp.llama_model_quantize(spec["inp"].encode(), spec["out"].encode(), params)
sys.exit(0 if rc == 0 else 7)
"""


def _same_tensors(a: Path, b: Path) -> tuple[int, int]:
    """(tensors with the same name, type and bytes in both GGUFs, tensors in ``b``)."""
    from gguf import GGUFReader

    ta = {t.name: t for t in GGUFReader(a).tensors}
    tb = GGUFReader(b).tensors
    same = sum(1 for t in tb if t.name in ta and ta[t.name].tensor_type == t.tensor_type
               and np.array_equal(np.asarray(ta[t.name].data).view(np.uint8), np.asarray(t.data).view(np.uint8)))
    return same, len(tb)


def vs_llama(args, base: Path) -> dict:
    """ktconvert's Q4_K_M conversion against llama_model_quantize on the same F32 GGUF, same thread count."""
    import statistics

    from gguf import LlamaFileType

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import llamacpp_runner

    target = llamacpp_runner.ensure_built()
    threads = args.threads or len(os.sched_getaffinity(0))
    src = base / "ckpt"
    layers = layers_for(args.size_gib)
    write_checkpoint(src, layers)
    f32 = base / "f32"
    subprocess.run([sys.executable, "-m", "ktconvert", "quantize", str(src), str(f32), "--type", "F32",
                    "--max-memory", args.max_memory, "--jobs", str(threads), "--no-tokenizer"], check=True,
                   capture_output=True)
    shutil.rmtree(src)
    gguf_in = f32 / "model.gguf"
    ours_cmd = [sys.executable, "-m", "ktconvert", "quantize", str(gguf_in), str(base / "ours"), "--recipe", "Q4_K_M",
                "--max-memory", args.max_memory, "--jobs", str(threads), "--force", "-o", "json"]
    spec = json.dumps({"inp": str(gguf_in), "out": str(base / "llama.gguf"), "nthread": threads,
                       "ftype": int(LlamaFileType.MOSTLY_Q4_K_M)})
    llama_cmd = [sys.executable, "-c", LLAMA_QUANTIZE, spec]
    llama_env = {**os.environ, "PYTHONPATH": str(target), "OMP_NUM_THREADS": "1"}
    runs: dict[str, list[dict]] = {"ktconvert": [], "llama_model_quantize": []}
    for r in range(args.repeat):
        order = ["ktconvert", "llama_model_quantize"] if r % 2 == 0 else ["llama_model_quantize", "ktconvert"]
        for who in order:
            m = measure(ours_cmd, drop=False) if who == "ktconvert" else measure(llama_cmd, drop=False, env=llama_env)
            runs[who].append({"wall_s": m["wall_s"], "peak_rss_mib": m["peak_rss_mib"]})
            print(json.dumps({"run": r, "who": who, **runs[who][-1]}), flush=True)
    same, total = _same_tensors(base / "ours" / "model.gguf", base / "llama.gguf")
    med = {who: {k: statistics.median(x[k] for x in v) for k in ("wall_s", "peak_rss_mib")} for who, v in runs.items()}
    return {"cpu": _cpu_model(), "threads": threads, "repeat": args.repeat, "max_memory": args.max_memory,
            "f32_gguf_gib": round(gguf_in.stat().st_size / 2**30, 2), "layers": layers,
            "ktconvert_command": " ".join(["ktconvert", *ours_cmd[3:]]), "median": med,
            "speedup": round(med["llama_model_quantize"]["wall_s"] / med["ktconvert"]["wall_s"], 2),
            "tensors_identical": f"{same}/{total}", "runs": runs,
            "load_average_end": round(os.getloadavg()[0], 2)}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=None, help="where to write the checkpoints (default: a temp dir)")
    ap.add_argument("--size-gib", type=float, default=8.0)
    ap.add_argument("--small-gib", type=float, default=0.0, help="also convert a smaller checkpoint (0: skip)")
    ap.add_argument("--type", default="Q8_0")
    ap.add_argument("--max-memory", default="1GiB")
    ap.add_argument("--jobs", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--fp8", action="store_true", help="an FP8 block-scaled checkpoint (F8_E4M3 + F32 _scale_inv)")
    ap.add_argument("--rawint4", action="store_true", help="routed experts as compressed-tensors INT4 (Kimi's form)")
    ap.add_argument("--to", choices=["gguf", "hf"], default="gguf", help="hf: the Hugging Face form (--type BF16)")
    ap.add_argument("--vs-llama", action="store_true", help="Q4_K_M: ktconvert vs llama_model_quantize, same threads")
    ap.add_argument("--threads", type=int, default=0, help="--vs-llama: --jobs / nthread (default: every core)")
    ap.add_argument("--repeat", type=int, default=3, help="--vs-llama: runs of each, interleaved")
    args = ap.parse_args(argv)
    if args.vs_llama:
        base = Path(tempfile.mkdtemp(prefix="bench-vs-llama-", dir=args.dir))
        try:
            print(json.dumps(vs_llama(args, base), indent=2))
        finally:
            shutil.rmtree(base, ignore_errors=True)
        return
    if args.rawint4:
        args.fp8 = "rawint4"

    base = Path(tempfile.mkdtemp(prefix="bench-convert-", dir=args.dir))
    try:
        free = shutil.disk_usage(base).free
        need = int(args.size_gib * 1.7 * (1 << 30))
        if free < need:
            raise SystemExit(f"{base}: {free / 2**30:.1f} GiB free, this benchmark needs about {need / 2**30:.1f} GiB")
        results = {"machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]}, "runs": []}
        # fixed overhead: the same command on the tiny model
        from ktconvert.model.tiny import write_tiny_model

        write_tiny_model("qwen3_moe", base / "tiny")
        results["overhead"] = run(base / "tiny", base / "tiny-out", args.type, 1, args.max_memory, args.to)
        shutil.rmtree(base / "tiny-out")
        sizes = [args.size_gib] + ([args.small_gib] if args.small_gib else [])
        for size in sizes:
            src = base / f"ckpt-{size:g}g"
            layers = layers_for(size, args.fp8)
            t0 = time.monotonic()
            total = write_checkpoint(src, layers, args.fp8)
            gen = time.monotonic() - t0
            results["runs"].append({"checkpoint": {"layers": layers, "bytes": total, "gib": round(total / 2**30, 2),
                                                   "write_s": round(gen, 1)}})
            for jobs in (args.jobs if size == args.size_gib else [1]):
                out = base / f"out-{size:g}g-j{jobs}"
                r = run(src, out, args.type, jobs, args.max_memory, args.to)
                shutil.rmtree(out)
                results["runs"].append(r)
                print(json.dumps(r), flush=True)
            shutil.rmtree(src)
        print(json.dumps(results, indent=2))
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
