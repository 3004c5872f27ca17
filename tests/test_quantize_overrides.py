"""llama-quantize's per-tensor options as recipe overrides (``with_overrides``; ``quantize --tensor-type`` ...):
the types they choose on the tiny qwen3_moe's plan, and their usage errors (exit 2, one line, nothing written).
Byte-identity with llama-quantize's options: tests/test_quantize_imatrix_parity.py."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from convert_helpers import tiny
from ktconvert.cli import cli
from ktconvert.convert import load_recipe, plan_conversion, recipe_for_type, with_overrides


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny(tmp_path_factory.mktemp("ovr"), "qwen3_moe")


def _types(model, recipe) -> dict:
    return {t.name: t.type for t in plan_conversion(model, recipe).tensors}


def test_overrides_take_precedence_in_llama_quantizes_order(model):
    base = _types(model, load_recipe("Q4_K_M"))
    got = _types(model, with_overrides(load_recipe("Q4_K_M"), tensor_types=("ffn_.*_exps=Q2_K", "ffn_=Q5_K"),
                                       output_tensor_type="q8_0", token_embedding_type="Q4_0"))
    assert got["blk.1.ffn_down_exps.weight"] == "Q2_K"  # the first matching --tensor-type wins
    assert got["blk.1.ffn_gate_inp.weight"] == "F32"  # routers are never overridden
    assert got["output.weight"] == "Q8_0" and got["token_embd.weight"] == "Q4_0"
    assert got["blk.0.attn_q.weight"] == base["blk.0.attn_q.weight"]
    assert _types(model, with_overrides(load_recipe("Q4_K_M"), leave_output_tensor=True))["output.weight"] == "F32"


def test_pure_is_one_type_and_keeps_the_file_type(model):
    r = with_overrides(load_recipe("Q4_K_M"), pure=True)
    assert r.file_type == "Q4_K_M"
    got = _types(model, r)
    assert {t for n, t in got.items() if t != "F32"} == {"Q4_K"} and got["output.weight"] == "Q4_K"
    assert with_overrides(recipe_for_type("Q6_K"), pure=True).rules == recipe_for_type("Q6_K").rules


@pytest.mark.parametrize("args,expect", [
    (["--tensor-type", "attn_q=Q9_K"], "--tensor-type: 'Q9_K' is not a ggml type"),
    (["--tensor-type", "attn_q"], "is not REGEX=TYPE"),
    (["--tensor-type", "(attn=Q4_K"], "is not a valid regex"),
    (["--output-tensor-type", "TQ2_0"], "--output-tensor-type: ktconvert cannot write TQ2_0"),
    (["--token-embedding-type", "q4"], "--token-embedding-type: 'q4' is not a ggml type"),
])
def test_bad_override_is_one_line_exit_2_nothing_written(tmp_path, model, args, expect):
    out = tmp_path / "out"
    res = CliRunner().invoke(cli, ["quantize", str(model), str(out), "--recipe", "Q4_K_M", *args])
    lines = res.stderr.splitlines()
    assert res.exit_code == 2 and len(lines) == 1 and expect in lines[0], res.stderr
    assert list(tmp_path.iterdir()) == []
