"""Parity tier: ``ktconvert imatrix`` computes the importance matrix ``llama-imatrix`` computes.

llama.cpp's own tools are built from the pinned source into the cache (tests/llamacpp_tools.py). Per tiny family
(qwen3_moe: merged experts; deepseek_v3: MLA attention written as ``attn_kv_b``, a dense first layer, shared experts
and DeepSeek's router; glm_moe_dsa: MLA written as llama.cpp's absorbed ``attn_k_b`` / ``attn_v_b``, per-head 3-D
products, and the DSA indexer; qwen2_moe: a shared expert behind its own 1-row gate; qwen3_next: linear attention,
one ``in_proj_qkvz`` product llama.cpp splits into ``attn_qkv`` and ``attn_gate``; qwen3_5_moe: ``ssm_out``, whose
columns llama.cpp reorders), ktconvert writes the F32 GGUF, llama-imatrix runs the same
text on it, and ``ktconvert imatrix`` runs the same text on the Hugging Face release itself. llama-imatrix runs with
an F32 KV cache and without flash attention (``-ctk f32 -ctv f32 -fa off``): its defaults round keys and values to
F16, a 1e-3 change of the activations that is llama.cpp's numerics, not the importance matrix's.

Every entry must be there on both sides with equal counts and sums within 1e-4 of the largest sum of its matrix (per
expert for merged experts); the files' keys and tensor layout (everything before the data) must be byte-equal.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from convert_helpers import tiny
from llamacpp_tools import run_tool
from test_parity_llamacpp import differences
from test_quantize_imatrix_parity import TEXT

pytestmark = pytest.mark.interop

FAMILIES = ("qwen3_moe", "deepseek_v3", "glm_moe_dsa", "qwen2_moe", "qwen3_next", "qwen3_5_moe")
CHUNK, CHUNKS = 64, 4


def _read(path: Path) -> tuple[dict[str, np.ndarray], dict, int]:
    import gguf

    g = gguf.GGUFReader(path)
    arrays = {t.name: np.array(t.data, dtype=np.float64).reshape(int(np.prod([int(n) for n in t.shape[1:]], dtype=int)), -1)
              for t in g.tensors}
    kv = {k: f.contents() for k, f in g.fields.items() if not k.startswith("GGUF.")}
    return arrays, kv, min(int(t.data_offset) for t in g.tensors)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, llama_tools):
    """Per family: (release, F32 GGUF, text file, llama-imatrix's file)."""
    from ktconvert.convert import convert

    root = tmp_path_factory.mktemp("imx-values")
    text = root / "calibration.txt"
    text.write_text(TEXT)
    out = {}
    for fam in FAMILIES:
        hf = tiny(root, fam)
        f32 = convert(hf, root / f"f32-{fam}", type="F32").out / "model.gguf"
        ref = root / f"llama-{fam}.imatrix.gguf"
        run_tool("llama-imatrix", ["-m", str(f32), "-f", str(text), "-c", str(CHUNK), "--chunks", str(CHUNKS),
                                   "-t", "1", "--no-ppl", "-fa", "off", "-ctk", "f32", "-ctv", "f32", "-o", str(ref)])
        out[fam] = (hf, f32, text, ref)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_values_and_counts_equal_llama_imatrix(runs, tmp_path, family):
    from ktconvert.imatrix import make_imatrix

    hf, _, text, ref = runs[family]
    ours = tmp_path / "ours.imatrix.gguf"
    run = make_imatrix(hf, ours, text_file=text, chunk_size=CHUNK, chunks=CHUNKS)
    assert run.tensors_without == () and run.chunks == CHUNKS
    want, want_kv, want_start = _read(ref)
    got, got_kv, got_start = _read(ours)
    assert sorted(got) == sorted(want)
    assert got_kv == want_kv and want_kv["imatrix.chunk_count"] == CHUNKS
    assert ours.read_bytes()[:got_start] == ref.read_bytes()[:want_start], "keys or tensor layout differ"
    worst = {}
    for name in want:
        if name.endswith(".counts"):
            assert np.array_equal(got[name], want[name]), name
            continue
        scale = np.abs(want[name]).max(axis=1, keepdims=True)
        assert (scale > 0).all(), f"{name}: a matrix without data"
        worst[name] = float((np.abs(got[name] - want[name]) / scale).max())
    assert max(worst.values()) <= 1e-4, sorted(worst.items(), key=lambda kv: -kv[1])[:3]
    if family == "glm_moe_dsa":  # the products ik_llama.cpp #651 says get no data: here they do, on both sides
        assert {"blk.0.attn_k_b.weight.in_sum2", "blk.0.attn_v_b.weight.in_sum2"} <= set(got)
    experts = [n for n in want if n.endswith("_exps.weight.counts")]
    assert experts and all(len(set(want[n].reshape(-1))) > 1 for n in experts), "routing is not exercised"


def test_quantize_with_our_imatrix_equals_llama_quantize(runs, tmp_path):
    """ktconvert's imatrix file drives both quantizers alike, and changes what they write."""
    from ktconvert.convert import convert
    from ktconvert.imatrix import make_imatrix

    hf, f32, text, _ = runs["qwen3_moe"]
    ours = tmp_path / "ours.imatrix.gguf"
    make_imatrix(hf, ours, text_file=text, chunk_size=CHUNK, chunks=CHUNKS)
    want = tmp_path / "llama.gguf"
    run_tool("llama-quantize", ["--imatrix", str(ours), str(f32), str(want), "Q4_K_M", "1"])
    got = convert(f32, tmp_path / "from-gguf", "Q4_K_M", imatrix=ours)
    assert differences(want, got.out / "model.gguf") == []
    assert got.manifest["imatrix"]["no_data"] == {}
    plain = convert(f32, tmp_path / "plain", "Q4_K_M").out / "model.gguf"
    assert differences(want, plain) != [], "the importance matrix changed nothing: the test cannot fail"


def _adds_bos(hf: Path, out: Path) -> Path:
    """The tiny release with a tokenizer that adds BOS (a TemplateProcessing post-processor, ``add_bos_token``):
    the GGUF then says ``tokenizer.ggml.add_bos_token = true``."""
    import json
    import shutil

    shutil.copytree(hf, out)
    tj = json.loads((out / "tokenizer.json").read_text())
    bos = [{"SpecialToken": {"id": "<s>", "type_id": 0}}]
    tj["post_processor"] = {"type": "TemplateProcessing", "single": bos + [{"Sequence": {"id": "A", "type_id": 0}}],
                            "pair": bos + [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                            "special_tokens": {"<s>": {"id": "<s>", "ids": [510], "tokens": ["<s>"]}}}
    (out / "tokenizer.json").write_text(json.dumps(tj))
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**cfg, "add_bos_token": True}))
    return out


