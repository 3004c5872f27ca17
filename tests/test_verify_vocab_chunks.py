"""The injected ``lm_head`` (``KLinearTorch``) over vocabulary chunks: streamed, it reads each chunk's rows when it
runs and never holds the whole head; in memory it slices its weight into the same chunks; the two agree bit for bit
on a vocabulary of several chunks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from conftest import REPO

VOCAB = 20000  # five chunks of VOCAB_CHUNK (4096) rows, the last one short; 20 MB in float32


def _ktconvert(*args, cwd: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("CI", None)  # golden refuses to run under CI (goldens are made by people)
    r = subprocess.run([sys.executable, "-m", "ktconvert", *map(str, args)], cwd=cwd, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, f"ktconvert {args[0]}: {r.stdout[-1000:]}\n{r.stderr[-1000:]}"


def _big_vocab_model(root: Path) -> Path:
    """The tiny qwen3_moe with its embedding and lm_head grown to VOCAB rows (the first rows its own)."""
    from safetensors.numpy import load_file, save_file

    from ktconvert.model.tiny import write_tiny_model

    m = root / "m"
    write_tiny_model("qwen3_moe", m)
    cfg = json.loads((m / "config.json").read_text())
    t = load_file(m / "model.safetensors")
    rng = np.random.default_rng(7)
    for k in ("model.embed_tokens.weight", "lm_head.weight"):
        w = t[k]
        big = (rng.standard_normal((VOCAB, w.shape[1])) * w.std()).astype(w.dtype)
        big[:w.shape[0]] = w
        t[k] = big
    cfg["vocab_size"] = VOCAB
    (m / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(t, str(m / "model.safetensors"), metadata={"format": "pt"})
    return m


def test_streamed_lm_head_reads_chunks_and_equals_the_resident_one(tmp_path):
    from ktconvert.verify import run_verify

    m = _big_vocab_model(tmp_path)
    _ktconvert("quantize", m, tmp_path / "q", "--type", "Q8_0", cwd=tmp_path)
    _ktconvert("golden", m, tmp_path / "g", "--engine", "stream", "--max-memory", "64MiB", cwd=tmp_path)
    rules = REPO / "rules" / "optimize" / "qwen3_moe.yaml"
    gguf = tmp_path / "q" / "model.gguf"
    resident = run_verify(m, rules, tmp_path / "g", weights=gguf)
    head_f32 = VOCAB * 256 * 4
    budget = 16 << 20  # below the head alone in float32 (20 MB)
    streamed = run_verify(m, rules, tmp_path / "g", weights=gguf, max_memory=budget)
    assert resident.run["mode"] == "resident" and streamed.run["mode"] == "stream"
    for a, b in zip(resident.phases, streamed.phases):
        assert np.array_equal(a.candidate_logits, b.candidate_logits), a.name
    assert streamed.run["peak_resident_weights"] <= budget < head_f32
    ops = [u for u in streamed.injection["operators"] if "lm_head" in " ".join(u.get("modules", []))]
    assert ops and "in chunks of 4096 vocabulary rows" in ops[0]["detail"], ops
