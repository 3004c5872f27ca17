"""``ktconvert golden --engine stream``: the golden from the release itself, layer by layer from disk within a budget,
equals the committed transformers golden within the goldens' tolerance; its manifest records the engine, the source
files and the prompt; bad budgets, prompt files and vanishing sources get one line and leave nothing behind."""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

from numeric import assert_reproduces
from verify_helpers import vanish_mid_run

from ktconvert.cli import cli
from ktconvert.golden import read_golden, read_manifest
from ktconvert.golden.paths import golden_root
from ktconvert.golden.stream import compute_stream_golden, float32_bytes, pick_engine
from ktconvert.model.tiny import write_tiny_model

#: every committed golden of a tiny model made without an adapter: (golden name, tiny-model family, variant)
GOLDENS = []
for _d in sorted(p for p in golden_root().iterdir() if (p / "manifest.yaml").is_file()):
    _m = read_manifest(_d)
    if _m["model"].get("tiny_model") and not _m.get("lora"):
        _fam, _, _var = _m["model"]["tiny_model"].partition("-")
        GOLDENS.append((_d.name, _fam, _var or None))


@pytest.fixture
def no_ci(monkeypatch):
    monkeypatch.delenv("CI", raising=False)


@pytest.mark.parametrize("name,family,variant", GOLDENS, ids=[g[0] for g in GOLDENS])
def test_streamed_golden_equals_the_transformers_golden(tmp_path, name, family, variant):
    golden = read_golden(golden_root() / name)
    write_tiny_model(family, tmp_path / "m", variant=variant)
    from ktconvert.model import load_config
    from ktconvert.model.executor import CheckpointWeights, max_memory_for
    from ktconvert.model.reference import build_skeleton

    cfg = load_config(tmp_path / "m")
    need = CheckpointWeights(tmp_path / "m", cfg).minimum(build_skeleton(cfg))[0]
    budget = max_memory_for(need)  # the least it runs in
    assert budget < float32_bytes(tmp_path / "m") / 2  # so the run must stream
    run = compute_stream_golden(tmp_path / "m", golden.manifest["prompt"]["ids"], threads=1, max_memory=budget)
    assert_reproduces(run.tensors, golden)  # the goldens' tolerance, relative to magnitude (made on another CPU)
    assert 0 < run.stream["peak_resident_weights"] <= need
    assert run.decode_max_abs_diff < 1e-5 * max(1.0, float(np.max(np.abs(run.tensors["logits"]))))


def test_cli_stream_golden_manifest_records_engine_sources_and_prompt_file(tmp_path, no_ci, monkeypatch):
    pytest.importorskip("transformers")  # the prompt text goes through the model's tokenizer
    write_tiny_model("qwen3_moe", tmp_path / "m")
    text = "The router picks experts for each token. " * 20  # a longer calibration text: hundreds of tokens
    (tmp_path / "prompt.txt").write_text(text)
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(cli, ["golden", "m", "g", "--engine", "stream", "--max-memory", "4MiB",
                                   "--prompt-file", "prompt.txt"])
    assert res.exit_code == 0, res.output
    assert "stream engine" in res.output and "peak" in res.output
    g = read_golden(tmp_path / "g")
    m = g.manifest
    assert m["producer"]["engine"] == "stream" and m["producer"]["transformers"] is None
    src = m["model"]["sources"]["model.safetensors"]
    assert src["bytes"] == (tmp_path / "m" / "model.safetensors").stat().st_size and len(src["header_sha256"]) == 64
    assert m["prompt"]["text"] == text and len(m["prompt"]["ids"]) > 200
    assert "--engine stream" in m["command"] and "--prompt-file <PROMPT_FILE>" in m["command"]
    assert m["stream"]["peak_resident_weights"] <= m["stream"]["max_memory"] == 4 * 2**20
    assert 0 < m["stream"]["peak_rss"] <= m["stream"]["peak_rss_tree"]
    # the same text as --prompt gives the same ids (one tokenizer path)
    res = CliRunner().invoke(cli, ["golden", "m", "g2", "--engine", "stream", "--max-memory", "4MiB", "--prompt", text])
    assert res.exit_code == 0, res.output
    assert read_golden(tmp_path / "g2").manifest["prompt"]["ids"] == m["prompt"]["ids"]


def test_engine_auto_picks_transformers_when_the_model_fits_else_stream(tmp_path):
    pytest.importorskip("transformers")
    write_tiny_model("qwen3_moe", tmp_path / "m")
    size = float32_bytes(tmp_path / "m")
    assert pick_engine("auto", tmp_path / "m", size) == "transformers"
    assert pick_engine("auto", tmp_path / "m", size - 1) == "stream"
    assert pick_engine("stream", tmp_path / "m", size) == "stream"


def test_budget_below_one_layer_is_one_line_naming_the_minimum(tmp_path, no_ci):
    write_tiny_model("qwen3_moe", tmp_path / "m")
    res = CliRunner().invoke(cli, ["golden", str(tmp_path / "m"), str(tmp_path / "g"), "--engine", "stream",
                                   "--max-memory", "1MiB", "--prompt-ids", "1,2,3"])
    assert res.exit_code == 2, res.output
    line = res.output.strip()
    assert "\n" not in line and "below the minimum" in line and "layer" in line
    need = int(line.split("--max-memory ")[-1].split()[0])
    assert need > 2**20
    assert not (tmp_path / "g").exists()
    ok = CliRunner().invoke(cli, ["golden", str(tmp_path / "m"), str(tmp_path / "g"), "--engine", "stream",
                                  "--max-memory", str(need), "--prompt-ids", "1,2,3"])
    assert ok.exit_code == 0, ok.output