def test_bos_first_in_the_text_and_in_every_chunk_as_llama_imatrix(runs, tmp_path):
    """A vocabulary that adds BOS: llama-imatrix puts it before the text and in place of each chunk's first token;
    so does ktconvert (and without it the sums move far)."""
    from ktconvert.convert import convert
    from ktconvert.imatrix import make_imatrix
    from ktconvert.imatrix.collect import bos_policy

    hf, _, text, plain_ref = runs["qwen3_moe"]
    bos = _adds_bos(hf, tmp_path / "bos")
    assert bos_policy(bos) == 510
    f32 = convert(bos, tmp_path / "f32", type="F32").out / "model.gguf"
    ref = tmp_path / "llama.imatrix.gguf"
    run_tool("llama-imatrix", ["-m", str(f32), "-f", str(text), "-c", str(CHUNK), "--chunks", str(CHUNKS),
                               "-t", "1", "--no-ppl", "-fa", "off", "-ctk", "f32", "-ctv", "f32", "-o", str(ref)])
    ours = tmp_path / "ours.imatrix.gguf"
    make_imatrix(bos, ours, text_file=text, chunk_size=CHUNK, chunks=CHUNKS)
    want, _, _ = _read(ref)
    got, _, _ = _read(ours)
    plain, _, _ = _read(plain_ref)
    name = "blk.1.attn_output.weight.in_sum2"
    moved = float(np.abs(plain[name] - want[name]).max() / np.abs(want[name]).max())
    assert moved > 1e-2, "BOS changed nothing: the test cannot fail"
    assert sorted(got) == sorted(want)
    for n in want:
        if n.endswith(".counts"):
            assert np.array_equal(got[n], want[n]), n
        else:
            assert float((np.abs(got[n] - want[n]) / np.abs(want[n]).max(axis=1, keepdims=True)).max()) <= 1e-4, n
