"""The families added as data files (issue 17): each one's config quirks in both spellings, `inspect` clean on
its tiny model and on the GGUF `quantize` writes, and bad values refused in one line naming the key.

The numerics are proven elsewhere, against upstream: the goldens (transformers) in test_reference_models and
test_golden, llama.cpp in test_interop_llamacpp, verify and its localisation in test_verify_conversions, the
shipped rule files in the gate."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from ktconvert.cli import cli
from ktconvert.errors import InputError
from ktconvert.families import normalize_config
from ktconvert.model.tiny import tiny_config, tensor_specs
from ktconvert.rules import modeltree

NEW = ("glm4_moe", "minimax_m2")


def _inspect(path) -> dict:
    res = CliRunner().invoke(cli, ["inspect", str(path), "-o", "json"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


@pytest.mark.parametrize("family", NEW)
def test_inspect_is_clean_on_the_tiny_model_and_its_gguf(family, tiny_root, tmp_path):
    from ktconvert.convert import convert

    for path in (tiny_root / family, convert(tiny_root / family, tmp_path / "q", type="F32").out / "model.gguf"):
        report = _inspect(path)
        assert [p for p in report["problems"] if p["severity"] != "info"] == [], report["problems"]
        assert report["architecture"]["arch"] == normalize_config(tiny_config(family)).spec.gguf_arch


# --- GLM-4.5 / 4.6 --------------------------------------------------------------------------------------


def _glm_hub() -> dict:
    """The tiny config in the spelling of the GLM-4.5 hub release: partial_rotary_factor and rope_theta at the top
    level, no rope_parameters."""
    raw = tiny_config("glm4_moe")
    rope = raw.pop("rope_parameters")
    raw["partial_rotary_factor"], raw["rope_theta"] = rope["partial_rotary_factor"], rope["rope_theta"]
    return raw


def test_glm_partial_rotary_in_both_spellings_and_by_default():
    tf5, hub = normalize_config(tiny_config("glm4_moe")), normalize_config(_glm_hub())
    assert tf5.head_dim == hub.head_dim == 128 and tf5.rope == hub.rope and tf5.rope.dim == 64
    raw = _glm_hub()
    del raw["partial_rotary_factor"]  # transformers 5.23 and llama.cpp's converter both default to 0.5
    assert normalize_config(raw).rope.dim == 64
    # a family without the key rotates the whole head, as before
    assert normalize_config(tiny_config("qwen3_moe")).rope.dim == normalize_config(tiny_config("qwen3_moe")).head_dim


def test_glm_air_without_qk_norm():
    """GLM-4.5-Air sets use_qk_norm false: no q_norm/k_norm in the tensors, the reference or the probe tree."""
    raw = tiny_config("glm4_moe")
    raw["use_qk_norm"] = False
    cfg = normalize_config(raw)
    assert not cfg.qk_norm and normalize_config(tiny_config("glm4_moe")).qk_norm
    assert not any(".q_norm." in s.name or ".k_norm." in s.name for s in tensor_specs(cfg))
    assert not any(n.path.endswith("q_norm") for n in modeltree.build_tree(raw).nodes)
    assert cfg.attention_bias_on == ("q_proj", "k_proj", "v_proj")  # o_proj never has one


@pytest.mark.parametrize("value", [0, 1.5, "half", True, 0.01])
def test_glm_bad_partial_rotary_factor_is_one_line_naming_the_key(value):
    raw = _glm_hub()
    raw["partial_rotary_factor"] = value
    with pytest.raises(InputError) as exc:
        normalize_config(raw, path="config.json")
    assert exc.value.where == "partial_rotary_factor" and "\n" not in str(exc.value)


# --- MiniMax-M2 -----------------------------------------------------------------------------------------


def test_minimax_rotary_dim_spelling_and_whole_projection_qk_norm():
    """The hub writes rotary_dim (no rope_parameters factor); the q/k norms span every head of the projection."""
    raw = tiny_config("minimax_m2")
    raw["rope_parameters"] = {"rope_theta": 5000000.0, "rope_type": "default"}
    cfg = normalize_config(raw)
    assert cfg.rope.dim == 64 and cfg.rope == normalize_config(tiny_config("minimax_m2")).rope
    shapes = {s.name: s.shape for s in tensor_specs(cfg)}
    assert shapes["model.layers.0.self_attn.q_norm.weight"] == (cfg.num_attention_heads * cfg.head_dim,)
    assert shapes["model.layers.0.self_attn.k_norm.weight"] == (cfg.num_key_value_heads * cfg.head_dim,)
    raw["rotary_dim"] = 256  # more than head_dim
    with pytest.raises(InputError) as exc:
        normalize_config(raw, path="config.json")
    assert exc.value.where == "rotary_dim"


def test_minimax_score_bias_is_the_blocks_and_steers_the_choice():
    """The bias is stored as block_sparse_moe.e_score_correction_bias (the checkpoint's name, not gate's) and the
    gate reads that very tensor: zeroing it changes which experts the last layer picks."""
    import torch

    from ktconvert.model import build_model, load_weights
    from ktconvert.model.tiny import tiny_tensors

    cfg = normalize_config(tiny_config("minimax_m2"))
    model = build_model(cfg)
    load_weights(model, {k: torch.from_numpy(v) for k, v in tiny_tensors("minimax_m2").items()})
    state = model.state_dict()
    assert "model.layers.1.block_sparse_moe.e_score_correction_bias" in state
    assert not any(k.endswith("gate.e_score_correction_bias") for k in state)
    block = model.model.layers[1].block_sparse_moe
    hidden = torch.randn(16, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ids, _ = block.gate(hidden)
        block.e_score_correction_bias.zero_()
        ids_unbiased, _ = block.gate(hidden)
    assert not torch.equal(ids.sort(-1).values, ids_unbiased.sort(-1).values)
