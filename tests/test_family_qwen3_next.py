"""Qwen3-Next beyond what the family-parametrised tests check: the published checkpoint layout and config spelling,
the grouped in_proj_qkvz / in_proj_ba packing (reference model, llama.cpp's split into attn_qkv / attn_gate, and
verify reading it back), the GGUF metadata, and byte parity with llama.cpp's quantizer."""

from __future__ import annotations

import json

import numpy as np
import pytest

from convert_helpers import assert_q8_0_matches_llama_quantize
from ktconvert.errors import InputError
from ktconvert.families import normalize_config
from ktconvert.formats import transforms
from ktconvert.model.tiny import tiny_config, write_tiny_model
from numeric import assert_close

FAMILY = "qwen3_next"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    out = tmp_path_factory.mktemp("q3n") / "model"
    write_tiny_model(FAMILY, out)
    return out


@pytest.fixture(scope="module")
def f32(model, tmp_path_factory):
    from ktconvert.convert import convert

    return convert(model, tmp_path_factory.mktemp("q3nf32") / "out", type="F32").out / "model.gguf"


def _inspect(path) -> dict:
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", "ktconvert", "inspect", str(path), "--format", "json"],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_tiny_model_is_in_the_published_layout_and_inspect_is_clean(model, f32):
    from ktconvert.formats import open_checkpoint

    cfg = json.loads((model / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3NextForCausalLM"]
    assert cfg["layer_types"] == ["linear_attention", "full_attention"] and "text_config" not in cfg
    names = list(open_checkpoint(model))
    assert all(n.startswith(("model.", "lm_head.")) for n in names)
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in names  # per expert, not packed
    assert {"model.layers.0.linear_attn.in_proj_qkvz.weight", "model.layers.0.linear_attn.in_proj_ba.weight",
            "model.layers.1.self_attn.q_proj.weight", "model.layers.0.mlp.shared_expert_gate.weight"} <= set(names)
    assert not any(".in_proj_qkv." in n or ".in_proj_z." in n for n in names)
    for path, arch in ((model, "qwen3next"), (f32, "qwen3next")):
        report = _inspect(path)
        assert report["architecture"]["arch"] == arch and report["problems"] == [], report["problems"]
    assert {ly["layout"] for ly in _inspect(model)["layers"]} == {"hf-split"}


def test_transformers_loads_the_tiny_model_with_nothing_missing(model):
    transformers = pytest.importorskip("transformers")
    import torch

    m, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(model), dtype=torch.float32, local_files_only=True, output_loading_info=True)
    assert type(m).__name__ == "Qwen3NextForCausalLM"
    assert not any(info.values()), info
    assert m.config.layer_types == ["linear_attention", "full_attention"]


def _hub(raw: dict) -> dict:
    """The tiny config in the published config.json's spelling (Qwen3-Next-80B-A3B-Instruct): full_attention_interval
    instead of layer_types, rope_theta and partial_rotary_factor at the top level, rope_scaling null."""
    hub = {k: v for k, v in raw.items() if k not in ("layer_types", "rope_parameters")}
    rope = raw["rope_parameters"]
    return {**hub, "full_attention_interval": 2, "rope_theta": rope["rope_theta"],
            "partial_rotary_factor": rope["partial_rotary_factor"], "rope_scaling": None}


def test_hub_and_transformers_spellings_read_alike():
    """The tiny config (what transformers 5.23 saves: layer_types, rope_parameters) and the hub's spelling normalise
    to the same model, and transformers reads the hub's into the saved one."""
    transformers = pytest.importorskip("transformers")
    raw = tiny_config(FAMILY)
    hub = _hub(raw)
    saved = transformers.Qwen3NextConfig(**{k: v for k, v in hub.items() if k != "model_type"}).to_dict()
    assert "full_attention_interval" not in saved and saved["layer_types"] == raw["layer_types"]
    a, b, c = normalize_config(raw), normalize_config(hub), normalize_config(saved)
    assert (a.attention.layer_types, a.rope, a.attention.linear, a.mlp.moe_layers, a.routing.norm_topk_prob) == (
        b.attention.layer_types, b.rope, b.attention.linear, b.mlp.moe_layers, b.routing.norm_topk_prob) == (
        c.attention.layer_types, c.rope, c.attention.linear, c.mlp.moe_layers, c.routing.norm_topk_prob)
    assert a.rope.dim == 16  # 0.25 of head_dim 64
    del hub["partial_rotary_factor"]  # transformers' (and llama.cpp's converter's) default
    assert normalize_config(hub).rope.dim == 16


def test_grouped_projections_unpack_as_transformers_does():
    """The reference GatedDeltaNet's in_proj_qkvz / in_proj_ba unpacking equals transformers'
    fix_query_key_value_ordering, and the whole layer equals transformers' module (its chunked prefill) to 1e-5."""
    transformers = pytest.importorskip("transformers")
    import torch
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    from ktconvert.model import build_model

    raw = tiny_config(FAMILY)
    ref = build_model(raw).model.layers[0].linear_attn
    theirs = hf.Qwen3NextGatedDeltaNet(transformers.Qwen3NextConfig(**{k: v for k, v in raw.items() if k != "model_type"}), 0)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() > 1 else 0.5))
        ref.load_state_dict(theirs.state_dict())
        x = torch.randn(1, 9, raw["hidden_size"], generator=g)
        qkv, z, b, a = ref.projections(x)
        q_, k_, v_, z_, b_, a_ = theirs.fix_query_key_value_ordering(theirs.in_proj_qkvz(x), theirs.in_proj_ba(x))
        want = torch.cat([t.reshape(1, 9, -1) for t in (q_, k_, v_)], dim=-1)
        assert torch.equal(qkv, want) and torch.equal(z, z_.reshape(1, 9, -1))
        assert torch.equal(b, b_) and torch.equal(a, a_)
        got, want = ref(x, torch.arange(9)[None]), theirs(x)
    assert_close(got, want, "layer output")


