"""Reference operators, weight sources and injection decisions, each against an independent statement of
what upstream does."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from verify_helpers import Workspace, experts_path
from ktconvert import quant
from ktconvert.errors import InputError
from ktconvert.model import build_model, load_config, module_type_resolver
from ktconvert.model.inject import EmulationOptions, inject
from ktconvert.model.ops.actquant import round_trip, vec_dot_type
from ktconvert.model.ops.experts import CpuExpertsGGML, CpuKernelNumerics, ExpertsDequant
from ktconvert.model.ops.source import WeightSource, permute_rope_rows, unpermute_rope_rows
from ktconvert.rules.apply import injection_plan, load_rules
from ktconvert.rules.catalog import load_catalog


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    return Workspace(tmp_path_factory.mktemp("verify-ops"))


# --- activation rounding -------------------------------------------------------------------------------------
def test_vec_dot_types_follow_ggml():
    assert [vec_dot_type(t) for t in ("Q4_0", "Q8_0", "Q4_1", "Q4_K", "Q6_K", "F16", "BF16", "F32")] == \
        ["Q8_0", "Q8_0", "Q8_1", "Q8_K", "Q8_K", "F16", "BF16", "F32"]
    assert vec_dot_type("NOPE") is None


def test_q8_0_round_trip_matches_ggml_quantizer_but_for_ties():
    """ggml's reference quantizer scales by 1/d and rounds half away from zero; the AVX path the kernel runs
    scales by 127/amax and rounds half to even. They agree except on rare ties, by at most one step."""
    x = np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32)
    ref = quant.dequantize(quant.quantize(x, "Q8_0"), "Q8_0")
    ours = round_trip(torch.from_numpy(x), "Q8_0").numpy()
    step = np.repeat(np.abs(x).reshape(-1, 32).max(axis=1) / 127, 32).reshape(x.shape)
    diff = np.abs(ours - ref)
    assert (diff > 0).mean() < 1e-3
    assert np.all(diff <= step * 1.001)


def _q8_k_scalar(row: np.ndarray) -> np.ndarray:
    """quantize_row_q8_K_ref followed by d * q, one element at a time, as the C loop."""
    out = np.empty_like(row)
    for b in range(0, row.size, 256):
        blk = row[b:b + 256]
        amax, vmax = np.float32(0), np.float32(0)
        for v in blk:
            if abs(v) > amax:
                amax, vmax = abs(v), v
        if amax == 0:
            out[b:b + 256] = 0
            continue
        iscale = np.float32(-127.0) / vmax
        q = np.minimum(127, np.rint(np.float32(iscale) * blk))  # rint: half to even, as nearest_int
        out[b:b + 256] = (q * np.float32(np.float32(1.0) / iscale)).astype(np.float32)
    return out


def test_q8_k_round_trip_matches_the_c_loop():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 512)).astype(np.float32)
    x[1, :256] = 0  # an all-zero block
    x[2, 7] = -9.0  # the largest magnitude negative: the scale flips sign
    ours = round_trip(torch.from_numpy(x), "Q8_K").numpy()
    for r in range(x.shape[0]):
        np.testing.assert_array_equal(ours[r], _q8_k_scalar(x[r]))


# --- expert operators ----------------------------------------------------------------------------------------
def _blocks_and_reference(ws, family, qtype):
    model_dir = ws.model(family)
    cfg = load_config(model_dir)
    src = WeightSource(ws.gguf(family, qtype), cfg)
    ref = build_model(cfg)
    from ktconvert.model import load_weights

    load_weights(ref, model_dir)
    return src.expert_blocks(1), ref.get_submodule(experts_path(family, 1)), cfg


def _routing(cfg, n=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, cfg.hidden_size, generator=g)
    ids = torch.stack([torch.randperm(cfg.num_experts, generator=g)[: cfg.num_experts_per_tok] for _ in range(n)])
    w = torch.rand(n, cfg.num_experts_per_tok, generator=g)
    return x, ids, w


def test_cpu_experts_without_kernel_rounding_equal_the_reference(ws):
    blocks, ref, cfg = _blocks_and_reference(ws, "qwen3_moe", "F32")
    x, ids, w = _routing(cfg)
    op = CpuExpertsGGML(blocks, CpuKernelNumerics(hidden_dtype="float32", act_quant=False))
    with torch.no_grad():
        torch.testing.assert_close(op(x, ids, w), ref(x, ids, w), rtol=1e-5, atol=1e-6)


def test_cpu_experts_q8_0_match_the_integer_dot_product(ws):
    """ggml's vec_dot_q8_0_q8_0: per 32-block, d_w * d_x * sum(q_w * q_x), summed over blocks. Computed here
    from the stored bytes for one token and one expert, against the emulation's gate projection."""
    blocks, _, cfg = _blocks_and_reference(ws, "qwen3_moe", "Q8_0")
    x = torch.randn(1, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    xb = x.to(torch.bfloat16).to(torch.float32).numpy()[0]
    raw = blocks.gate.data[2].reshape(cfg.mlp.moe_intermediate_size, -1, 34)
    d_w = raw[..., :2].copy().view(np.float16)[..., 0].astype(np.float64)
    q_w = raw[..., 2:].copy().view(np.int8).astype(np.int64)
    xs = xb.reshape(-1, 32)
    amax = np.abs(xs).max(axis=1)
    q_x = np.rint(xs * (np.float32(127) / amax)[:, None]).astype(np.int64)
    d_x = (amax / np.float32(127)).astype(np.float16).astype(np.float64)
    want = np.sum(d_w * d_x[None, :] * np.sum(q_w * q_x[None], axis=-1), axis=-1)
    op = CpuExpertsGGML(blocks, CpuKernelNumerics())
    got = round_trip(torch.from_numpy(xb[None]), "Q8_0") @ op._weight("gate", 2).T
    np.testing.assert_allclose(got.numpy()[0], want, rtol=1e-5, atol=1e-5)


def test_experts_dequant_equals_the_reference(ws):
    blocks, ref, cfg = _blocks_and_reference(ws, "deepseek_v3", "F32")
    x, ids, w = _routing(cfg, seed=5)
    with torch.no_grad():
        torch.testing.assert_close(ExpertsDequant(blocks, "float32")(x, ids, w), ref(x, ids, w), rtol=1e-5, atol=1e-6)
        assert ExpertsDequant(blocks, "bfloat16")(x, ids, w).dtype == torch.float32  # back to the caller's dtype


def test_expert_ids_out_of_range_are_an_error(ws):
    blocks, _, cfg = _blocks_and_reference(ws, "qwen3_moe", "F32")
    x, ids, w = _routing(cfg, n=2)
    ids[0, 0] = cfg.num_experts
    with pytest.raises(ValueError, match="outside"):
        CpuExpertsGGML(blocks, CpuKernelNumerics())(x, ids, w)


# --- weight sources ------------------------------------------------------------------------------------------
def test_rope_row_permutation_round_trips():
    w = np.arange(8 * 64 * 3, dtype=np.float32).reshape(8 * 64, 3)
    p = permute_rope_rows(w, 8)
    assert not np.array_equal(p, w)
    np.testing.assert_array_equal(unpermute_rope_rows(p, 8), w)


def test_split_kv_b_is_rebuilt(ws):
    cfg = load_config(ws.model("deepseek_v2"))
    fused = WeightSource(ws.gguf("deepseek_v2", "F32"), cfg)
    split = WeightSource(ws.gguf("deepseek_v2", "F32", split_kv_b=True), cfg)
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    assert "blk.1.attn_kv_b.weight" not in split._ck and "blk.1.attn_k_b.weight" in split._ck
    np.testing.assert_array_equal(split.tensor(name), fused.tensor(name))


def test_per_expert_names_slice_the_merged_tensor(ws):
    cfg = load_config(ws.model("mixtral"))
    src = WeightSource(ws.gguf("mixtral", "F32"), cfg)
    ref = WeightSource(ws.model("mixtral"), cfg)
    name = "model.layers.0.block_sparse_moe.experts.5.w3.weight"
    np.testing.assert_array_equal(src.tensor(name), ref.tensor(name))


def test_missing_expert_tensor_is_named(ws):
    cfg = load_config(ws.model("qwen2_moe"))
    src = WeightSource(ws.gguf("qwen2_moe", "Q8_0", drop=("blk.1.ffn_down_exps.weight",)), cfg)
    with pytest.raises(InputError, match=r"experts of layer 1: no tensor blk\.1\.ffn_down_exps\.weight"):
        src.expert_blocks(1)


def test_gguf_of_another_architecture_is_refused(ws):
    cfg = load_config(ws.model("qwen2_moe"))
    with pytest.raises(InputError, match="architecture 'llama'"):
        WeightSource(ws.gguf("mixtral", "F32"), cfg)


# --- injection -----------------------------------------------------------------------------------------------
def _injected(ws, family, rules_text=None, threshold=0, prompt_len=31, weights=None):
    model_dir = ws.model(family)
    text = rules_text or ws.rules(family).read_text()
    text = text.replace("per_layer_prefill_intput_threshold: 0", f"per_layer_prefill_intput_threshold: {threshold}")
    path = ws.root / f"{family}-inject-{threshold}.yaml"
    path.write_text(text)
    cfg = load_config(model_dir)
    model, catalog = build_model(cfg), load_catalog()
    plan = injection_plan(model, load_rules(path), catalog, module_type_resolver(catalog))
    return inject(model, plan, WeightSource(weights or model_dir, cfg), prompt_len=prompt_len, options=EmulationOptions())


def test_layerwise_prefill_switches_what_upstream_switches(ws):
    qwen = _injected(ws, "qwen2_moe", threshold=8)
    deepseek = _injected(ws, "deepseek_v3", threshold=8)
    assert qwen.layerwise(31) and not qwen.layerwise(8) and not qwen.layerwise(1)
    # KQwen2MoeModel.load_layer_to switches attention projections and the router; KDeepseekV2Model's does not
    assert "model.layers.1.self_attn.q_proj" in qwen.prefill_paths and "model.layers.1.mlp.gate" in qwen.prefill_paths
    assert "model.layers.1.mlp.shared_expert_gate" not in qwen.prefill_paths
    assert "model.layers.1.self_attn.q_a_proj" not in deepseek.prefill_paths
    assert "model.layers.1.mlp.experts" in deepseek.prefill_paths and "lm_head" not in deepseek.prefill_paths
    qwen.set_layerwise(True)
    modes = {p: s.mode for p, s in qwen.switches.items()}
    assert modes["model.layers.1.mlp.experts"] == "prefill" and modes["lm_head"] == "generate"
    qwen.set_layerwise(False)
    assert {s.mode for s in qwen.switches.values()} == {"generate"}


def test_prefill_ops_are_not_built_when_layerwise_prefill_cannot_run(ws):
    off = _injected(ws, "qwen2_moe", threshold=0)
    assert not off.prefill_paths and all(s.ops["prefill"] is None for s in off.switches.values())
    short = _injected(ws, "qwen2_moe", threshold=40, prompt_len=31)
    assert short.layerwise_threshold == 40 and not short.prefill_paths


def test_not_emulated_ops_are_named_and_fall_back(ws):
    text = ws.rules("qwen3_moe").read_text().replace('generate_op: "KExpertsCPU"', 'generate_op: "KExpertsMarlin"')
    text = text.replace('generate_device: "cpu"', 'generate_device: "cuda"').replace('      out_device: "cuda"\n', "")
    inj = _injected(ws, "qwen3_moe", rules_text=text, weights=ws.gguf("qwen3_moe", "Q8_0"))
    (row,) = inj.not_emulated
    assert (row.op, row.emulation) == ("KExpertsMarlin", "experts-dequant")
    assert "experts-marlin-int4 is not implemented" in row.detail
    assert row.modules == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]


