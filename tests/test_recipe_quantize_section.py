"""A recipe's ``quantize:`` section: llama-quantize's options (tensor types by regex, output / token-embedding type,
pure, leave-output, the importance matrix and its include/exclude lists) said in YAML. It plans what the same
command-line options plan; a bad entry is one line with ``file:line:col``, exit 3, nothing written. Byte-identity
with llama-quantize: tests/test_quantize_presets.py (test_recipe_quantize_section_equals_llama_quantize)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from convert_helpers import tiny
from ktconvert.cli import cli
from ktconvert.convert import load_recipe, plan_conversion, with_overrides


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny(tmp_path_factory.mktemp("rqs"), "qwen3_moe")


def _types(model, recipe) -> dict:
    return {t.name: t.type for t in plan_conversion(model, recipe).tensors}


def test_quantize_section_plans_what_the_options_plan(model, tmp_path):
    f = tmp_path / "mix.yaml"
    f.write_text("kind: convert-recipe\nname: mix\nbase: Q4_K_M\nquantize:\n"
                 "  tensor_types: ['ffn_.*_exps=Q2_K', 'attn_q=Q5_K']\n  output_tensor_type: q8_0\n"
                 "  token_embedding_type: Q4_0\nrules:\n  - {match: 'attn_k\\.', type: Q8_0}\n")
    got = _types(model, str(f))
    base = load_recipe("Q4_K_M")
    want = _types(model, with_overrides(base, tensor_types=("ffn_.*_exps=Q2_K", "attn_q=Q5_K"),
                                        output_tensor_type="Q8_0", token_embedding_type="Q4_0"))
    assert got.pop("blk.0.attn_k.weight") == "Q8_0" and got.pop("blk.1.attn_k.weight") == "Q8_0"
    assert got == {k: v for k, v in want.items() if k in got}
    assert got["blk.0.ffn_up_exps.weight"] == "Q2_K" and got["output.weight"] == "Q8_0"


def test_quantize_section_pure_and_leave_output(model, tmp_path):
    f = tmp_path / "pure.yaml"
    f.write_text("kind: convert-recipe\nname: p\nbase: Q4_K_M\nquantize: {pure: true, leave_output_tensor: true}\n"
                 "rules:\n  - {match: 'never-matches', type: F32}\n")
    got = _types(model, str(f))
    assert got["output.weight"] == "F32" and got["blk.1.ffn_down_exps.weight"] == "Q4_K"
    assert {t for t in got.values()} == {"F32", "Q4_K"}


def test_command_line_goes_in_front_of_the_recipe(model, tmp_path):
    f = tmp_path / "r.yaml"
    f.write_text("kind: convert-recipe\nname: r\nbase: Q4_K_M\nquantize:\n  tensor_types: ['attn_q=Q5_K']\n"
                 "rules:\n  - {match: 'never-matches', type: F32}\n")
    got = _types(model, with_overrides(load_recipe(str(f)), tensor_types=("attn_q=Q6_K",)))
    assert got["blk.0.attn_q.weight"] == "Q6_K"


def test_imatrix_path_is_relative_to_the_recipe(tmp_path):
    sub = tmp_path / "recipes"
    sub.mkdir()
    f = sub / "r.yaml"
    f.write_text("kind: convert-recipe\nname: r\nbase: Q4_K_M\nquantize: {imatrix: m.imatrix.gguf, "
                 "include_weights: [ffn_down]}\nrules:\n  - {match: 'never-matches', type: F32}\n")
    r = load_recipe(str(f))
    assert r.imatrix == str(sub / "m.imatrix.gguf") and r.include_weights == ("ffn_down",)


BAD = {
    "bad regex": ("  tensor_types: ['attn_q=Q5_K', '(attn=Q4_K']\n", "r.yaml:5:33", "is not a valid regex"),
    "not REGEX=TYPE": ("  tensor_types: ['attn_q']\n", "r.yaml:5:", "does not match"),
    "unknown type": ("  output_tensor_type: Q9_K\n", "r.yaml:5:23", "'Q9_K' is not a ggml type"),
    "type ktconvert cannot write": ("  token_embedding_type: TQ1_0\n", "r.yaml:5:25", "cannot write TQ1_0"),
    "both include and exclude": ("  include_weights: [a]\n  exclude_weights: [b]\n", "r.yaml:6:20",
                                 "cannot be used together"),
    "unknown key": ("  imatrixx: m.gguf\n", "r.yaml:5:", "'imatrixx' was unexpected"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_quantize_entry_is_one_line_at_its_place_exit_3_nothing_written(model, tmp_path, case):
    body, where, expect = BAD[case]
    f = tmp_path / "r.yaml"
    f.write_text("kind: convert-recipe\nname: r\nbase: Q4_K_M\nquantize:\n" + body
                 + "rules:\n  - {match: 'never-matches', type: F32}\n")
    out = tmp_path / "out"
    res = CliRunner().invoke(cli, ["quantize", str(model), str(out), "--recipe", str(f)])
    lines = res.stderr.splitlines()
    assert res.exit_code == 3 and len(lines) == 1, res.stderr
    assert where in lines[0] and expect in lines[0], lines[0]
    assert not out.exists()
