"""Layout detection per layer: E, I, H and layout on real saves, orientation decisions, and every problem kind."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from formats_helpers import FAMILIES, H, I, gguf_from_hf, hf_checkpoint, kt_amx_checkpoint
from ktconvert.formats import detect_layout, open_checkpoint


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("layout")


def _variant(src, dst, drop=(), add=None, config=None):
    """A copy of a one-file HF checkpoint with tensors dropped/added (written by the safetensors package)."""
    from safetensors.numpy import load_file, save_file

    tensors = load_file(src / "model.safetensors")
    for name in drop:
        del tensors[name]
    tensors.update(add or {})
    dst.mkdir(parents=True)
    save_file(tensors, dst / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(config or {})
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _kinds(report, severity=None):
    return [p.id for p in report.all_problems if severity is None or p.severity == severity]


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
@pytest.mark.parametrize("fmt", ["split", "fused"])
def test_transformers_saves(root, model_type, fmt):
    n_exp, moe_layers, arch, _ = FAMILIES[model_type]
    rep = detect_layout(open_checkpoint(hf_checkpoint(root, model_type, fmt)))
    assert rep.arch == arch and rep.n_layers == 3 and not rep.unknown
    assert [ly.layer for ly in rep.layers] == list(moe_layers)
    for ly in rep.layers:
        assert (ly.layout, ly.n_experts, ly.intermediate, ly.hidden) == (f"hf-{fmt}", n_exp, I, H)
        assert ly.router is not None
        if fmt == "split":
            assert ly.orientation is None
            assert ly.projections["gate"].shape == (I, H) and ly.projections["gate"].ne == (H, I)
            assert ly.projections["down"].shape == (H, I)
            assert ly.projections["up"].experts == tuple(range(n_exp))
        else:
            assert ly.orientation == "[E,2I,H]"
            assert ly.projections["gate_up"].shape == (n_exp, 2 * I, H)
            assert ly.projections["gate_up"].ne == (H, 2 * I, n_exp)
            assert ly.projections["down"].shape == (n_exp, H, I)
        assert (ly.score_bias is not None) == (model_type == "deepseek_v3")
        assert bool(ly.shared_experts) == (model_type in ("qwen2_moe", "deepseek_v2", "deepseek_v3"))
    assert _kinds(rep, "error") == [] and _kinds(rep) == ["row-length"]  # I=24: not a multiple of 32


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_gguf_merged_written_by_gguf(root, model_type):
    n_exp, moe_layers, arch, _ = FAMILIES[model_type]
    ck = open_checkpoint(gguf_from_hf(root, model_type) / "model.gguf")
    rep = detect_layout(ck)
    assert rep.arch == arch and rep.arch_source == "general.architecture" and rep.dims.source == "GGUF metadata"
    assert [ly.layer for ly in rep.layers] == list(moe_layers)
    for ly in rep.layers:
        assert (ly.layout, ly.n_experts, ly.intermediate, ly.hidden) == ("gguf-merged", n_exp, I, H)
        gate, down = ly.projections["gate"], ly.projections["down"]
        assert gate.dtypes == ("Q8_0",) and down.dtypes == ("F16",)
        assert gate.shape == (n_exp, I, H) and gate.ne == (H, I, n_exp)
        assert down.shape == (n_exp, H, I) and down.ne == (I, H, n_exp)
    assert _kinds(rep, "error") == [] and not rep.unknown


def test_gguf_legacy_split_experts_and_split_set(root):
    rep = detect_layout(open_checkpoint(gguf_from_hf(root, "mixtral", legacy_split=True)))
    for ly in rep.layers:
        assert (ly.layout, ly.n_experts, ly.intermediate, ly.hidden) == ("gguf-split", 4, I, H)
        assert ly.projections["gate"].ne == (H, I) and len(ly.projections["gate"].tensors) == 4
    legacy = [p for p in rep.problems if p.id == "legacy-layout"]
    assert legacy[0].severity == "warning" and "3 layer(s)" in legacy[0].message and "b3990" in legacy[0].message
    rep = detect_layout(open_checkpoint(gguf_from_hf(root, "qwen3_moe", split_max_tensors=12)))
    assert [(ly.layout, ly.n_experts, ly.intermediate, ly.hidden) for ly in rep.layers] == [("gguf-merged", 8, I, H)] * 3


def test_transposed_fused_checkpoint(root, tmp_path):
    src = hf_checkpoint(root, "qwen3_moe", "fused")
    ck = open_checkpoint(src)
    swapped = {}
    for L in range(3):
        for p in ("gate_up_proj", "down_proj"):
            name = f"model.layers.{L}.mlp.experts.{p}"
            swapped[name] = np.ascontiguousarray(np.asarray(ck.read(name)).transpose(0, 2, 1))
    d = _variant(src, tmp_path / "t", add=swapped)
    rep = detect_layout(open_checkpoint(d))
    for ly in rep.layers:
        assert (ly.layout, ly.orientation, ly.intermediate, ly.hidden) == ("hf-fused", "[E,H,2I]", I, H)
        assert ly.projections["gate_up"].shape == (8, H, 2 * I)
    assert _kinds(rep, "error") == []


def _fused_dir(tmp_path, name, gate_up, down=None, config=None):
    from safetensors.numpy import save_file

    d = tmp_path / name
    d.mkdir()
    t = {"model.layers.0.mlp.experts.gate_up_proj": np.zeros(gate_up, np.float16)}
    if down:
        t["model.layers.0.mlp.experts.down_proj"] = np.zeros(down, np.float16)
    save_file(t, d / "model.safetensors")
    if config:
        (d / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_hidden_layers": 1, **config}))
    return d


def test_h_equals_2i_is_decided_by_down_proj(tmp_path):
    std = detect_layout(open_checkpoint(_fused_dir(tmp_path, "a", (4, 48, 48), (4, 48, 24)))).layers[0]
    assert (std.orientation, std.intermediate, std.hidden) == ("[E,2I,H]", 24, 48)
    tr = detect_layout(open_checkpoint(_fused_dir(tmp_path, "b", (4, 48, 48), (4, 24, 48)))).layers[0]
    assert (tr.orientation, tr.intermediate, tr.hidden) == ("[E,H,2I]", 24, 48)


def test_without_down_proj_config_decides_or_it_is_reported_ambiguous(tmp_path):
    rep = detect_layout(open_checkpoint(_fused_dir(tmp_path, "a", (4, 48, 64))))
    assert rep.layers[0].orientation == "ambiguous" and rep.layers[0].intermediate is None
    amb = [p for p in rep.all_problems if p.id == "ambiguous-orientation"]
    assert amb and "pass --config" in amb[0].message
    cfg = {"hidden_size": 64, "moe_intermediate_size": 24, "num_experts": 4}
    ly = detect_layout(open_checkpoint(_fused_dir(tmp_path, "b", (4, 48, 64), config=cfg))).layers[0]
    assert (ly.orientation, ly.intermediate, ly.hidden) == ("[E,2I,H]", 24, 64)
    cfg = {"hidden_size": 48, "moe_intermediate_size": 24, "num_experts": 4}
    d = _fused_dir(tmp_path, "c", (4, 48, 48), config=cfg)
    rep = detect_layout(open_checkpoint(d))
    assert rep.layers[0].orientation == "ambiguous"
    assert any("config.json does not decide either" in p.message for p in rep.all_problems)
    # an explicit --config overrides the one next to the checkpoint
    ly = detect_layout(open_checkpoint(_fused_dir(tmp_path, "d", (4, 48, 64), config={"hidden_size": 48,
                                                                                         "moe_intermediate_size": 32})),
                       config={"model_type": "qwen3_moe", "hidden_size": 64, "moe_intermediate_size": 24}).layers[0]
    assert (ly.orientation, ly.intermediate, ly.hidden) == ("[E,2I,H]", 24, 64)


@pytest.mark.parametrize("bits, quant", [(4, "AMXINT4"), (8, "AMXINT8")])
def test_kt_amx(root, bits, quant):
    rep = detect_layout(open_checkpoint(kt_amx_checkpoint(root, bits=bits)))
    assert rep.arch == "deepseek2" and not rep.unknown
    assert [(ly.layer, ly.layout, ly.n_experts, ly.intermediate, ly.hidden, ly.quant, ly.numa_parts)
            for ly in rep.layers] == [(L, "kt-amx", 4, 256, 128, quant, 2) for L in (1, 2)]
    assert _kinds(rep) == ["opaque-layout"]  # H=128 would draw a row-length note for unpacked layouts


def test_kt_amx_missing_blob(root, tmp_path):
    from safetensors.numpy import load_file, save_file

    d = tmp_path / "amx"
    shutil.copytree(kt_amx_checkpoint(root), d)
    gone = "blk.1.ffn_up_exps.3.numa.1.scale"
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    shard = d / idx["weight_map"].pop(gone)
    tensors = load_file(shard)
    del tensors[gone]
    save_file(tensors, shard)
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    rep = detect_layout(open_checkpoint(d))
    msgs = [p.message for p in rep.all_problems if p.id == "missing-experts"]
    assert msgs == ["layer 1 up: 1 of 8 (expert, NUMA part) scale blobs missing"]
    assert rep.layer(2).quant == "AMXINT4" and not [p for p in rep.layer(2).problems]


def test_missing_extra_and_unequal_experts(root, tmp_path):
    src = hf_checkpoint(root, "qwen3_moe", "split")
    d = _variant(src, tmp_path / "v", drop=["model.layers.1.mlp.experts.3.gate_proj.weight"],
                 add={"model.layers.2.mlp.experts.8.up_proj.weight": np.zeros((I, H), np.float32),
                      "model.layers.0.mlp.experts.2.up_proj.weight": np.zeros((I + 1, H), np.float32)})
    rep = detect_layout(open_checkpoint(d))
    probs = {(p.id, p.extra["layer"]): p for p in rep.all_problems}
    assert "1 of 8 experts missing (3)" in probs[("missing-experts", 1)].message
    assert probs[("extra-experts", 2)].extra["tensors"] == ("model.layers.2.mlp.experts.8.up_proj.weight",)
    odd = probs[("unequal-expert-shapes", 0)]
    assert odd.extra["tensors"] == ("model.layers.0.mlp.experts.2.up_proj.weight",) and "[25, 64]" in odd.message
    assert all(p.severity == "error" for p in (probs[("missing-experts", 1)], odd))


def test_layer_without_experts_and_config_mismatch(root, tmp_path):
    src = hf_checkpoint(root, "deepseek_v3", "split")
    drop = [f"model.layers.2.mlp.experts.{e}.{p}.weight" for e in range(8) for p in ("gate_proj", "up_proj", "down_proj")]
    d = _variant(src, tmp_path / "v", drop=drop)
    rep = detect_layout(open_checkpoint(d))
    assert rep.layer(2).layout is None
    assert any(p.id == "missing-experts" and p.extra["layer"] == 2 and "MoE layer" in p.message for p in rep.all_problems)
    rep = detect_layout(open_checkpoint(src), config={"model_type": "deepseek_v3", "hidden_size": 128,
                                                      "moe_intermediate_size": I, "n_routed_experts": 8,
                                                      "num_hidden_layers": 3, "first_k_dense_replace": 1})
    msgs = [p.message for p in rep.all_problems if p.id == "config-mismatch"]
    assert msgs == ["layer 1: H (hidden size) is 64 but config says 128", "layer 2: H (hidden size) is 64 but config says 128"]


def test_mixed_layouts_within_and_across_layers(root, tmp_path):
    split = open_checkpoint(hf_checkpoint(root, "qwen3_moe", "split"))
    fused = open_checkpoint(hf_checkpoint(root, "qwen3_moe", "fused"))
    add = {n: np.asarray(fused.read(n)) for n in fused if ".layers.2.mlp.experts." in n}
    drop = [n for n in split if ".layers.2.mlp.experts." in n]
    d = _variant(hf_checkpoint(root, "qwen3_moe", "split"), tmp_path / "across", drop=drop, add=add)
    rep = detect_layout(open_checkpoint(d))
    assert [ly.layout for ly in rep.layers] == ["hf-split", "hf-split", "hf-fused"]
    assert any(p.id == "mixed-layouts" and "hf-fused in 1 layer(s), hf-split in 2" in p.message for p in rep.problems)
    add = {n: np.asarray(fused.read(n)) for n in fused if ".layers.1.mlp.experts.down_proj" in n}
    d = _variant(hf_checkpoint(root, "qwen3_moe", "split"), tmp_path / "within", add=add)
    rep = detect_layout(open_checkpoint(d))
    assert rep.layer(1).layout == "mixed"
    assert any(p.id == "mixed-layouts" and p.extra["layer"] == 1 for p in rep.all_problems)


def test_mtp_layer_and_unknown_tensors(root, tmp_path):
    src = hf_checkpoint(root, "deepseek_v3", "split")
    ck = open_checkpoint(src)
    add = {n.replace("layers.2.", "layers.3."): np.asarray(ck.read(n)) for n in ck if ".layers.2.mlp.experts." in n}
    add["some.vendor.extra"] = np.zeros(3, np.float32)
    rep = detect_layout(open_checkpoint(_variant(src, tmp_path / "v", add=add)))
    assert rep.layer(3).layout == "hf-split"
    assert any(p.id == "extra-layer" and p.extra["layer"] == 3 and p.severity == "info" for p in rep.all_problems)
    assert rep.unknown == ("some.vendor.extra",)


def test_row_length_note_depends_on_the_dims(tmp_path):
    d = _fused_dir(tmp_path, "k", (2, 512, 256), (2, 256, 256))
    assert [p.id for p in detect_layout(open_checkpoint(d)).all_problems] == []
    d = _fused_dir(tmp_path, "q", (2, 64, 256), (2, 256, 32))
    rows = [p for p in detect_layout(open_checkpoint(d)).all_problems if p.id == "row-length"]
    assert rows[0].severity == "info"
    assert rows[0].message == "row length I=32 (down rows) is not a multiple of 256: K-quants (Q2_K..Q6_K) cannot hold it"