def test_amx_backend_is_not_the_llamafile_kernel(ws):
    text = ws.rules("qwen3_moe").read_text().replace('out_device: "cuda"', 'out_device: "cuda"\n      backend: "AMXInt8"')
    inj = _injected(ws, "qwen3_moe", rules_text=text)
    (row,) = inj.not_emulated
    assert row.op == "KExpertsCPU" and "backend AMXInt8" in row.detail


def test_experts_left_default_load_per_expert_slices(ws):
    """A rule file without an experts rule leaves the reference experts in place; their per-expert
    parameters come out of the merged GGUF tensors (upstream's generic loader path)."""
    from ktconvert.verify import run_verify

    text = ws.rules("mixtral").read_text()
    start = text.index("- match:\n    name: \"^model\\\\.layers\\\\.[0-9]+\\\\.block_sparse_moe\\\\.experts$\"")
    end = text.index("recursive: false", start) + len("recursive: false\n")
    path = ws.root / "mixtral-default-experts.yaml"
    path.write_text(text[:start] + text[end:])
    report = run_verify(ws.model("mixtral"), path, ws.golden("mixtral"), weights=ws.gguf("mixtral", "F32"), profile="f32")
    assert report.passed, [b.line() for b in report.breaches]
    assert not any(u["slot"] for u in report.injection["operators"] if "experts" in u["modules"][0])


def test_cpu_experts_with_an_unknown_activation_type_are_not_emulated(ws, monkeypatch):
    """A weight type whose vec_dot_type the table lacks runs without activation rounding and says so."""
    from ktconvert.model.ops import experts

    monkeypatch.setattr(experts, "vec_dot_type", lambda t: None if t == "Q8_0" else "F32")
    inj = _injected(ws, "qwen3_moe", weights=ws.gguf("qwen3_moe", "Q8_0"))
    (row,) = inj.not_emulated
    assert row.op == "KExpertsCPU" and "activation type for Q8_0 weights is not known" in row.detail
