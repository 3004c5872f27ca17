"""Qwen3.5-MoE beyond what the family-parametrised tests check: the published checkpoint layout, the config keys
transformers drops that llama.cpp reads, llama.cpp's value transforms, and byte parity with llama.cpp's quantizer."""

from __future__ import annotations

import json

import numpy as np
import pytest

from convert_helpers import assert_q8_0_matches_llama_quantize
from ktconvert.errors import InputError
from ktconvert.families import normalize_config
from ktconvert.formats import transforms
from ktconvert.model.tiny import tiny_config, write_tiny_model

FAMILY = "qwen3_5_moe"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    out = tmp_path_factory.mktemp("q35") / "model"
    write_tiny_model(FAMILY, out)
    return out


@pytest.fixture(scope="module")
def f32(model, tmp_path_factory):
    from ktconvert.convert import convert

    return convert(model, tmp_path_factory.mktemp("q35f32") / "out", type="F32").out / "model.gguf"


def test_tiny_model_is_in_the_published_layout(model):
    import subprocess
    import sys

    from ktconvert.formats import open_checkpoint

    cfg = json.loads((model / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3_5MoeForConditionalGeneration"] and "text_config" in cfg
    names = list(open_checkpoint(model))
    assert all(n.startswith(("model.language_model.", "lm_head.")) for n in names)
    assert "model.language_model.layers.1.mlp.experts.7.down_proj.weight" in names  # per expert, not packed
    res = subprocess.run([sys.executable, "-m", "ktconvert", "inspect", str(model), "--format", "json"],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["architecture"]["arch"] == "qwen35moe" and report["problems"] == []
    assert {ly["layout"] for ly in report["layers"]} == {"hf-split"}


def test_config_keys_transformers_drops_are_kept_in_the_gguf(model, tmp_path):
    """transformers 5.23 turns full_attention_interval into layer_types and drops it; llama.cpp's converter reads
    it (and mrope_section, which only the rope parameters keep)."""
    from gguf import GGUFReader

    from ktconvert.convert import convert

    transformers = pytest.importorskip("transformers")
    assert "full_attention_interval" not in transformers.Qwen3_5MoeTextConfig(full_attention_interval=2).to_dict()
    src = tmp_path / "model"
    src.mkdir()
    for f in model.iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((model / "config.json").read_text())
    cfg["text_config"]["full_attention_interval"] = 2
    (src / "config.json").write_text(json.dumps(cfg))
    kv = GGUFReader(convert(src, tmp_path / "out", type="F32").out / "model.gguf").fields
    assert kv["qwen35moe.full_attention_interval"].contents() == 2
    assert kv["qwen35moe.rope.dimension_sections"].contents() == [3, 3, 2, 0]
    assert kv["qwen35moe.attention.recurrent_layers"].contents() == [True, False]
    assert kv["qwen35moe.rope.dimension_count"].contents() == 16  # partial_rotary_factor 0.25 of 64
    assert [kv[f"qwen35moe.ssm.{k}"].contents() for k in
            ("conv_kernel", "state_size", "group_count", "time_step_rank", "inner_size")] == [4, 32, 2, 4, 128]


def test_value_transforms_are_llamacpps_and_undo_inverts_them(f32, model):
    """Norms gain 1, A_log becomes -exp(A_log), value heads go from grouped to tiled (2 key heads, 4 value heads
    in the tiny model): read back through verify's loader, every tensor is the checkpoint's again."""
    from gguf import GGUFReader

    from ktconvert.model import load_config
    from ktconvert.model.ops.source import WeightSource
    from ktconvert.model.weights import read_tensors, to_reference_state

    cfg = load_config(model)
    hf = {k: v.numpy() for k, v in to_reference_state(cfg, read_tensors(model)).items()}
    got = {t.name: np.asarray(t.data) for t in GGUFReader(f32).tensors}
    np.testing.assert_array_equal(got["blk.0.attn_norm.weight"], hf["model.layers.0.input_layernorm.weight"] + 1)
    np.testing.assert_array_equal(got["blk.0.ssm_norm.weight"], hf["model.layers.0.linear_attn.norm.weight"])
    a = -np.exp(hf["model.layers.0.linear_attn.A_log"])  # per value head, tiled too
    np.testing.assert_array_equal(got["blk.0.ssm_a"], a.reshape(2, 2).T.reshape(-1))
    z = hf["model.layers.0.linear_attn.in_proj_z.weight"].reshape(2, 2, 32, -1)  # [key head, value of it, ...]
    np.testing.assert_array_equal(got["blk.0.attn_gate.weight"], z.swapaxes(0, 1).reshape(128, -1))
    assert got["blk.0.ssm_conv1d.weight"].shape == (256, 4)  # 2 x 2 x 32 q/k + 4 x 32 v channels, kernel 4
    src = WeightSource(f32, cfg)
    for name, arr in hf.items():
        if ".experts." not in name:
            # (w + 1) - 1 is w to within one ulp of 1.0; the model then forms 1 + that, which is exactly w + 1
            np.testing.assert_allclose(src.tensor(name, arr.shape), arr, rtol=2e-6, atol=1.2e-7, err_msg=name)


def test_redo_and_undo_are_inverse():
    from ktconvert.arch.gated_deltanet import LinearAttentionDims

    cfg = LinearAttentionDims(2, 6, 3, 4, conv_kernel=4)
    rng = np.random.default_rng(0)
    for kind, shape in (("qkv_value_rows", (36, 5)), ("value_rows", (24, 5)), ("scalar_rows", (6, 5)),
                        ("scalar_cols", (6,)), ("value_cols", (5, 24))):
        a = rng.standard_normal(shape).astype(np.float32)
        t = {"v_heads": kind}
        np.testing.assert_array_equal(transforms.undo(transforms.redo(a, t, cfg, "x"), t, cfg, "x"), a)
    assert transforms.tiled_order(2, 3) == [0, 3, 1, 4, 2, 5]


@pytest.mark.interop
def test_q8_0_is_byte_identical_to_llamacpps_quantizer(llama_built, f32, model, tmp_path):
    """ktconvert's Q8_0 equals llama_model_quantize of ktconvert's F32 GGUF, tensor for tensor (types and bytes):
    the F32 conv kernels and ssm_a included."""
    assert_q8_0_matches_llama_quantize(model, f32, tmp_path)


@pytest.mark.parametrize("change,where", [
    ({"layer_types": ["linear_attention"]}, "layer_types"),
    ({"layer_types": ["linear_attention", "sliding_attention"]}, "layer_types"),
    ({"linear_num_value_heads": 3}, "linear_num_value_heads"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.01}}, "partial_rotary_factor"),
])
def test_bad_hybrid_config_is_one_error_naming_the_key(change, where):
    raw = tiny_config(FAMILY)
    raw["text_config"].update(change)
    with pytest.raises(InputError) as exc:
        normalize_config(raw, path="config.json")
    assert exc.value.where == where and "config.json" in str(exc.value)
