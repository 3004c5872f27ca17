"""``ktconvert verify --golden FILE`` where FILE is llama.cpp's KL-divergence base file: one written by ``golden
--kl-base`` or by ``llama-perplexity --kl-divergence-base`` itself. The same weights pass with KL inside the base's
16-bit rounding, a broken candidate fails, and an unusable base file is one line (exit 3, nothing written)."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from click.testing import CliRunner

from verify_helpers import Workspace
from ktconvert.cli import cli
from ktconvert.golden import kld
from ktconvert.io import resources

FAMILY = "qwen3_moe"
IDS = "510,306,327,321,472,278,290,111,114,376,328,44,269,258,278,302,110,283,258,32"  # 20 tokens, BOS first


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    return Workspace(tmp_path_factory.mktemp("verify-kl-base"))


@pytest.fixture(scope="module")
def base(ws, tmp_path_factory):
    """``golden --kl-base`` of the tiny model (the stream engine, float32)."""
    root = tmp_path_factory.mktemp("kl-base-golden")
    res = CliRunner().invoke(cli, ["golden", str(ws.model(FAMILY)), str(root / "g"), "--engine", "stream",
                                   "--max-memory", "64MiB", "--prompt-ids", IDS, "--kl-base", str(root / "g.kld")],
                              env={"CI": None})  # a fixture made here, not a golden of the repo: CI may make it
    assert res.exit_code == 0, res.output
    return root / "g.kld"


@pytest.fixture(scope="module")
def validator():
    import jsonschema

    return jsonschema.Draft202012Validator(resources.load_schema("verify-report"))


def _verify(ws, golden, *extra):
    args = ["verify", "--model", str(ws.model(FAMILY)), "--rules", str(ws.rules(FAMILY)), "--golden", str(golden),
            "-o", "json", *map(str, extra)]
    return CliRunner().invoke(cli, args, catch_exceptions=False)


def test_the_same_weights_pass_within_the_bases_rounding(ws, base, validator):
    res = _verify(ws, base, "--tolerance", "f32")
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    validator.validate(report)
    g = report["golden"]
    assert g["kind"] == "kl-divergence-base" and g["positions"] == 9  # positions 10..18 of one chunk of 20
    info = g["kl_base"]
    assert (info["n_ctx"], info["n_vocab"], info["n_chunk"], info["scored_positions"]) == (20, 512, 1, [10, 18])
    # half a 16-bit step of the row's range (at most 16 nats / 65535 = 2.4e-4 a step) plus float32 rounding of
    # log-probabilities above -16, weighted by the probability (which sums to 1 within the rounding)
    eps = float(np.finfo(np.float32).eps)
    assert 0 < info["step_max"] <= 16 / 65535
    assert 0 < info["kl_allowance"] <= (0.5 * info["step_max"] + 2 * eps * 16) * 1.001
    for phase in report["phases"].values():
        rows = phase["positions"]
        assert [(r["chunk"], r["position"]) for r in rows] == [(0, p) for p in range(10, 19)]
        # the model's own F32 weights: the candidate's own error (~1e-6 against the float32 reference) plus the
        # base's rounding, bounded by the allowance
        assert all(abs(r["kl"]) <= info["kl_allowance"] + 1e-5 for r in rows), rows
        assert all(r["top1"] for r in rows) and phase["logits"]["max_abs_diff"] is None
        assert phase["layers"] == [] and phase["localization"] is None and phase["modules"] is None
    assert any("localisation need a ktconvert golden directory" in n for n in report["notes"])
    # the limits in force: the profile's KL limits plus the allowance; no logit or hidden-state limit
    limits = report["profile"]["limits"]
    assert "hidden_states" not in limits and "max_abs_diff" not in limits["logits"]


def test_a_broken_candidate_fails_on_kl(ws, base):
    broken = ws.gguf(FAMILY, "Q8_0", faults=[("gate-up-swapped", 1, 2)])  # one expert's gate and up swapped
    res = _verify(ws, base, "--weights", broken)
    assert res.exit_code == 1, res.output
    report = json.loads(res.stdout)
    assert report["verdict"] == "fail" and report["profile"]["name"] == "q8_0"
    metrics = {b["metric"] for b in report["breaches"]}
    assert {"kl_mean", "kl_max"} <= metrics, report["breaches"]
    worst = next(b for b in report["breaches"] if b["metric"] == "kl_max")
    assert worst["where"].startswith("chunk 0 position ") and worst["value"] > 5 * worst["limit"]
    # the same conversion without the fault passes against the same base
    assert _verify(ws, base, "--weights", ws.gguf(FAMILY, "Q8_0")).exit_code == 0


def test_streamed_within_a_budget_gives_the_same_numbers(ws, base):
    resident = json.loads(_verify(ws, base, "--weights", ws.gguf(FAMILY, "Q8_0")).stdout)
    streamed = json.loads(_verify(ws, base, "--weights", ws.gguf(FAMILY, "Q8_0"), "--max-memory", "8MB").stdout)
    assert resident["run"]["mode"] == "resident" and streamed["run"]["mode"] == "stream"
    assert streamed["phases"] == resident["phases"]


def _error(res, code=3):
    assert res.exit_code == code, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("ktconvert: error: "), res.stderr
    return lines[0]


def _put(data: bytearray, at: int, fmt: str, value) -> bytes:
    data[at:at + struct.calcsize(fmt)] = struct.pack(fmt, value)
    return bytes(data)


HOSTILE = {
    "wrong-magic": (lambda d: b"GGUF" + bytes(d[4:]), "no _logits_ header", "or a golden directory"),
    "truncated": (lambda d: bytes(d[:-7]), "the file is truncated or not a base file", "write it again"),
    "token-outside-vocab": (lambda d: _put(d, 20 + 4 * 5, "<i", 512), "token id 512 at position 5 is outside",
                            "write it again"),
}


@pytest.mark.parametrize("name", HOSTILE)
def test_an_unusable_base_file_is_one_line(ws, base, tmp_path, name):
    edit, needle, fix = HOSTILE[name]
    bad = tmp_path / f"{name}.bin"  # no extension says what it is: the magic does
    bad.write_bytes(edit(bytearray(base.read_bytes())))
    before = sorted(p.name for p in tmp_path.iterdir())
    line = _error(_verify(ws, bad))
    assert needle in line and str(bad) in line and fix in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_a_base_file_of_another_vocabulary_is_refused(ws, tmp_path):
    ids = [510] + list(range(1, 12))
    path = kld.write_kl_base(tmp_path / "other.kld", ids, np.random.default_rng(0).normal(size=(12, 1024)))
    line = _error(_verify(ws, path))
    assert "made for a vocabulary of 1024 tokens, the model has 512: the base file of another model" in line
    assert str(path) in line and "llama-perplexity --kl-divergence-base" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.kld"]


def test_lora_against_a_base_file_is_a_usage_error(ws, base, tmp_path):
    line = _error(_verify(ws, base, "--lora", tmp_path / "adapter"), 2)
    assert "--lora needs a golden directory" in line


# --- a base file llama.cpp's own llama-perplexity wrote ----------------------------------------------------------
N_CTX = 16


@pytest.mark.interop
@pytest.mark.parametrize("add_bos", [False, True])
def test_llama_perplexitys_own_base_file_is_a_golden(llama_perplexity, ws, tmp_path, validator, add_bos):
    """Two chunks of 16 from llama-perplexity --kl-divergence-base on the tiny model's F32 GGUF: verify of the same
    GGUF reads the file as a golden and finds the same distributions. With a vocabulary that adds a BOS, llama.cpp
    puts it at each chunk's position 0 at run time (the file keeps chunk 1's first text token there), and so does
    verify: run without it, chunk 1 measures KL 0.012-0.054 at its scored positions (and fails f32)."""
    import shutil

    from llamacpp_tools import run_tool
    from ktconvert.convert import convert
    from ktconvert.model.tinytok import PROMPT_TEXT

    model = tmp_path / "m"
    shutil.copytree(ws.model(FAMILY), model)
    if add_bos:  # the tiny tokenizer adds none; this flag makes quantize write add_bos_token = true
        cfg = json.loads((model / "tokenizer_config.json").read_text())
        (model / "tokenizer_config.json").write_text(json.dumps(cfg | {"add_bos_token": True}))
    gguf = convert(model, tmp_path / "f32", type="F32").out / "model.gguf"
    (tmp_path / "text.txt").write_text((PROMPT_TEXT + " ") * 8)
    run_tool("llama-perplexity", ["-t", "1", "-b", str(N_CTX), "-c", str(N_CTX), "--no-repack", "-m", str(gguf),
                                  "-f", str(tmp_path / "text.txt"), "--chunks", "2",
                                  "--kl-divergence-base", str(tmp_path / "base.kld")])
    stored = kld.read_kl_base(tmp_path / "base.kld", n_vocab=512)
    assert stored.n_chunk == 2 and (stored.tokens[0, 0] == 510) == add_bos and stored.tokens[1, 0] != 510
    args = ["verify", "--model", str(model), "--rules", str(ws.rules(FAMILY)), "--golden", str(tmp_path / "base.kld"),
            "--weights", str(gguf), "--tolerance", "f32", "-o", "json"]
    res = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    validator.validate(report)
    assert report["golden"]["kl_base"]["bos"] == (510 if add_bos else None)
    assert report["golden"]["positions"] == 2 * 7
    for phase in report["phases"].values():
        rows = phase["positions"]
        assert [r["chunk"] for r in rows] == [0] * 7 + [1] * 7
        # llama.cpp F32 against torch F32 on its tokens, through the base's 16-bit rounding
        assert all(r["top1"] for r in rows) and phase["logits"]["kl_max"] < 2e-5, phase["logits"]
