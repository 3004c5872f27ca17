"""Three outputs from one read (``quantize --output ...``) against three separate runs: wall time, CPU time and
the bytes read from disk, on a small synthetic BF16 checkpoint (Qwen3-MoE-shaped, narrower: H=1024, 32 experts of
I=512, 8 heads / 2 KV heads of 128, a 16384 vocabulary; ``--layers`` layers, about 100 MiB each) written by
:func:`bench_convert.write_checkpoint` and removed afterwards.

Before every run the source files' pages are dropped from the page cache (``posix_fadvise DONTNEED`` on those
files only, so other processes' cache is left alone): each separate run reads the checkpoint from disk, as runs
over a checkpoint larger than memory do. Bytes read are the process tree's block input (``wait4``'s
``ru_inblock``, workers included). The runs alternate, ``--repeat`` times; medians are printed. The outputs of
both ways are compared byte for byte.

    python benchmarks/bench_outputs.py [--dir DIR] [--layers 4] [--jobs 1] [--repeat 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_convert import _config, write_checkpoint  # noqa: E402

H, I, E, HEADS, KV, HD, VOCAB = 1024, 512, 32, 8, 2, 128, 16384
OUTPUTS = [("Q4_K_M", ["--recipe", "Q4_K_M"]), ("AMXINT4", ["--to", "kt-amx", "--type", "AMXINT4"]),
           ("Q8_0", ["--recipe", "Q8_0"])]


def _model(layers: int) -> tuple[dict, list]:
    cfg = {**_config(layers), "hidden_size": H, "moe_intermediate_size": I, "num_experts": E,
           "num_attention_heads": HEADS, "num_key_value_heads": KV, "head_dim": HD, "vocab_size": VOCAB}
    t = [("model.embed_tokens.weight", (VOCAB, H))]
    for L in range(layers):
        p = f"model.layers.{L}."
        t += [(p + "input_layernorm.weight", (H,)), (p + "post_attention_layernorm.weight", (H,)),
              (p + "self_attn.q_proj.weight", (HEADS * HD, H)), (p + "self_attn.k_proj.weight", (KV * HD, H)),
              (p + "self_attn.v_proj.weight", (KV * HD, H)), (p + "self_attn.o_proj.weight", (H, HEADS * HD)),
              (p + "self_attn.q_norm.weight", (HD,)), (p + "self_attn.k_norm.weight", (HD,)),
              (p + "mlp.gate.weight", (E, H))]
        for e in range(E):
            t += [(p + f"mlp.experts.{e}.{w}_proj.weight", (H, I) if w == "down" else (I, H))
                  for w in ("gate", "up", "down")]
    t += [("model.norm.weight", (H,)), ("lm_head.weight", (VOCAB, H))]
    return cfg, [(n, "BF16", s) for n, s in t]


def _evict(src: Path) -> None:
    for f in src.glob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _run(cmd: list[str], src: Path) -> dict:
    _evict(src)
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, ru = os.wait4(proc.pid, 0)
    wall = time.monotonic() - t0
    err = proc.stderr.read().decode()
    proc.stderr.close()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd[3:])} failed: {err.strip()[-2000:]}")
    return {"wall": wall, "cpu": ru.ru_utime + ru.ru_stime, "read": ru.ru_inblock * 512}


def _tree(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=None)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--max-memory", default="1GiB")
    a = ap.parse_args(argv)
    base = Path(tempfile.mkdtemp(prefix="kt-outputs-", dir=a.dir))
    try:
        src = base / "src"
        cfg, stored = _model(a.layers)
        size = write_checkpoint(src, a.layers, config=cfg, stored=stored)
        os.sync()
        q = [sys.executable, "-m", "ktconvert", "-q", "quantize", str(src), "--jobs", str(a.jobs), "--max-memory",
             a.max_memory, "--force"]
        one, sep = [], []
        for _ in range(a.repeat):
            one.append(_run([*q, *(x for s, _ in OUTPUTS for x in ("--output", f"{s}={base / 'one' / s}"))], src))
            runs = [_run([*q[:6], str(base / "sep" / s), *q[6:], *args], src) for s, args in OUTPUTS]
            sep.append({k: sum(r[k] for r in runs) for k in ("wall", "cpu", "read")})
        same = all(_tree(base / "one" / s) == _tree(base / "sep" / s) for s, _ in OUTPUTS)

        def med(rs, k):
            return statistics.median(r[k] for r in rs)

        report = {"source_bytes": size, "layers": a.layers, "jobs": a.jobs, "repeat": a.repeat,
                  "outputs": [s for s, _ in OUTPUTS], "byte_identical": same,
                  "one_read": {"wall_s": round(med(one, "wall"), 1), "cpu_s": round(med(one, "cpu"), 1),
                               "read_mb": round(med(one, "read") / 1e6)},
                  "separate": {"wall_s": round(med(sep, "wall"), 1), "cpu_s": round(med(sep, "cpu"), 1),
                               "read_mb": round(med(sep, "read") / 1e6)}}
        report["wall_ratio"] = round(report["separate"]["wall_s"] / report["one_read"]["wall_s"], 2)
        print(json.dumps(report, indent=2))
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
