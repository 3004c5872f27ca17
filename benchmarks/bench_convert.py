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


def write_checkpoint(root: Path, layers: int, fp8: bool = False) -> int:
    """Sharded safetensors + index + config.json; returns the bytes of tensor data written."""
    from ktconvert.formats.safetensors_write import write_safetensors

    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(_config(layers, fp8), indent=2))
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 256, BLOCK, dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # E4M3FN's NaN codes
    raws = {"BF16": ((rng.standard_normal(BLOCK // 2, dtype=np.float32) * 0.02).view(np.uint32) >> 16)
            .astype(np.uint16).view(np.uint8),
            "F8_E4M3": codes,
            "F32": (rng.random(1 << 20, dtype=np.float32) * 1e-4 + 1e-4).view(np.uint8),
            "I32": rng.integers(0, 256, BLOCK, dtype=np.uint8)}
    shapes = {n[: -len("weight")] + "weight_shape": s for n, s in _tensors(layers)}
    shards, cur, used = [], [], 0
    for name, dtype, shape in _stored(layers, fp8):
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


def _drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("3\n")
        return True
    except OSError:
        return False


def _dir_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.stat(os.path.join(root, f)).st_size
            except FileNotFoundError:
                pass
    return total


def measure(cmd: list[str], scratch: Path | None = None) -> dict:
    """Run ``cmd`` as a fresh process (page cache dropped first when possible) and sample every 20 ms the RSS of its
    process tree and, with ``scratch``, that directory's size (tmpfs pages are memory too). Exits on failure."""
    dropped = _drop_caches()
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
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
    if code:
        raise SystemExit(f"{cmd[:4]} failed ({code}): {''.join(err).strip()[-2000:]}")
    return {"wall_s": round(wall, 1), "peak_rss_mib": round(peak[0] / 2**20), "scratch_peak_mib": round(shm[0] / 2**20),
            "peak_rss_parent_mib": round(usage.ru_maxrss / 1024), "page_cache_dropped": dropped, "stdout": stdout,
            "wall": wall}


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
    args = ap.parse_args(argv)
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
