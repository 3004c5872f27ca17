"""Qwen3-VL-MoE's text model beyond the family-parametrised tests: the published layout (packed experts stored
transposed under model.language_model.*), orientation from the spec where shapes cannot tell, the GGUF keys
llama.cpp's qwen3vlmoe loader reads, and byte parity with llama.cpp's quantizer."""

from __future__ import annotations

import json

import pytest

from convert_helpers import assert_q8_0_matches_llama_quantize
from ktconvert.formats.config import ModelDims
from ktconvert.formats.layout import AMBIGUOUS, ORIENT_T, _fused_orientation
from ktconvert.model.tiny import write_tiny_model

FAMILY = "qwen3_vl_moe"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    out = tmp_path_factory.mktemp("qvl") / "model"
    write_tiny_model(FAMILY, out)
    return out


def test_tiny_model_is_in_the_published_layout(model):
    from ktconvert.formats import open_checkpoint

    ck = open_checkpoint(model)
    assert all(n.startswith(("model.language_model.", "lm_head.")) for n in ck)
    # [E, H, 2I] and [E, I, H] with H = 256, I = 512, no .weight (as the released checkpoints)
    assert ck["model.language_model.layers.1.mlp.experts.gate_up_proj"].shape == (8, 256, 1024)
    assert ck["model.language_model.layers.1.mlp.experts.down_proj"].shape == (8, 512, 256)
    assert json.loads((model / "config.json").read_text())["text_config"]["model_type"] == "qwen3_vl_moe_text"


def test_orientation_comes_from_the_spec_where_shapes_cannot_tell():
    """A gate_up_proj [8, 512, 512] alone is [E, 2I, H] with I = 256, H = 512 or [E, H, 2I] with H = 512, I = 256;
    without config.json dimensions only the family's spec decides."""
    shapes = {"gate_up": (8, 512, 512)}
    assert _fused_orientation(shapes, ModelDims(source="x"))[2] == AMBIGUOUS
    assert _fused_orientation(shapes, ModelDims(source="x", fused_orientation="transposed"))[2] == ORIENT_T


def test_gguf_carries_the_keys_llamacpp_reads(model, tmp_path):
    from gguf import GGUFReader

    from ktconvert.convert import convert

    kv = GGUFReader(convert(model, tmp_path / "out", type="F32").out / "model.gguf").fields
    assert kv["general.architecture"].contents() == "qwen3vlmoe"
    assert kv["qwen3vlmoe.n_deepstack_layers"].contents() == 1  # vision_config.deepstack_visual_indexes
    assert kv["qwen3vlmoe.rope.dimension_sections"].contents() == [12, 10, 10, 0]
    assert kv["qwen3vlmoe.expert_feed_forward_length"].contents() == 512


@pytest.mark.interop
def test_q8_0_is_byte_identical_to_llamacpps_quantizer(llama_built, model, tmp_path):
    from ktconvert.convert import convert

    f32 = convert(model, tmp_path / "f32", type="F32").out / "model.gguf"
    assert_q8_0_matches_llama_quantize(model, f32, tmp_path)
