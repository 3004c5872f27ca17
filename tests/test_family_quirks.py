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
from numeric import assert_close

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
    assert not cfg.attention.qk_norm and normalize_config(tiny_config("glm4_moe")).attention.qk_norm
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


# --- Kimi-K2 and Moonlight: deepseek_v3 configurations (tiny variants) -------------------------------


def _variant_dir(root, family, variant):
    from ktconvert.model.tiny import write_tiny_model

    path = root / f"{family}-{variant}"
    if not path.is_dir():
        write_tiny_model(family, path, variant=variant)
    return path


@pytest.fixture(scope="module")
def variants_root(tmp_path_factory):
    return tmp_path_factory.mktemp("variants")


def test_variant_configs_read_as_their_releases():
    kimi = normalize_config(tiny_config("deepseek_v3", "kimi_k2"))
    assert tiny_config("deepseek_v3", "kimi_k2")["model_type"] == "kimi_k2" and kimi.family == "deepseek_v3"
    assert (kimi.rope.kind, kimi.rope.factor, kimi.rope.beta_fast, kimi.rope.beta_slow, kimi.rope.theta) == ("yarn", 32.0, 1.0, 1.0, 50000.0)
    assert (kimi.routing.n_group, kimi.routing.topk_group, kimi.routing.routed_scaling_factor) == (1, 1, 2.827)
    moon = normalize_config(tiny_config("deepseek_v3", "moonlight"))
    assert moon.attention.q_lora_rank is None and moon.mlp.n_shared_experts == 2 and moon.rope.kind == "default"
    assert tiny_config("deepseek_v3", "moonlight")["q_lora_rank"] is None  # written as null, not dropped
    names = {s.name for s in tensor_specs(moon)}
    assert "model.layers.1.self_attn.q_proj.weight" in names and not any("q_a_proj" in n for n in names)


def test_unknown_variant_is_a_usage_error_naming_the_known_ones(tmp_path):
    res = CliRunner().invoke(cli, ["tiny-model", "deepseek_v3", str(tmp_path / "m"), "--variant", "kimi"])
    assert res.exit_code == 2 and "kimi_k2" in res.output and "moonlight" in res.output
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("family,variant", [("deepseek_v3", "kimi_k2"), ("deepseek_v3", "moonlight")])
def test_variant_reference_matches_its_transformers_golden(family, variant, variants_root):
    """Prefill and token-by-token decode of the reference model within 1e-5 of transformers' golden, and the golden
    reproduces (transformers loads Kimi-K2's unknown model_type as deepseek_v3, as its users do)."""
    import numpy as np
    import torch

    from ktconvert.golden import golden_root, read_golden
    from ktconvert.golden.generate import compute_golden
    from ktconvert.model import from_pretrained

    model_dir = _variant_dir(variants_root, family, variant)
    golden = read_golden(golden_root() / f"{family}-{variant}")
    assert golden.manifest["model"]["tiny_model"] == f"{family}-{variant}"
    ids = torch.from_numpy(golden.input_ids)
    model = from_pretrained(model_dir)
    cache, steps = model.new_cache(), []
    with torch.no_grad():
        prefill = model(ids).logits
        steps.append(model(ids[:, :8], cache).logits)
        steps.extend(model(ids[:, t:t + 1], cache).logits for t in range(8, ids.shape[1]))
    want = torch.from_numpy(golden.logits)
    assert_close(prefill, want, "prefill logits")
    assert_close(torch.cat(steps, 1), want, "decode logits")
    run = compute_golden(model_dir, golden.manifest["prompt"]["ids"], threads=1, decode_check=False)
    assert_close(run.tensors["logits"], golden.logits, "transformers logits")


def test_gate_case_with_an_unknown_variant_is_refused(tmp_path):
    from ktconvert.gate import load_suite

    suite = tmp_path / "suite.yaml"
    suite.write_text("kind: gate-suite\nversion: 1\ncases:\n  - {name: x, family: deepseek_v3, variant: kimi, "
                     "rules: deepseek_v3, type: F32, golden: deepseek_v3, tolerance: f32}\n")
    with pytest.raises(InputError) as exc:
        load_suite(suite)
    assert "kimi_k2" in exc.value.fix and exc.value.where
