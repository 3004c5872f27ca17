"""Recipes as data: presets that pass check-rules and mirror llama.cpp's mixes, first-match-wins rules on llama.cpp
or HF names, layer selectors, fallbacks, and the --type shorthand."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from convert_helpers import tiny
from ktconvert.cli import cli
from ktconvert.convert import load_recipe, plan_conversion, presets, recipe_for_type
from ktconvert.convert.recipe import use_more_bits


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("recipe")


def test_presets_pass_check_rules():
    from ktconvert.io import resources

    res = CliRunner().invoke(cli, ["check-rules", str(resources.rules_dir() / "convert")])
    assert res.exit_code == 0, res.output
    n = len(list((resources.rules_dir() / "convert").glob("*.yaml")))
    assert n >= 23 and f"{n} files checked" in res.output and "0 error(s), 0 warning(s)" in res.output


def test_use_more_bits_is_llama_cpps():
    # llama-quant.cpp: i < n/8 || i >= 7n/8 || (i - n/8) % 3 == 2, in integer arithmetic; for DeepSeek-V3's 61
    assert [i for i in range(24) if use_more_bits(i, 24)] == [0, 1, 2, 5, 8, 11, 14, 17, 20, 21, 22, 23]
    picked = [i for i in range(61) if use_more_bits(i, 61)]
    assert picked[:9] == [0, 1, 2, 3, 4, 5, 6, 9, 12] and picked[-9:] == [51, 53, 54, 55, 56, 57, 58, 59, 60]


def _types(plan):
    return {t.name: t.type for t in plan.tensors}


def test_q4_k_m_mix(root):
    plan = plan_conversion(tiny(root, "deepseek_v3"), "Q4_K_M")
    t = _types(plan)
    assert t["output.weight"] == "Q6_K" and t["token_embd.weight"] == "Q4_K"
    # 3 layers: use_more_bits picks layer 2 only
    assert (t["blk.0.ffn_down.weight"], t["blk.1.ffn_down_exps.weight"], t["blk.2.ffn_down_exps.weight"]) == ("Q4_K", "Q4_K", "Q6_K")
    assert t["blk.2.ffn_down_shexp.weight"] == "Q6_K" and t["blk.2.ffn_up_exps.weight"] == "Q4_K"
    assert t["blk.1.ffn_gate_inp.weight"] == t["blk.2.exp_probs_b.bias"] == t["blk.0.attn_kv_a_norm.weight"] == "F32"
    # 8 experts: llama.cpp treats attn_kv_b like attn_v (Q8_0), attn_k Q8_0 and attn_output Q5_K (rows of 128:
    # its fallback Q5_1); these changed from Q5_0 / Q5_0 when the preset was made to equal llama-quantize's choice
    assert t["blk.0.attn_kv_b.weight"] == "Q8_0" and t["blk.0.attn_output.weight"] == "Q5_1"
    assert plan.kv_keys.count("general.file_type") == 1


def test_rules_match_hf_names_and_layers(root, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "kind: convert-recipe\nname: r\nrules:\n"
        "  - {match: 'mlp\\.experts\\.\\*\\.down_proj', layers: [1], type: Q6_K}\n"   # HF name, one layer
        "  - {match: 'self_attn\\.o_proj', type: Q8_0}\n"                             # HF name of attn_output
        "  - {match: '_exps', type: Q4_0}\n"                                          # llama.cpp name
        "  - {match: '.', type: keep}\n")
    t = _types(plan_conversion(tiny(root, "qwen3_moe"), recipe))
    assert t["blk.1.ffn_down_exps.weight"] == "Q6_K" and t["blk.0.ffn_down_exps.weight"] == "Q4_0"
    assert t["blk.0.attn_output.weight"] == "Q8_0" and t["blk.1.ffn_gate_exps.weight"] == "Q4_0"
    assert t["token_embd.weight"] == "F32"  # keep: the input's F32


def test_first_match_wins_and_fallback_is_recorded(root, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("kind: convert-recipe\nname: r\nrules:\n  - {match: 'attn', type: Q4_K, fallback: [Q4_0]}\n"
                      "  - {match: 'attn_q_b', type: F16}\n  - {match: '.', type: F32}\n")
    plan = plan_conversion(tiny(root, "deepseek_v3"), recipe)
    qb = next(x for x in plan.tensors if x.name == "blk.0.attn_q_b.weight")
    assert qb.type == "Q4_0" and qb.fallback_from == "Q4_K" and qb.rule == 0


def test_type_shorthand():
    r = recipe_for_type("q4_k")
    assert r.name == "Q4_K" and [x.type for x in r.rules] == ["F32", "Q4_K"] and r.rules[1].fallback == ("Q5_0", "F16")
    # llama-quantize's Q4_K is an alias of Q4_K_M: `--pure Q4_K` labels the one type everywhere Q4_K_M
    assert r.file_type == "Q4_K_M"
    assert [recipe_for_type(t).file_type for t in ("Q3_K", "Q5_K", "Q6_K", "Q2_K")] == ["Q3_K_M", "Q5_K_M", "Q6_K", "Q2_K"]
    assert recipe_for_type("keep").rules[1].type == "keep"
    assert load_recipe("q8_0").name == "Q8_0"  # preset names are case-insensitive
    assert set(presets()) == {"Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "cpu-experts-Q4_K", "Q2_K", "Q2_K_S",
                              "Q3_K_S", "Q3_K_M", "Q3_K_L", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M",
                              "IQ3_XXS", "IQ3_XS", "IQ3_S", "IQ3_M", "IQ4_NL", "IQ4_XS"}


def test_keep_refuses_reordering_quant_blocks(root, tmp_path):
    """keep on a quantized tensor that must be transposed cannot copy blocks: without a fallback, an error."""
    from ktconvert.errors import InputError

    plan = plan_conversion(tiny(root, "mixtral"), type="Q8_0")
    assert all(t.type in ("Q8_0", "F32") for t in plan.tensors)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("kind: convert-recipe\nname: r\nrules:\n  - {match: '.', type: BF16}\n")
    t = _types(plan_conversion(tiny(root, "mixtral"), recipe))
    assert set(t.values()) == {"BF16"}
    bad = tmp_path / "b.yaml"
    bad.write_text("kind: convert-recipe\nname: b\nrules:\n  - {match: '.', type: Q4_K}\n")
    with pytest.raises(InputError, match="b.yaml:4:5") as e:
        plan_conversion(tiny(root, "deepseek_v2"), bad)
    assert "and " in str(e.value) and "more tensor(s) the recipe cannot place" in str(e.value)


def test_when_and_counted_layers(root, tmp_path):
    """when: {expert_count, tied_embeddings} and layers: more_bits_counted, as data."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "kind: convert-recipe\nname: r\nrules:\n"
        "  - {match: 'attn_v\\.weight', when: {expert_count: [4, 16]}, type: Q4_0}\n"      # not 8 experts: skipped
        "  - {match: 'attn_k\\.weight', when: {expert_count: 8, tied_embeddings: false}, type: Q5_0}\n"
        "  - {match: '^token_embd', when: {tied_embeddings: true}, type: Q6_K}\n"
        "  - {match: 'attn_v\\.weight', layers: more_bits_counted, type: Q6_K}\n"           # 2 layers: the 2nd
        "  - {match: '.', type: Q8_0}\n")
    t = _types(plan_conversion(tiny(root, "qwen3_moe"), recipe))
    assert (t["blk.0.attn_v.weight"], t["blk.1.attn_v.weight"]) == ("Q8_0", "Q6_K")
    assert t["blk.0.attn_k.weight"] == "Q5_0" and t["token_embd.weight"] == "Q8_0"


