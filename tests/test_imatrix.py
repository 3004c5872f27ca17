"""``ktconvert imatrix``: chunking, streaming, reporting, the file it writes, and its refusals (values against
llama-imatrix: tests/test_imatrix_parity.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from convert_helpers import tiny
from test_quantize_imatrix_parity import TEXT

CHUNK, CHUNKS = 32, 2


@pytest.fixture(scope="module")
def model(tmp_path_factory, one_torch_thread) -> Path:
    return tiny(tmp_path_factory.mktemp("imx"), "qwen3_moe")


@pytest.fixture
def text(tmp_path) -> Path:
    p = tmp_path / "calibration.txt"
    p.write_text(TEXT)
    return p


def _cli(*args: str):
    from ktconvert.cli import cli

    return CliRunner().invoke(cli, ["imatrix", *args])


def test_chunks_follow_llama_imatrix():
    from ktconvert.imatrix import chunk_tokens

    toks = list(range(10, 21))  # 11 tokens: two chunks of 5, the last token dropped
    assert chunk_tokens(toks, 5, bos=None) == [[10, 11, 12, 13, 14], [15, 16, 17, 18, 19]]
    assert chunk_tokens(toks, 5, bos=1) == [[1, 11, 12, 13, 14], [1, 16, 17, 18, 19]]
    assert chunk_tokens(toks, 5, bos=None, chunks=1) == [[10, 11, 12, 13, 14]]


def test_file_reads_back_and_prompt_ids_give_the_same_bytes(model, text, tmp_path):
    from ktconvert.formats.imatrix import read_imatrix
    from ktconvert.imatrix import make_imatrix, text_tokens
    from ktconvert.imatrix.collect import bos_policy

    a = make_imatrix(model, tmp_path / "a.gguf", text_file=text, chunk_size=CHUNK, chunks=CHUNKS)
    imx = read_imatrix(tmp_path / "a.gguf")
    assert imx.chunk_count == CHUNKS and imx.chunk_size == CHUNK and imx.datasets == (str(text),)
    assert set(imx.values) == set(a.entries) and len(a.entries) == 16  # 2 layers: q k v o, router, 3 merged experts
    gate = a.entries["blk.0.ffn_gate_exps.weight"]
    assert gate.sums.shape == (8, 256) and gate.counts.sum() == CHUNK * CHUNKS * 2  # top-2 of 8 experts
    assert a.entries["blk.0.attn_q.weight"].counts.tolist() == [CHUNK * CHUNKS]
    np.testing.assert_array_equal(imx.values["blk.0.attn_q.weight"],
                                  a.entries["blk.0.attn_q.weight"].sums[0] / np.float32(CHUNK * CHUNKS))
    ids = tmp_path / "ids.txt"
    ids.write_text(",".join(map(str, text_tokens(model, text, bos_policy(model)))))
    res = _cli(str(model), str(tmp_path / "b.gguf"), "--prompt-ids", str(ids), "--chunk-size", str(CHUNK),
               "--chunks", str(CHUNKS))
    assert res.exit_code == 0, res.output
    a_imx, b_imx = read_imatrix(tmp_path / "a.gguf"), read_imatrix(tmp_path / "b.gguf")
    assert b_imx.datasets == (str(ids),)
    for name, v in a_imx.values.items():
        np.testing.assert_array_equal(b_imx.values[name], v)


def test_streamed_under_a_small_budget_writes_the_same_bytes(model, text, tmp_path):
    from ktconvert.imatrix import make_imatrix
    from ktconvert.model import load_config
    from ktconvert.model.executor import CheckpointWeights, max_memory_for
    from ktconvert.model.reference import build_skeleton

    need, _ = CheckpointWeights(model, load_config(model)).minimum(build_skeleton(load_config(model)))
    whole = make_imatrix(model, tmp_path / "whole.gguf", text_file=text, chunk_size=CHUNK, chunks=CHUNKS)
    small = make_imatrix(model, tmp_path / "small.gguf", text_file=text, chunk_size=CHUNK, chunks=CHUNKS,
                         max_memory=max_memory_for(need))
    assert small.stream["peak_resident_weights"] <= need < whole.stream["peak_resident_weights"]
    assert (tmp_path / "small.gguf").read_bytes() == (tmp_path / "whole.gguf").read_bytes()


def test_experts_and_matrices_without_data_are_named(model, text, tmp_path, monkeypatch):
    """Four tokens reach few of the 8 experts: those left out are listed per merged tensor (count 0 in the file,
    as llama-imatrix writes them); a matrix no hook saw is listed by name."""
    from ktconvert.formats.imatrix import read_imatrix
    from ktconvert.imatrix import collect

    real = collect._targets

    def without_attn_k(*args):
        targets, expected = real(*args)
        return {k: v for k, v in targets.items() if v[1][0].name != "blk.1.attn_k.weight"}, expected

    monkeypatch.setattr(collect, "_targets", without_attn_k)
    out = tmp_path / "few.gguf"
    res = _cli(str(model), str(out), "--text-file", str(text), "--chunk-size", "4", "--chunks", "1", "-o", "json")
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["tensors_without_data"] == ["blk.1.attn_k.weight"]
    missing = report["experts_without_data"]
    assert missing and missing == {k: list(v) for k, v in sorted(read_imatrix(out).no_data.items())}
    res = _cli(str(model), str(out), "--text-file", str(text), "--chunk-size", "4", "--chunks", "1", "--force")
    assert res.exit_code == 0, res.output
    assert "  no data: blk.1.attn_k.weight" in res.stdout
    name, experts = next(iter(missing.items()))
    assert f"  no data for expert(s) {', '.join(map(str, experts))} of {name}" in res.stdout


@pytest.mark.parametrize("case,code,needle", [
    ("empty text", 3, "the text file is empty"),
    ("short text", 3, "shorter than one chunk of 512"),
    ("not utf-8", 3, "not UTF-8 text"),
    ("missing text", 3, "missing.txt"),
    ("out is a directory", 2, "is a directory"),
    ("out's folder missing", 2, "does not exist"),
    ("out exists", 2, "output already exists"),
    ("out inside the model", 2, "over or inside an input"),
    ("no text", 2, "give one of --text-file and --prompt-ids"),
    ("bad ids", 2, "token ids are integers"),
    ("id outside the vocabulary", 3, "outside the vocabulary of 512"),
    ("chunk size 0", 2, "a chunk holds at least one token"),
])
def test_refusals_are_one_line_and_write_nothing(model, text, tmp_path, case, code, needle):
    out = tmp_path / "out.gguf"
    args = ["--text-file", str(text)]
    if case == "empty text":
        text.write_text("")
    elif case == "short text":
        text.write_text("a few words")
    elif case == "not utf-8":
        text.write_bytes(b"caf\xe9 au lait " * 100)
    elif case == "missing text":
        args = ["--text-file", str(tmp_path / "missing.txt")]
    elif case == "out is a directory":
        out.mkdir()
    elif case == "out's folder missing":
        out = tmp_path / "nowhere" / "out.gguf"
    elif case == "out exists":
        out.write_bytes(b"keep")
    elif case == "out inside the model":
        out = model / "imatrix.gguf"
    elif case == "no text":
        args = []
    elif case == "bad ids":
        args = ["--prompt-ids", "1,2,x"]
    elif case == "id outside the vocabulary":
        args = ["--prompt-ids", ",".join(["512"] + ["5"] * 40), "--chunk-size", "8"]
    elif case == "chunk size 0":
        args += ["--chunk-size", "0"]
    before = sorted(p.name for p in tmp_path.rglob("*"))
    res = _cli(str(model), str(out), *args)
    assert res.exit_code == code, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], lines
    assert sorted(p.name for p in tmp_path.rglob("*")) == before
    assert not (model / "imatrix.gguf").exists()
    if case == "out exists":
        assert out.read_bytes() == b"keep"


def test_an_fp8_release_is_read_as_quantize_reads_it(tmp_path, one_torch_thread):
    """An FP8 block-scaled release streamed directly gives the bytes of the same weights dequantized independently
    (tests/fp8_helpers.py) and stored as float32."""
    from fp8_helpers import tiny_fp8, write_reference_dir
    from ktconvert.imatrix import make_imatrix

    fp8 = tiny_fp8(tmp_path, "deepseek_v3")
    f32 = write_reference_dir(fp8, tmp_path / "f32")
    ids = tmp_path / "ids.txt"
    ids.write_text(",".join(str(i) for i in range(1, 65)))
    a = make_imatrix(fp8, tmp_path / "fp8.gguf", prompt_ids=list(range(1, 65)), prompt_ids_source=str(ids),
                     chunk_size=32)
    make_imatrix(f32, tmp_path / "f32.gguf", prompt_ids=list(range(1, 65)), prompt_ids_source=str(ids),
                 chunk_size=32)
    assert a.tensors_without == () and "blk.1.ffn_down_exps.weight" in a.entries
    assert (tmp_path / "fp8.gguf").read_bytes() == (tmp_path / "f32.gguf").read_bytes()


@pytest.mark.parametrize("family", ["qwen3_moe", "glm5_next"])
def test_prefill_layers_equals_run_per_batch(tmp_path, one_torch_thread, family):
    """The executor's all-chunks-per-layer prefill (the release read once) computes, for each batch of chunks, the
    last layer's output a run of that batch alone computes, bit for bit (GLM-5-Next: DSA layers sharing the previous
    layer's selection, and hyper-connection streams)."""
    import torch

    from ktconvert.model import load_config
    from ktconvert.model.executor import CheckpointWeights, LayerMajor
    from ktconvert.model.reference import build_skeleton

    model_dir = tiny(tmp_path, family)
    cfg = load_config(model_dir)
    run = LayerMajor(build_skeleton(cfg), CheckpointWeights(model_dir, cfg))
    ids = torch.randint(0, int(cfg.vocab_size), (5, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = run.collapse(run.prefill_layers(ids, 2))
        for a in range(0, 5, 2):
            alone = run.run(ids[a:a + 2]).hidden_states[-1]
            assert torch.equal(out[a:a + 2], alone), a