def test_source_file_disappearing_mid_run_is_one_line_and_writes_nothing(tmp_path, no_ci, monkeypatch):
    write_tiny_model("qwen3_moe", tmp_path / "m")
    vanish_mid_run(monkeypatch, tmp_path / "m" / "model.safetensors")
    res = CliRunner().invoke(cli, ["golden", str(tmp_path / "m"), str(tmp_path / "g"), "--engine", "stream",
                                   "--max-memory", "64MiB", "--prompt-ids", "1,2,3"])
    assert res.exit_code == 3, res.output
    line = res.output.strip()
    assert "\n" not in line and "model.safetensors" in line and "No such file" in line
    assert not (tmp_path / "g").exists()
    assert {p.name for p in tmp_path.iterdir()} == {"m"}  # no partial or lock file beside OUT either


def test_golden_of_another_model_in_out_is_one_line_and_left_untouched(tmp_path, no_ci):
    """--force regenerates a golden of the same model; OUT holding another model's golden is refused before the
    run, OUT unchanged."""
    for family in ("qwen3_moe", "qwen2_moe"):
        write_tiny_model(family, tmp_path / family)
    args = ["--engine", "stream", "--max-memory", "64MiB", "--prompt-ids", "1,2,3"]
    assert CliRunner().invoke(cli, ["golden", str(tmp_path / "qwen3_moe"), str(tmp_path / "g"), *args]).exit_code == 0
    before = {p.name: p.read_bytes() for p in (tmp_path / "g").iterdir()}
    res = CliRunner().invoke(cli, ["golden", str(tmp_path / "qwen2_moe"), str(tmp_path / "g"), *args, "--force"])
    assert res.exit_code == 3, res.output
    line = res.output.strip()
    assert "\n" not in line and "golden of another model (family qwen3_moe, the model's is qwen2_moe)" in line
    assert "manifest.yaml:model.family" in line and "another OUT_DIR" in line
    assert {p.name: p.read_bytes() for p in (tmp_path / "g").iterdir()} == before
    assert {p.name for p in tmp_path.iterdir()} == {"qwen3_moe", "qwen2_moe", "g"}
    ok = CliRunner().invoke(cli, ["golden", str(tmp_path / "qwen3_moe"), str(tmp_path / "g"), *args, "--force"])
    assert ok.exit_code == 0, ok.output


@pytest.mark.parametrize("content,message", [(None, "not found"), (b"", "empty"), (b"\xff\xfe", "not UTF-8")])
def test_bad_prompt_file_is_one_line_and_writes_nothing(tmp_path, no_ci, content, message):
    write_tiny_model("qwen3_moe", tmp_path / "m")
    if content is not None:
        (tmp_path / "p.txt").write_bytes(content)
    res = CliRunner().invoke(cli, ["golden", str(tmp_path / "m"), str(tmp_path / "g"), "--engine", "stream",
                                   "--prompt-file", str(tmp_path / "p.txt")])
    assert res.exit_code == 3, res.output
    assert message in res.output and "p.txt" in res.output and "\n" not in res.output.strip()
    assert not (tmp_path / "g").exists()


def test_stream_engine_refuses_lora_and_two_prompts(tmp_path, no_ci):
    write_tiny_model("qwen3_moe", tmp_path / "m")
    res = CliRunner().invoke(cli, ["golden", str(tmp_path / "m"), str(tmp_path / "g"), "--engine", "stream",
                                   "--lora", str(tmp_path / "m" / "config.json"), "--prompt-ids", "1,2"])
    assert res.exit_code == 2 and "--engine transformers" in res.output
    res = CliRunner().invoke(cli, ["golden", str(tmp_path / "m"), str(tmp_path / "g"), "--prompt", "x",
                                   "--prompt-ids", "1,2"])
    assert res.exit_code == 2 and "one of --prompt" in res.output
    assert not (tmp_path / "g").exists()


def test_verify_refuses_a_streamed_golden_of_other_weights(tmp_path, no_ci):
    """A streamed golden names its weight files by size and header sha256; verify's golden check reads them."""
    import shutil

    from ktconvert.formats.safetensors_write import to_bytes
    from ktconvert.golden.generate import generate_golden
    from ktconvert.model.tiny import tiny_tensors
    from ktconvert.verify.runner import check_golden_matches

    write_tiny_model("qwen3_moe", tmp_path / "m")
    generate_golden(tmp_path / "m", tmp_path / "g", prompt_ids=[1, 2, 3], engine="stream", max_memory=2**30)
    gold = read_golden(tmp_path / "g")
    assert check_golden_matches(gold, tmp_path / "m") == []
    other = tmp_path / "other"
    shutil.copytree(tmp_path / "m", other)
    tensors = {k: v.astype(np.float16) for k, v in tiny_tensors("qwen3_moe").items()}  # same model, other weights
    (other / "model.safetensors").write_bytes(to_bytes(tensors, {"format": "pt"}))
    from ktconvert.errors import InputError

    with pytest.raises(InputError) as exc:
        check_golden_matches(gold, other)
    assert "header sha256" in exc.value.message and exc.value.path.endswith("model.safetensors")
