"""Goldens: the committed ones are valid, small, tied to the tiny models and reproducible; `ktconvert golden`
writes, regenerates with a log, refuses under CI and names the missing extra."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import yaml
from click.testing import CliRunner

from ktconvert.cli import cli
from ktconvert.errors import InputError
from ktconvert.golden import golden_root, load_tiny_hashes, read_golden, read_manifest, validate_manifest
from ktconvert.model import FAMILIES
from ktconvert.io.resources import load_schema, schemas_dir
from numeric import assert_reproduces

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture
def no_ci(monkeypatch):
    monkeypatch.delenv("CI", raising=False)


def test_schema_is_valid_draft_2020_12():
    import jsonschema

    schema = load_schema("golden-manifest")
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["$schema"].endswith("/2020-12/schema")
    assert (schemas_dir() / "golden-manifest.schema.json").is_file()


@pytest.mark.parametrize("family", FAMILIES)
def test_committed_golden_is_valid_small_and_tied_to_its_tiny_model(family):
    golden = read_golden(golden_root() / family)  # schema, sha256, names, dtypes, shapes, prompt ids
    m = golden.manifest
    assert m["name"] == family and m["model"]["family"] == family and m["model"]["tiny_model"] == family
    assert m["model"]["files"] == load_tiny_hashes()[family]
    assert m["model"]["config_sha256"] == m["model"]["files"]["config.json"]
    assert m["producer"]["dtype"] == "float32" and m["producer"]["threads"] == 1
    # a fixed bound is right here: the number was measured once, where the golden was made, and is committed data
    assert m["checks"]["hf_decode_vs_prefill_max_abs_diff"] < 1e-5
    assert len(m["regenerations"]) >= 1 and m["regenerations"][-1]["tensors_sha256"] == m["tensors"]["sha256"]
    for command in [m["command"]] + [e["command"] for e in m["regenerations"]]:
        assert not re.search(r"(^|\s)/", command), command  # no machine paths recorded
    for name in ("manifest.yaml", "golden.safetensors"):
        assert (golden_root() / family / name).stat().st_size < 512 * 1024
    layers = golden.hidden_states.shape[0] - 1
    # 4: GLM-5-Next's tiny model needs a linear, an indexed, a shared-selection and another linear layer
    assert golden.logits.shape == (1, golden.input_ids.shape[1], 512) and layers in (2, 3, 4)
    assert np.isfinite(golden.logits).all() and np.isfinite(golden.hidden_states).all()


def test_committed_prompt_is_the_tiny_prompt_through_the_tiny_tokenizer(tiny_root):
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(tiny_root / "qwen2_moe")
    for family in FAMILIES:
        prompt = read_manifest(golden_root() / family)["prompt"]
        assert prompt["bos_prepended"]
        assert prompt["ids"] == [tok.bos_token_id] + tok(prompt["text"], add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("family", FAMILIES)
def test_goldens_reproduce(family, tiny_root):
    pytest.importorskip("transformers")
    from ktconvert.golden.generate import compute_golden

    golden = read_golden(golden_root() / family)
    run = compute_golden(tiny_root / family, golden.manifest["prompt"]["ids"], threads=1)
    assert_reproduces(run.tensors, golden)  # goldens come from another CPU: see tests/numeric.py


def test_generate_then_regenerate_logs_both(tiny_root, tmp_path, no_ci, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    res = runner.invoke(cli, ["golden", str(tiny_root / "qwen3_moe"), "g/qwen3_moe"])
    assert res.exit_code == 0, res.output
    first = read_golden(tmp_path / "g" / "qwen3_moe")
    assert first.manifest["command"] == "ktconvert tiny-model qwen3_moe <MODEL_DIR> && ktconvert golden <MODEL_DIR> g/qwen3_moe --threads 1"

    again = runner.invoke(cli, ["golden", str(tiny_root / "qwen3_moe"), "g/qwen3_moe"])
    assert again.exit_code == 2 and "--force" in again.output

    res = runner.invoke(cli, ["golden", str(tiny_root / "qwen3_moe"), "g/qwen3_moe", "--force", "--reason", "test rerun"])
    assert res.exit_code == 0, res.output
    log = read_manifest(tmp_path / "g" / "qwen3_moe")["regenerations"]
    assert [e["reason"] for e in log] == ["initial generation", "test rerun"]
    assert log[1]["previous_sha256"] == log[0]["tensors_sha256"]
    assert log[1]["max_abs_diff"] == {"input_ids": 0.0, "logits": 0.0, "hidden_states": 0.0, "final_hidden": 0.0}
    assert log[1]["command"].endswith("--force")


def test_prompt_ids_option(tiny_root, tmp_path, no_ci, monkeypatch):
    pytest.importorskip("transformers")
    work = tmp_path / "elsewhere"
    work.mkdir()
    monkeypatch.chdir(work)  # the output directory is outside the working directory
    res = CliRunner().invoke(cli, ["golden", str(tiny_root / "mixtral"), str(tmp_path / "g"), "--prompt-ids", "1, 2,3"])
    assert res.exit_code == 0, res.output
    golden = read_golden(tmp_path / "g")
    assert golden.manifest["prompt"] == {"ids": [1, 2, 3], "text": None, "bos_prepended": False}
    cmd = "ktconvert tiny-model mixtral <MODEL_DIR> && ktconvert golden <MODEL_DIR> <OUT_DIR> --threads 1 --prompt-ids 1,2,3"
    assert golden.manifest["command"] == cmd
    bad = CliRunner().invoke(cli, ["golden", str(tiny_root / "mixtral"), str(tmp_path / "h"), "--prompt-ids", "1,x"])
    assert bad.exit_code == 2
    big = CliRunner().invoke(cli, ["golden", str(tiny_root / "mixtral"), str(tmp_path / "h"), "--prompt-ids", "600"])
    assert big.exit_code == 3 and "vocab" in big.output


def test_refused_under_ci(tiny_root, tmp_path, monkeypatch):
    monkeypatch.setenv("CI", "true")
    res = CliRunner().invoke(cli, ["golden", str(tiny_root / "qwen3_moe"), str(tmp_path / "g")])
    assert res.exit_code == 3
    assert "CI" in res.output and "refusing" in res.output
    assert not (tmp_path / "g").exists()


def test_missing_transformers_names_the_extra(tiny_root, tmp_path):
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "from ktconvert.cli import main\n"
        f"main(['golden', {str(tiny_root / 'qwen3_moe')!r}, {str(tmp_path / 'g')!r}])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 3, res.stderr
    assert "ktconvert[golden]" in res.stderr and "Traceback" not in res.stderr


def test_tampering_is_detected(tmp_path):
    import shutil

    src = golden_root() / "mixtral"
    dst = tmp_path / "mixtral"
    shutil.copytree(src, dst)
    data = bytearray((dst / "golden.safetensors").read_bytes())
    data[-1] ^= 1
    (dst / "golden.safetensors").write_bytes(bytes(data))
    with pytest.raises(InputError, match="sha256"):
        read_golden(dst)

    manifest = yaml.safe_load((src / "manifest.yaml").read_text())
    del manifest["producer"]["threads"]
    with pytest.raises(InputError, match="threads") as exc:
        validate_manifest(manifest)
    assert exc.value.where == "producer"
    manifest = yaml.safe_load((src / "manifest.yaml").read_text())
    manifest["prompt"]["ids"][0] += 1
    shutil.copy(src / "golden.safetensors", dst / "golden.safetensors")
    (dst / "manifest.yaml").write_text(yaml.safe_dump(manifest))
    with pytest.raises(InputError, match="prompt ids"):
        read_golden(dst)
    (dst / "manifest.yaml").write_text("schema_version: [")
    with pytest.raises(InputError, match="YAML"):
        read_golden(dst)


def test_reading_a_golden_needs_neither_torch_nor_transformers():
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None\n"
        "from ktconvert.golden import read_golden, golden_root\n"
        "g = read_golden(golden_root() / 'deepseek_v3')\n"
        "print(g.hidden_states.shape)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "(4, 1, 31, 256)"


def test_manifest_json_round_trip_is_schema_valid():
    # YAML-specific types never leak in: the manifest survives a JSON round trip unchanged
    m = read_manifest(golden_root() / "deepseek_v2")
    assert json.loads(json.dumps(m)) == m
    validate_manifest(json.loads(json.dumps(m)))


def _copy_tiny(tiny_root, tmp_path, family="qwen3_moe"):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_root / family, model)
    return model


def test_a_torch_zip_named_model_safetensors_is_refused_in_one_line_unread(tiny_root, tmp_path, no_ci):
    # the same sniffing inspect, quantize and verify use: one line naming the file, never unpickled, nothing written
    import torch

    model = _copy_tiny(tiny_root, tmp_path)
    torch.save({"w": torch.zeros(2)}, model / "model.safetensors")
    res = CliRunner().invoke(cli, ["golden", str(model), str(tmp_path / "g"), "--prompt-ids", "1,2"])
    assert res.exit_code == 3, res.output
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ktconvert: error: "), res.stderr
    assert f"{model / 'model.safetensors'}:byte 0: this is a zip archive" in lines[0] and "never unpickles" in lines[0]
    assert "internal error" not in res.stderr and not (tmp_path / "g").exists()


def test_an_existing_golden_is_a_usage_error_like_every_other_existing_out(tiny_root, tmp_path, no_ci):
    out = tmp_path / "g"
    out.mkdir()
    (out / "manifest.yaml").write_text("schema_version: 1\n")
    before = sorted(p.name for p in out.iterdir())
    res = CliRunner().invoke(cli, ["golden", str(tiny_root / "qwen3_moe"), str(out), "--prompt-ids", "1,2"])
    assert res.exit_code == 2, res.output
    assert res.stderr.count("\n") == 1 and f"{out}: a golden already exists here" in res.stderr and "--force" in res.stderr
    assert sorted(p.name for p in out.iterdir()) == before
    # the OUT guard every command uses: not inside the model, not over another non-empty directory
    res = CliRunner().invoke(cli, ["golden", str(tiny_root / "qwen3_moe"), str(tiny_root / "qwen3_moe" / "g"), "--prompt-ids", "1,2"])
    assert res.exit_code == 2 and "the output would be written inside the input" in res.stderr, res.output
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    res = CliRunner().invoke(cli, ["golden", str(tiny_root / "qwen3_moe"), str(tmp_path / "other"), "--prompt-ids", "1,2"])
    assert res.exit_code == 2 and "output already exists" in res.stderr, res.output
    assert [p.name for p in (tmp_path / "other").iterdir()] == ["notes.txt"] and not (tiny_root / "qwen3_moe" / "g").exists()