def test_bad_when_is_a_one_line_error(root, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("kind: convert-recipe\nname: r\nrules:\n"
                      "  - {match: '.', when: {experts: 8}, type: Q8_0}\n")
    res = CliRunner().invoke(cli, ["quantize", str(tiny(root, "qwen3_moe")), str(tmp_path / "o"), "--recipe",
                                   str(recipe), "--dry-run"])
    assert res.exit_code == 3, res.output
    assert "\n" not in res.output.strip() and f"{recipe}:4" in res.output and "experts" in res.output


def test_llama_format_needs_dry_run(root, tmp_path):
    res = CliRunner().invoke(cli, ["quantize", str(tiny(root, "qwen3_moe")), str(tmp_path / "o"), "--type", "Q8_0",
                                   "-o", "llama"])
    assert res.exit_code == 2 and "--dry-run" in res.output and not (tmp_path / "o").exists()


def test_base_preset_with_overrides(root, tmp_path):
    """A recipe can be llama.cpp's mix except where it says otherwise: its own rules first, then the preset's."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("kind: convert-recipe\nname: mine\nbase: Q4_K_M\nrules:\n"
                      "  - {match: 'ffn_.*_exps', type: Q8_0}\n")
    plan = plan_conversion(tiny(root, "deepseek_v3"), recipe)
    t, ref = _types(plan), _types(plan_conversion(tiny(root, "deepseek_v3"), "Q4_K_M"))
    assert plan.recipe.file_type == "Q4_K_M"
    assert all(t[n] == ("Q8_0" if "_exps" in n and "ffn_" in n else ref[n]) for n in ref)
    recipe.write_text("kind: convert-recipe\nname: mine\nbase: Q9_K\nrules:\n  - {match: '.', type: F32}\n")
    res = CliRunner().invoke(cli, ["quantize", str(tiny(root, "qwen3_moe")), str(tmp_path / "o"), "--recipe",
                                   str(recipe), "--dry-run"])
    assert res.exit_code == 3 and f"{recipe}:3" in res.output and "not a preset" in res.output, res.output
