"""Time ``ktconvert inspect`` (no --scan) on synthetic multi-GB checkpoints and measure its peak RSS.

Two DeepSeek-V2-Lite-shaped checkpoints (27 layers, first one dense, 64 experts, H=2048, I=1408) are written as
sparse files: real headers, data regions that take no disk space.
  * safetensors, BF16, per-expert tensors, sharded with model.safetensors.index.json (headers written here and
    checked with the safetensors package's own safe_open);
  * GGUF written by the gguf package's GGUFWriter (gate/up Q4_K, down Q8_0, a 102400-token vocabulary and
    99757 merges as real V2-Lite GGUFs carry), tensor data left sparse.
inspect without --scan reads only headers, so sparse data keeps the measurement honest: nothing would read it.
Each CLI run is a fresh ``python -m ktconvert inspect PATH -o json`` process; its wall time includes interpreter
start and imports, its peak RSS comes from wait4(). "in-process" times the library call alone
(``build_inspect_report``, imports already done). The files are removed afterwards.

    python benchmarks/bench_inspect.py [--dir DIR] [--repeat N]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LAYERS, FIRST_DENSE, EXPERTS, H, I, DENSE_I, VOCAB = 27, 1, 64, 2048, 1408, 10944, 102400
SHARD_BYTES = 4 << 30


def _bf16(shape):
    n = 1
    for d in shape:
        n *= d
    return {"dtype": "BF16", "shape": list(shape), "nbytes": 2 * n}


def _hf_tensors() -> list[tuple[str, dict]]:
    out = [("model.embed_tokens.weight", _bf16((VOCAB, H)))]
    for L in range(LAYERS):
        p = f"model.layers.{L}."
        out += [(p + "input_layernorm.weight", _bf16((H,))), (p + "post_attention_layernorm.weight", _bf16((H,))),
                (p + "self_attn.q_proj.weight", _bf16((16 * 192, H))),
                (p + "self_attn.kv_a_proj_with_mqa.weight", _bf16((512 + 64, H))),
                (p + "self_attn.kv_a_layernorm.weight", _bf16((512,))),
                (p + "self_attn.kv_b_proj.weight", _bf16((16 * 256, 512))),
                (p + "self_attn.o_proj.weight", _bf16((H, 16 * 128)))]
        if L < FIRST_DENSE:
            out += [(p + f"mlp.{n}_proj.weight", _bf16((DENSE_I, H) if n != "down" else (H, DENSE_I)))
                    for n in ("gate", "up", "down")]
            continue
        out.append((p + "mlp.gate.weight", _bf16((EXPERTS, H))))
        for n in ("gate", "up", "down"):
            out.append((p + f"mlp.shared_experts.{n}_proj.weight", _bf16((2 * I, H) if n != "down" else (H, 2 * I))))
        for e in range(EXPERTS):
            for n in ("gate", "up", "down"):
                out.append((p + f"mlp.experts.{e}.{n}_proj.weight", _bf16((I, H) if n != "down" else (H, I))))
    out += [("model.norm.weight", _bf16((H,))), ("lm_head.weight", _bf16((VOCAB, H)))]
    return out


def write_safetensors(d: Path) -> int:
    """Sharded sparse safetensors with an index; returns the total size in bytes."""
    shards, cur, size = [], [], 0
    for name, t in _hf_tensors():
        if cur and size + t["nbytes"] > SHARD_BYTES:
            shards.append(cur)
            cur, size = [], 0
        cur.append((name, t))
        size += t["nbytes"]
    shards.append(cur)
    weight_map, total = {}, 0
    for i, tensors in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        header, off = {"__metadata__": {"format": "pt"}}, 0
        for name, t in tensors:
            header[name] = {"dtype": t["dtype"], "shape": t["shape"], "data_offsets": [off, off + t["nbytes"]]}
            off += t["nbytes"]
            weight_map[name] = fname
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(d / fname, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            f.truncate(8 + len(raw) + off)  # sparse: the data region is a hole
        total += 8 + len(raw) + off
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                "weight_map": weight_map}))
    (d / "config.json").write_text(json.dumps({
        "model_type": "deepseek_v2", "hidden_size": H, "moe_intermediate_size": I, "intermediate_size": DENSE_I,
        "n_routed_experts": EXPERTS, "n_shared_experts": 2, "num_experts_per_tok": 6, "num_hidden_layers": LAYERS,
        "first_k_dense_replace": FIRST_DENSE}))
    from safetensors import safe_open  # the reference reader accepts every header

    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), "np") as h:
            assert len(h.keys()) > 0
    return total


def write_gguf(path: Path) -> int:
    """GGUF header by gguf.GGUFWriter (streaming API: tensor infos first), data region left sparse."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

    q4k, q8 = GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q8_0
    w = GGUFWriter(path, "deepseek2")
    w.add_block_count(LAYERS)
    w.add_embedding_length(H)
    w.add_expert_count(EXPERTS)
    w.add_expert_used_count(6)
    w.add_expert_feed_forward_length(I)
    w.add_leading_dense_block_count(FIRST_DENSE)
    w.add_token_list([f"tok{i}" for i in range(VOCAB)])
    w.add_token_merges([f"a{i} b{i}" for i in range(99757)])
    infos = [("token_embd.weight", (VOCAB, H), q8), ("output_norm.weight", (H,), None), ("output.weight", (VOCAB, H), q8)]
    for L in range(LAYERS):
        b = f"blk.{L}."
        infos += [(b + "attn_norm.weight", (H,), None), (b + "ffn_norm.weight", (H,), None),
                  (b + "attn_q.weight", (16 * 192, H), q8), (b + "attn_kv_a_mqa.weight", (576, H), q8),
                  (b + "attn_kv_a_norm.weight", (512,), None), (b + "attn_kv_b.weight", (4096, 512), q8),
                  (b + "attn_output.weight", (H, 2048), q8)]
        if L < FIRST_DENSE:
            infos += [(b + "ffn_gate.weight", (DENSE_I, H), q4k), (b + "ffn_up.weight", (DENSE_I, H), q4k),
                      (b + "ffn_down.weight", (H, DENSE_I), q8)]
            continue
        infos += [(b + "ffn_gate_inp.weight", (EXPERTS, H), None),
                  (b + "ffn_gate_shexp.weight", (2 * I, H), q8), (b + "ffn_up_shexp.weight", (2 * I, H), q8),
                  (b + "ffn_down_shexp.weight", (H, 2 * I), q8),
                  (b + "ffn_gate_exps.weight", (EXPERTS, I, H), q4k), (b + "ffn_up_exps.weight", (EXPERTS, I, H), q4k),
                  (b + "ffn_down_exps.weight", (EXPERTS, H, I), q8)]
    data = 0
    for name, shape, qtype in infos:
        n = 1
        for d in shape:
            n *= d
        if qtype is None:
            nbytes = 4 * n
            w.add_tensor_info(name, shape, np.float32, nbytes)
        else:
            block, size = GGML_QUANT_SIZES[qtype]
            nbytes = n // block * size
            w.add_tensor_info(name, shape, np.float32, nbytes, raw_dtype=qtype)
        data += -(-nbytes // 32) * 32
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    header = path.stat().st_size
    total = -(-header // 32) * 32 + data
    with open(path, "r+b") as f:
        f.truncate(total)
    return total


def run_inspect(path: Path) -> tuple[float, int, dict]:
    """One fresh CLI process: (wall seconds, peak RSS bytes, report)."""
    out = tempfile.TemporaryFile()
    t = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "ktconvert", "inspect", str(path), "-o", "json"], stdout=out)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t
    proc.returncode = os.waitstatus_to_exitcode(status)
    out.seek(0)
    report = json.loads(out.read())
    assert proc.returncode in (0, 1), proc.returncode
    return wall, usage.ru_maxrss * 1024, report


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=None, help="where to write the sparse files (default: a temp dir)")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="ktconvert-bench-inspect-", dir=args.dir))
    try:
        st_dir = base / "st"
        st_dir.mkdir()
        gg_dir = base / "gguf"
        gg_dir.mkdir()
        cases = [("safetensors BF16, per-expert, sharded", st_dir, write_safetensors(st_dir)),
                 ("GGUF Q4_K/Q8_0 merged, 102k vocab", gg_dir / "model.gguf", write_gguf(gg_dir / "model.gguf"))]
        from ktconvert.formats import build_inspect_report

        print(f"{'checkpoint':<40} {'size':>9} {'files':>5} {'tensors':>7} {'CLI best s':>10} {'median s':>8} "
              f"{'peak RSS':>9} {'RSS/size':>9} {'in-process s':>12}")
        for label, path, size in cases:
            runs = [run_inspect(path) for _ in range(args.repeat)]
            walls = [r[0] for r in runs]
            rss = max(r[1] for r in runs)
            report = runs[0][2]
            inproc = []
            for _ in range(args.repeat):
                t = time.perf_counter()
                build_inspect_report(path)
                inproc.append(time.perf_counter() - t)
            ly = report["layers"][0]
            assert (ly["n_experts"], ly["intermediate"], ly["hidden"]) == (EXPERTS, I, H), ly
            assert len(report["layers"]) == LAYERS - FIRST_DENSE
            print(f"{label:<40} {size / 2**30:>6.1f} GiB {len(report['files']):>5} {report['n_tensors']:>7} "
                  f"{min(walls):>10.3f} {statistics.median(walls):>8.3f} {rss / 2**20:>5.0f} MiB "
                  f"{rss / size:>8.2%} {min(inproc):>12.3f}")
        disk = sum(f.stat().st_blocks * 512 for f in base.rglob("*") if f.is_file())
        print(f"(disk actually used by the sparse files: {disk / 2**20:.1f} MiB; "
              f"{os.cpu_count()} CPUs; python {sys.version.split()[0]}; fresh process per run, best of {args.repeat})")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