def _llamacpp_qkvz(w: np.ndarray, cfg: dict) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's Qwen3NextModel.modify_tensors on in_proj_qkvz, restated in numpy from its torch code."""
    hk, hv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    nk, nv, h = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"], cfg["hidden_size"]
    sizes = [hk, hk, nv // nk * hv, nv // nk * hv]
    x = w.T.reshape(h, nk, sum(sizes))
    q, k, v, z = np.split(x, np.cumsum(sizes)[:-1], axis=-1)
    flat = [t.reshape(h, -1) for t in (q, k, v, z)]
    return np.concatenate(flat[:3], axis=-1).T, flat[3].T


def test_gguf_tensors_are_llamacpps_and_verify_reads_them_back(f32, model):
    """attn_qkv / attn_gate are the split llama.cpp's converter makes of in_proj_qkvz (value heads grouped, not
    tiled as for Qwen3.5), ssm_ba is in_proj_ba unchanged, norms gain 1, A_log becomes -exp(A_log); read back through
    verify's loader every tensor is the checkpoint's again."""
    from gguf import GGUFReader

    from ktconvert.model import load_config
    from ktconvert.model.ops.source import WeightSource
    from ktconvert.model.weights import read_tensors, to_reference_state

    cfg = load_config(model)
    hf = {k: v.numpy() for k, v in to_reference_state(cfg, read_tensors(model)).items()}
    got = {t.name: np.asarray(t.data) for t in GGUFReader(f32).tensors}
    qkv, z = _llamacpp_qkvz(hf["model.layers.0.linear_attn.in_proj_qkvz.weight"],
                            json.loads((model / "config.json").read_text()))
    np.testing.assert_array_equal(got["blk.0.attn_qkv.weight"], qkv)
    np.testing.assert_array_equal(got["blk.0.attn_gate.weight"], z)
    np.testing.assert_array_equal(got["blk.0.ssm_ba.weight"], hf["model.layers.0.linear_attn.in_proj_ba.weight"])
    np.testing.assert_array_equal(got["blk.0.ssm_a"], -np.exp(hf["model.layers.0.linear_attn.A_log"]))
    np.testing.assert_array_equal(got["blk.0.ssm_dt.bias"], hf["model.layers.0.linear_attn.dt_bias"])
    np.testing.assert_array_equal(got["blk.1.attn_q_norm.weight"], hf["model.layers.1.self_attn.q_norm.weight"] + 1)
    np.testing.assert_array_equal(got["blk.0.ssm_norm.weight"], hf["model.layers.0.linear_attn.norm.weight"])
    assert got["blk.0.ssm_conv1d.weight"].shape == (256, 4)  # 2 x 2 x 32 q/k + 4 x 32 v channels, kernel 4
    assert not any(n.startswith("blk.1.attn_qkv") or n.startswith("blk.0.attn_q.") for n in got)
    src = WeightSource(f32, cfg)
    for name, arr in hf.items():
        if ".experts." not in name:
            # (w + 1) - 1 is w to within one ulp of 1.0; the model then forms 1 + that, which is exactly w + 1
            np.testing.assert_allclose(src.tensor(name, arr.shape), arr, rtol=2e-6, atol=1.2e-7, err_msg=name)
    assert src.stored_type("model.layers.0.linear_attn.in_proj_qkvz.weight") == "F32"


def test_gguf_metadata_is_llamacpps(model, f32, tmp_path):
    """What llama.cpp's Qwen3NextModel converter writes (ssm.*, full_attention_interval, the partial rope width),
    plus recurrent_layers from layer_types: transformers drops the hub's full_attention_interval when it saves, and
    the converter then writes its default 4 (both tiny layers would be linear); llama.cpp's loader reads
    recurrent_layers first. A hub-spelled config.json carries its interval through."""
    from gguf import GGUFReader

    from ktconvert.convert import convert

    kv = GGUFReader(f32).fields
    assert [kv[f"qwen3next.ssm.{k}"].contents() for k in
            ("conv_kernel", "state_size", "group_count", "time_step_rank", "inner_size")] == [4, 32, 2, 4, 128]
    assert kv["qwen3next.attention.recurrent_layers"].contents() == [True, False]
    assert kv["qwen3next.full_attention_interval"].contents() == 4
    assert kv["qwen3next.rope.dimension_count"].contents() == 16
    assert kv["qwen3next.rope.freq_base"].contents() == 1e7
    assert kv["qwen3next.expert_feed_forward_length"].contents() == 256
    assert kv["qwen3next.expert_shared_feed_forward_length"].contents() == 256
    assert kv["qwen3next.attention.key_length"].contents() == 64
    src = tmp_path / "model"
    src.mkdir()
    for f in model.iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    (src / "config.json").write_text(json.dumps(_hub(tiny_config(FAMILY))))
    kv = GGUFReader(convert(src, tmp_path / "out", type="F32").out / "model.gguf").fields
    assert kv["qwen3next.full_attention_interval"].contents() == 2
    assert kv["qwen3next.attention.recurrent_layers"].contents() == [True, False]
    assert kv["qwen3next.rope.dimension_count"].contents() == 16


def test_mtp_tensors_are_left_out_as_llamacpps_converter_does(model, f32, tmp_path):
    """Releases ship a multi-token-prediction block under mtp.*, outside num_hidden_layers' numbering: quantize leaves it
    out with a note (the spec's checkpoint.ignore_prefixes), the other tensors are the same."""
    from gguf import GGUFReader
    from safetensors.numpy import save_file

    from ktconvert.convert import convert

    src = tmp_path / "model"
    src.mkdir()
    for f in model.iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    save_file({"mtp.fc.weight": np.zeros((256, 512), np.float32),
               "mtp.layers.0.input_layernorm.weight": np.zeros(256, np.float32)}, str(src / "mtp.safetensors"))
    res = convert(src, tmp_path / "out", type="F32")
    assert any("mtp.fc.weight" in n for n in res.manifest["plan"]["notes"])
    got = {t.name: t.data.tobytes() for t in GGUFReader(res.out / "model.gguf").tensors}
    assert got == {t.name: t.data.tobytes() for t in GGUFReader(f32).tensors}


def test_redo_and_join_are_inverse():
    from ktconvert.arch.gated_deltanet import LinearAttentionDims

    cfg = {"linear_num_key_heads": 2, "linear_num_value_heads": 6, "linear_key_head_dim": 3, "linear_value_head_dim": 4}
    dims = LinearAttentionDims(2, 6, 3, 4, conv_kernel=4)
    rows = 2 * (2 * 3 + 2 * 3 * 4)
    a = np.random.default_rng(0).standard_normal((rows, 5)).astype(np.float32)
    qkv, z = (transforms.redo(a, {"qkvz_split": p}, dims, "x") for p in ("qkv", "z"))
    assert qkv.shape == (2 * 2 * 3 + 6 * 4, 5) and z.shape == (6 * 4, 5)
    want_qkv, want_z = _llamacpp_qkvz(a, {**cfg, "hidden_size": 5})
    np.testing.assert_array_equal(qkv, want_qkv)
    np.testing.assert_array_equal(z, want_z)
    np.testing.assert_array_equal(transforms.join_qkvz(qkv, z, dims, "x"), a)
    with pytest.raises(InputError):
        transforms.redo(a[:-1], {"qkvz_split": "z"}, dims, "x")


@pytest.mark.interop
def test_q8_0_is_byte_identical_to_llamacpps_quantizer(llama_built, f32, model, tmp_path):
    """ktconvert's Q8_0 equals llama_model_quantize of ktconvert's F32 GGUF, tensor for tensor (types and bytes):
    attn_qkv / attn_gate / ssm_ba quantized, the conv kernels and ssm_a kept F32."""
    assert_q8_0_matches_llama_quantize(model, f32, tmp_path)


@pytest.mark.parametrize("change,where", [
    ({"layer_types": ["linear_attention"]}, "layer_types"),
    ({"layer_types": ["linear_attention", "sliding_attention"]}, "layer_types"),
    ({"linear_num_value_heads": 3}, "linear_num_value_heads"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.01}}, "partial_rotary_factor"),
])
def test_bad_hybrid_config_is_one_error_naming_the_key(change, where):
    raw = tiny_config(FAMILY)
    raw.update(change)
    with pytest.raises(InputError) as exc:
        normalize_config(raw, path="config.json")
    assert exc.value.where == where and "config.json" in str(exc.value)
