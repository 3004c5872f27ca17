"""Every hostile input of the inspect tests, and recipes asking for impossible types, fail before any output
exists: exit 3 (2 for a bad flag), one line naming the file and place, nothing written (no OUT, no partial)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from convert_helpers import tiny
from ktconvert.cli import cli
from test_formats_hostile import CASES, _make


def _files(root):
    return {p for p in root.rglob("*")}


def _quantize(tmp_path, src, *args):
    out = tmp_path / "out"
    before = _files(tmp_path)
    res = CliRunner().invoke(cli, ["quantize", str(src), str(out), *args], catch_exceptions=False)
    assert _files(tmp_path) == before, "something was written"
    assert not out.exists() and not (tmp_path / ".out.ktconvert-partial").exists()
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ktconvert: error: ") and "Traceback" not in res.stderr, res.stderr
    assert res.stdout == ""
    return res.exit_code, lines[0]


@pytest.mark.parametrize("name", sorted(CASES))
def test_hostile_input_fails_before_any_output(tmp_path, name):
    p, expect = _make(tmp_path, name)
    code, line = _quantize(tmp_path, p, "--type", "Q8_0")
    assert code == 3, line
    for s in expect:
        assert s in line, (s, line)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tmp_path_factory.mktemp("hostile-models")


def _variant(models, tmp_path, family, edit=None, config=None):
    """A copy of the tiny model with its tensors and/or config.json edited."""
    from safetensors.numpy import load_file

    from ktconvert.formats.safetensors_write import to_bytes

    src = tiny(models, family)
    dst = tmp_path / f"{family}-variant"
    dst.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (dst / f).write_bytes((src / f).read_bytes())
    cfg = json.loads((src / "config.json").read_text())
    if config:
        config(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    t = load_file(src / "model.safetensors")
    if edit:
        edit(t)
    (dst / "model.safetensors").write_bytes(to_bytes(t, {"format": "pt"}))
    return dst


def test_missing_expert(models, tmp_path):
    src = _variant(models, tmp_path, "qwen3_moe", edit=lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight"))
    code, line = _quantize(tmp_path, src, "--type", "Q8_0")
    assert code == 3 and "layer 1 up: 1 of 8 experts missing (3)" in line


def test_shape_disagrees_with_config(models, tmp_path):
    def cfg(c):
        c["moe_intermediate_size"] = 128

    src = _variant(models, tmp_path, "qwen2_moe", config=cfg)
    code, line = _quantize(tmp_path, src, "--type", "Q8_0")
    assert code == 3 and "I (expert intermediate size) is 256 but" in line and "says 128" in line


def test_no_config(models, tmp_path):
    src = tmp_path / "bare"
    src.mkdir()
    (src / "model.safetensors").write_bytes((tiny(models, "mixtral") / "model.safetensors").read_bytes())
    code, line = _quantize(tmp_path, src, "--type", "Q8_0")
    assert code == 3 and "no config.json" in line and "--config" in line


def test_unknown_tensor(models, tmp_path):
    src = _variant(models, tmp_path, "qwen3_moe",
                   edit=lambda t: t.__setitem__("model.layers.0.mystery.weight", np.zeros((4, 4), np.float32)))
    code, line = _quantize(tmp_path, src, "--type", "Q8_0")
    assert code == 3 and "tensor model.layers.0.mystery.weight" in line and "naming map" in line


@pytest.mark.parametrize("to, qtype", [("gguf", "Q8_0"), ("safetensors", "Q8_0")])
def test_unknown_model_type_names_config_json_as_check_rules_does(models, tmp_path, to, qtype):
    # one refusal for quantize and check-rules --model: config.json:model_type, the supported families, the fix
    # (--to hf is left out: it copies any model's own names and dequantizes, whatever its family)
    def cfg(c):
        c["model_type"], c["architectures"] = "ernie4_5_moe", ["Ernie4_5_MoeForCausalLM"]

    src = _variant(models, tmp_path, "qwen3_moe", config=cfg)
    code, line = _quantize(tmp_path, src, "--type", qtype, "--to", to)
    expect = f"{src / 'config.json'}:model_type: model_type 'ernie4_5_moe' is not one of the supported families (qwen2_moe,"
    assert code == 3 and expect in line, line
    rules = tmp_path / "r.yaml"
    rules.write_text("- match:\n    name: '^model$'\n  replace:\n    class: default\n")
    res = CliRunner().invoke(cli, ["check-rules", "--model", str(src), str(rules)])
    assert res.exit_code == 3 and res.stderr.splitlines() == [line], res.output
    rules.unlink()


def test_nan_in_weights_leaves_nothing(models, tmp_path):
    """Only data reveals a NaN: the run stops with exit 3 naming the tensor, and removes its partial output."""

    def poison(t):
        t["model.layers.1.mlp.experts.5.down_proj.weight"][7, 9] = np.nan

    src = _variant(models, tmp_path, "qwen3_moe", edit=poison)
    out = tmp_path / "out"
    res = CliRunner().invoke(cli, ["quantize", str(src), str(out), "--type", "Q8_0"])
    assert res.exit_code == 3, res.output
    line = res.stderr.strip()
    assert "tensor model.layers.1.mlp.experts.5.down_proj.weight: non-finite value nan at row 7, column 9" in line
    assert not out.exists() and not (tmp_path / ".out.ktconvert-partial").exists()
    # keep: bytes copied unchanged, still checked
    res = CliRunner().invoke(cli, ["quantize", str(src), str(out), "--type", "keep"])
    assert res.exit_code == 3 and "model.layers.1.mlp.experts.5.down_proj.weight" in res.stderr
    assert "row 7, column 9" in res.stderr and not out.exists()


RECIPES = {
    # name: (recipe text, substrings, exit code)
    "row-cannot-hold-type": ("kind: convert-recipe\nname: strict\nrules:\n  - {match: '_norm', type: F32}\n"
                             "  - {match: '.', type: Q4_K}\n",
                             ["strict.yaml:5:5", "blk.0.attn_q_b.weight cannot be stored as Q4_K",
                              "rows of 128 are not a multiple of its 256-element block", "fallback"]),
    "type-not-writable": ("kind: convert-recipe\nname: iq\nrules:\n  - {match: '.', type: TQ1_0}\n",
                          ["iq.yaml:4:24", "ktconvert cannot write TQ1_0"]),
    "type-unknown": ("kind: convert-recipe\nname: q9\nrules:\n  - {match: '.', type: Q9_K}\n",
                     ["q9.yaml:4:24", "'Q9_K' is not a ggml type"]),
    "fallback-not-writable": ("kind: convert-recipe\nname: fb\nrules:\n  - {match: '.', type: Q4_K, fallback: [TQ2_0]}\n",
                              ["fb.yaml:4:41", "cannot write TQ2_0"]),
    "bad-regex": ("kind: convert-recipe\nname: rx\nrules:\n  - {match: 'ffn_(gate', type: F32}\n",
                  ["rx.yaml:4:13", "not a valid regex"]),
    "no-catch-all": ("kind: convert-recipe\nname: partial\nrules:\n  - {match: '_exps', type: Q8_0}\n",
                     ["no rule of recipe partial matches token_embd.weight", "catch-all"]),
    "schema": ("kind: convert-recipe\nname: s\nrules:\n  - {match: '.', type: F32, typo: 1}\n",
               ["s.yaml:4:5", "Additional properties are not allowed ('typo' was unexpected)"]),
    "duplicate-key": ("kind: convert-recipe\nname: d\nname: e\nrules:\n  - {match: '.', type: F32}\n",
                      ["d.yaml:3:1", "duplicate key 'name'"]),
    "not-yaml": ("kind: convert-recipe\nrules: [\n", ["invalid YAML"]),
}


@pytest.mark.parametrize("case", sorted(RECIPES))
def test_recipe_with_impossible_type_fails_before_output(models, tmp_path, case):
    text, expect = RECIPES[case]
    stem = {"row-cannot-hold-type": "strict", "type-not-writable": "iq", "type-unknown": "q9",
            "fallback-not-writable": "fb", "bad-regex": "rx", "no-catch-all": "partial", "schema": "s",
            "duplicate-key": "d", "not-yaml": "y"}[case]
    recipe = tmp_path / f"{stem}.yaml"
    recipe.write_text(text)
    code, line = _quantize(tmp_path, tiny(models, "deepseek_v3"), "--recipe", str(recipe))
    assert code == 3, line
    for s in expect:
        assert s in line, (s, line)


@pytest.mark.parametrize("args, expect", [
    (["--type", "TQ1_0"], "--type: ktconvert cannot write TQ1_0"),
    (["--type", "Q4_K", "--recipe", "Q8_0"], "give a recipe or a type, not both"),
    ([], "no recipe and no type given"),
    (["--recipe", "Q7_K_L"], "neither a file nor a preset"),
    (["--type", "Q8_0", "--max-memory", "lots"], "--max-memory 'lots' is not a size"),
])
def test_bad_flags_are_usage_errors(models, tmp_path, args, expect):
    code, line = _quantize(tmp_path, tiny(models, "qwen3_moe"), *args)
    assert code == 2 and expect in line, line


def test_requantizing_a_lossy_gguf_needs_allow_requantize(tmp_path):
    """llama-quantize's rule: a Q8_0 tensor is not quantized again to Q4_K unless asked; one line, nothing written;
    copying it (keep) or decoding it to F32 needs no permission."""
    from click.testing import CliRunner

    from ktconvert.cli import cli
    from ktconvert.convert import convert
    from ktconvert.model.tiny import write_tiny_model

    write_tiny_model("qwen3_moe", tmp_path / "hf")
    src = convert(tmp_path / "hf", tmp_path / "q8", type="Q8_0").out / "model.gguf"
    res = CliRunner().invoke(cli, ["quantize", str(src), str(tmp_path / "out"), "--recipe", "Q4_K_M"])
    assert res.exit_code == 3, res.output
    line = res.output.strip()
    assert "\n" not in line and str(src) in line and "tensor " in line and "already Q8_0" in line
    assert "--allow-requantize" in line and not (tmp_path / "out").exists()
    assert not any(p.name.startswith(".out") for p in tmp_path.iterdir())
    for extra in (["--type", "keep"], ["--type", "F32"], ["--recipe", "Q4_K_M", "--allow-requantize"]):
        res = CliRunner().invoke(cli, ["quantize", str(src), str(tmp_path / "ok"), *extra, "--force"])
        assert res.exit_code == 0, (extra, res.output)
