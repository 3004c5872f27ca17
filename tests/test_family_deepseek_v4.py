"""DeepSeek-V4 (deepseek_v4): the maths and spellings the other families lack, against transformers 5.23's own model.

* the reference model vs transformers at float32 on the tiny model in the release's native names: the golden prompt
  (window-only, ratio-4 and ratio-128 layers, hash and score routing, hyper-connections, grouped output projection),
  a cached decode, and a prompt long enough that the ratio-128 layer closes a window;
* the hash table decides routing (a zeroed tid2eid changes the logits); both config spellings (the release's
  compress_ratios / num_hash_layers / qk_rope_head_dim and transformers' layer_types / compress_rates /
  mlp_layer_types) read alike; bad configs are one error naming the key;
* the native names round-trip through the spec's renames; ``inspect`` is clean; check-rules' probe tree has the
  release's layer layout;
* ``quantize`` writes the keys llama.cpp's deepseek4 loader requires (compress ratios, indexer, output groups,
  hyper-connections, hash layers, swiglu clamps, sqrtsoftplus gating) and tid2eid as I32; ``verify`` passes the F32
  and Q8_0 conversions and names the layer and module of a broken one; kt-amx is refused (the AMX kernels do not
  clamp). llama.cpp's agreement is in ``tests/test_interop_llamacpp.py`` (F32 and Q8_0).
"""

from __future__ import annotations

import shutil
from operator import attrgetter

import numpy as np
import pytest
import torch

from convert_helpers import assert_q8_0_matches_llama_quantize
from family_checks import assert_swap_localised, assert_verify_passes
from transformers_helpers import transformers_523
from ktconvert import families
from ktconvert.errors import InputError
from ktconvert.families import normalize_config
from ktconvert.golden import golden_root, read_golden
from ktconvert.io.resources import rules_dir
from ktconvert.model import from_pretrained
from ktconvert.model.tiny import tiny_config, tiny_tensors
from numeric import assert_close

FAMILY = "deepseek_v4"
RULES = rules_dir() / "optimize" / f"{FAMILY}.yaml"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tiny_root):
    return tiny_root / FAMILY


@pytest.fixture(scope="module")
def converted(tiny, tmp_path_factory):
    from ktconvert.convert import convert

    root = tmp_path_factory.mktemp("deepseek_v4_q")
    return {q: convert(tiny, root / q, type=q).out / "model.gguf" for q in ("F32", "Q8_0")}


@pytest.fixture(scope="module")
def hf(tiny):
    transformers = transformers_523()
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(tiny), dtype=torch.float32, attn_implementation="eager", experts_implementation="eager").eval()


@pytest.fixture(scope="module")
def ref(tiny):
    return from_pretrained(tiny)


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 510, (1, n), generator=torch.Generator().manual_seed(seed))


def test_release_layout_loads_in_transformers_with_nothing_missing(tiny):
    transformers = transformers_523()
    _, info = transformers.AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32,
                                                                 output_loading_info=True)
    assert not any(info.values()), info


def test_reference_matches_the_golden(ref):
    g = read_golden(golden_root() / FAMILY)
    with torch.no_grad():
        out = ref(torch.from_numpy(g.tensors["input_ids"]))
    assert_close(out.logits, g.tensors["logits"], "logits")
    states = torch.stack(out.hidden_states)
    for i, (have, want) in enumerate(zip(states, g.tensors["hidden_states"])):
        assert_close(have, want, f"hidden state {i}")


@pytest.mark.parametrize("n", [31, 140])
def test_reference_matches_transformers_prefill_and_decode(ref, hf, n):
    """140 tokens close the ratio-128 layer's first window (the golden's 31 do not)."""
    ids = _ids(n)
    with torch.no_grad():
        want = hf(input_ids=ids, use_cache=False).logits
        got = ref(ids).logits
        assert_close(got, want, "prefill logits")
        if n > 40:
            return
        out = hf(input_ids=ids[:, :1], use_cache=True)
        hf_steps = [out.logits]
        for t in range(1, n):  # transformers' own cached decode (its stateful compressor) against ours
            out = hf(input_ids=ids[:, t:t + 1], past_key_values=out.past_key_values, use_cache=True)
            hf_steps.append(out.logits)
        cache = ref.new_cache()
        steps = torch.cat([ref(ids[:, t:t + 1], cache).logits for t in range(n)], dim=1)
    assert_close(steps, torch.cat(hf_steps, dim=1), "decode logits")
    assert_close(steps, want, "decode vs prefill", rel=5e-5)  # float32 rounding of two paths, over 31 steps


def test_clamped_swiglu_matches_transformers_experts_past_the_limit():
    """silu(min(g, 10)) * clamp(u, +-10) on inputs far past the limit, against DeepseekV4Experts and the shared
    DeepseekV4MLP (the tiny model's activations stay below 10)."""
    from transformers_helpers import modeling_523
    from ktconvert.model.modules import GatedMLP

    transformers, mod = modeling_523(FAMILY)
    cfg = transformers.AutoConfig.for_model(**tiny_config(FAMILY))
    rel = normalize_config(tiny_config(FAMILY))
    torch.manual_seed(0)
    experts, shared = mod.DeepseekV4Experts(cfg), mod.DeepseekV4MLP(cfg)
    for p in list(experts.parameters()) + list(shared.parameters()):
        torch.nn.init.normal_(p, std=0.5)
    x = torch.randn(16, cfg.hidden_size)
    ours = GatedMLP(cfg.hidden_size, rel.mlp.moe_intermediate_size, rel.expert_proj_names, clamp=rel.activation.clamp)
    inter = rel.mlp.moe_intermediate_size
    with torch.no_grad():
        ours.w1.weight.copy_(experts.gate_up_proj[3, :inter])
        ours.w3.weight.copy_(experts.gate_up_proj[3, inter:])
        ours.w2.weight.copy_(experts.down_proj[3])
        assert (ours.w1(x).abs() > 10).float().mean() > 0.2  # the clamp is exercised
        want = experts(x, torch.full((16, 1), 3), torch.ones(16, 1))
        assert_close(ours(x), want, "routed experts")
        sh = GatedMLP(cfg.hidden_size, rel.mlp.shared_experts_inter, clamp=rel.activation.clamp)
        sh.load_state_dict(shared.state_dict())
        assert_close(sh(x), shared(x), "shared expert")
        plain = GatedMLP(cfg.hidden_size, rel.mlp.shared_experts_inter)  # no clamp: far from transformers
        plain.load_state_dict(shared.state_dict())
        assert (plain(x) - shared(x)).abs().max().item() > 1.0


def test_hash_table_decides_the_routing(tiny, tmp_path):
    """A hash layer's tid2eid replaced: the logits move (the table, not the gate's top-k, picks its experts)."""
    from ktconvert.formats.safetensors_write import to_bytes

    tensors = tiny_tensors(FAMILY)
    tensors["layers.0.ffn.gate.tid2eid"] = (tensors["layers.0.ffn.gate.tid2eid"] + 1) % 8
    model_dir = tmp_path / "m"
    shutil.copytree(tiny, model_dir)
    (model_dir / "model.safetensors").write_bytes(to_bytes(tensors, {"format": "pt"}))
    ids = _ids(31)
    with torch.no_grad():
        base = from_pretrained(tiny)(ids).logits
        moved = from_pretrained(model_dir)(ids).logits
    assert (moved - base).abs().max().item() > 1e-2


def test_release_and_transformers_spellings_read_alike(hf):
    rel = normalize_config(tiny_config(FAMILY))
    saved = hf.config.to_dict()
    tf = normalize_config(saved)
    assert "compress_ratios" not in saved and saved["layer_types"][2] == "heavily_compressed_attention"
    for field in ("attention.compressed", "residual", "routing.hash_layers", "attention.indexer",
                  "attention.sliding_window", "rope", "activation", "routing", "attention.q_lora_rank", "head_dim"):
        assert attrgetter(field)(rel) == attrgetter(field)(tf), field
    assert rel.attention.compressed.ratios == (0, 4, 128) and rel.routing.hash_layers == (0,)
    assert rel.activation.clamp == (None, 10.0) and rel.activation.shared  # transformers' DeepseekV4MLP clamps too


@pytest.mark.parametrize("change, where", [
    ({"compress_ratios": [0, 4, 64]}, "compress_ratios"),
    ({"num_key_value_heads": 2, "num_attention_heads": 4}, "num_key_value_heads"),
    ({"o_groups": 3}, "o_groups"),
    ({"sliding_window": None}, "sliding_window"),
    ({"scoring_func": "softmax"}, "topk_method"),
    ({"qk_rope_head_dim": 15}, "qk_rope_head_dim"),
    ({"num_hash_layers": -1}, "num_hash_layers"),
    ({"hc_mult": 0}, "hc_mult"),
    ({"hc_eps": 0.0}, "hc_eps"),
    ({"mlp_layer_types": ["moe", "hash_moe", "moe"]}, "mlp_layer_types"),
    ({"compress_ratios": None, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
     "layer_types"),
    ({"compress_ratios": None}, "compress_ratios"),
])
def test_bad_configs_are_one_error_naming_the_key(change, where):
    raw = {**tiny_config(FAMILY), **change}
    with pytest.raises(InputError) as err:
        normalize_config(raw, path="config.json")
    assert err.value.where == where and "config.json" in str(err.value)


def test_native_names_round_trip_through_the_spec():
    sp = families.spec(FAMILY)
    for name in tiny_tensors(FAMILY):
        canonical = sp.canonical_name(name)
        assert canonical != name and sp.published_name(canonical) == name, name
    assert sp.canonical_name("layers.1.attn.indexer.compressor.norm.weight") == \
        "model.layers.1.self_attn.compressor.indexer.kv_norm.weight"
    assert sp.canonical_name("layers.1.attn.kv_norm.weight") == "model.layers.1.self_attn.kv_norm.weight"


def test_inspect_is_clean(tiny, converted):
    from ktconvert.formats.inspect_report import build_inspect_report

    for src in (tiny, converted["Q8_0"]):
        report = build_inspect_report(src)
        assert report["problems"] == [] and report["exit_code"] == 0, src
        assert report["architecture"]["arch"] == "deepseek4" and report["layouts"]


def test_index_table_outside_int32_is_one_error_naming_the_tensor(tiny, tmp_path):
    """tid2eid values llama.cpp's I32 cannot hold: the conversion stops naming the tensor, nothing is written."""
    from ktconvert.convert import convert
    from ktconvert.formats.safetensors_write import to_bytes

    tensors = tiny_tensors(FAMILY)
    tensors["layers.0.ffn.gate.tid2eid"][3, 1] = 2**40
    model_dir = tmp_path / "m"
    shutil.copytree(tiny, model_dir)
    (model_dir / "model.safetensors").write_bytes(to_bytes(tensors, {"format": "pt"}))
    with pytest.raises(InputError, match="do not fit llama.cpp's I32") as err:
        convert(model_dir, tmp_path / "out", type="F32")
    assert "layers.0.ffn.gate.tid2eid" in str(err.value)
    assert not (tmp_path / "out").exists()


def test_probe_tree_has_the_release_layout():
    """check-rules without --model: 43 layers, the first 3 hash-routed, ratio 4 / 128 compressors by layer."""
    from ktconvert.rules.modeltree import probe_tree

    nodes = {n.path: n.type for n in probe_tree(FAMILY).root.walk()}
    assert nodes["model.layers.2.mlp.gate"] == "DeepseekV4HashRouter"
    assert nodes["model.layers.3.mlp.gate"] == "DeepseekV4TopKRouter"
    assert "model.layers.1.self_attn.compressor" not in nodes
    assert nodes["model.layers.2.self_attn.compressor.indexer"] == "DeepseekV4Indexer"
    assert nodes["model.layers.3.self_attn.compressor"] == "DeepseekV4HCACompressor"
    assert nodes["model.hc_head"] == "DeepseekV4HyperHead" and "model.layers.42.ffn_hc" in nodes


# --- conversion, verify ----------------------------------------------------------------------------------------------


def test_gguf_keeps_what_llamacpp_reads(tiny, converted):
    """The keys llama.cpp 0.3.36's deepseek4 loader requires, with the release config's values (compress_ratios and
    num_hash_layers, which transformers 5.23 respells, included); tid2eid stored as I32 [vocab, top_k]."""
    from ktconvert.formats import open_checkpoint

    ck = open_checkpoint(converted["F32"])
    md = ck.metadata
    a = "deepseek4"
    assert md["general.architecture"] == a
    ratios = md[f"{a}.attention.compress_ratios"]
    assert ratios.element_type == "INT32" and list(ratios.values) == [0, 4, 128]
    assert md[f"{a}.hash_layer_count"] == 1 and md[f"{a}.expert_gating_func"] == 4  # sqrtsoftplus
    assert [md[f"{a}.attention.indexer.{k}"] for k in ("head_count", "key_length", "top_k")] == [16, 64, 4]
    assert md[f"{a}.attention.output_group_count"] == 2 and md[f"{a}.attention.output_lora_rank"] == 64
    assert md[f"{a}.attention.sliding_window"] == 8 and md[f"{a}.attention.q_lora_rank"] == 64
    assert md[f"{a}.attention.compress_rope_freq_base"] == 160000.0 and md[f"{a}.rope.freq_base"] == 10000.0
    assert md[f"{a}.rope.dimension_count"] == 16 and md[f"{a}.attention.key_length"] == 64
    assert (md[f"{a}.hyper_connection.count"], md[f"{a}.hyper_connection.sinkhorn_iterations"]) == (4, 20)
    assert md[f"{a}.embedding_length_out"] == 4 * 256
    assert list(md[f"{a}.swiglu_clamp_exp"].values) == list(md[f"{a}.swiglu_clamp_shexp"].values) == [10.0] * 3
    assert md[f"{a}.expert_weights_scale"] == 1.5 and md[f"{a}.expert_weights_norm"] is True
    assert ck["blk.0.ffn_gate_tid2eid.weight"].dtype == "I32"
    table = np.asarray(ck.read("blk.0.ffn_gate_tid2eid.weight")).reshape(512, 2)
    assert np.array_equal(table, tiny_tensors(FAMILY)["layers.0.ffn.gate.tid2eid"])
    assert "blk.0.exp_probs_b.bias" not in ck and "blk.1.exp_probs_b.bias" in ck  # hash layers have no score bias
    q8 = open_checkpoint(converted["Q8_0"])
    assert q8["blk.0.ffn_gate_tid2eid.weight"].dtype == "I32" and q8["blk.1.attn_output_a.weight"].dtype == "Q8_0"


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_verify_passes_the_conversions(tiny, converted, qtype):
    assert_verify_passes(tiny, RULES, FAMILY, converted[qtype], qtype)


def test_verify_localises_swapped_gate_and_up_in_one_layer(tiny, converted, tmp_path):
    """Layer 1's experts with gate and up exchanged (w1 and w3 mixed up): verify fails there, in both phases, at
    the MoE block."""
    assert_swap_localised(tiny, RULES, FAMILY, converted["F32"], tmp_path, 1, "mlp")


def test_check_rules_clean_on_the_shipped_port(tiny, converted):
    from click.testing import CliRunner

    from ktconvert.cli import cli

    rules = str(RULES)
    for args in ([rules], [rules, "--model", str(tiny)], [rules, "--model", str(tiny), "--weights", str(converted["Q8_0"])]):
        res = CliRunner().invoke(cli, ["check-rules", "--strict", *args])
        assert res.exit_code == 0 and "0 error(s), 0 warning(s)" in res.output, res.output


def test_kt_amx_is_refused_the_amx_kernel_does_not_clamp(tiny, tmp_path):
    """kt-kernel 0.7.2's AMXINT8/AMXINT4 compute silu(gate) * up (swiglu_limit reaches only FP8, MXFP4, MXFP8 and
    LLAMAFILE): a kt-amx directory would serve DeepSeek-V4 unclamped experts, so none is written."""
    from ktconvert.convert import convert
    from ktconvert.errors import UsageProblem

    with pytest.raises(UsageProblem, match="silu_clamped") as exc:
        convert(tiny, tmp_path / "amx", format="kt-amx", type="AMXINT8")
    assert "LLAMAFILE" in exc.value.fix
    assert not (tmp_path / "amx").exists()


def test_reference_clamps_routed_and_shared_experts():
    from ktconvert.model import build_model

    model = build_model(tiny_config(FAMILY), device="meta")
    block = model.model.layers[1].mlp
    assert block.shared_experts.clamp == (None, 10.0) and block.experts[0].clamp == (None, 10.0)


# --- the MXFP4 release, the only form llama.cpp's converter takes ------------------------------------------------------


@pytest.mark.interop
def test_mxfp4_release_converts_as_llama_cpps_own_converter_does(llama_built, tmp_path):
    """``tiny-model --quant mxfp4`` (MXFP4 experts, FP8/UE8M0 rest, native names): llama.cpp's converter takes it; its
    MXFP4 expert stacks dequantize (ggml's reference) bit for bit to our F32 GGUF's, and llama.cpp runs both GGUFs
    alike (its conversion stores the FP8 matrices as Q8_0: measured NMSE 7.4e-5, top-1 100%)."""
    import os

    import ggml_ref
    import llamacpp_convert
    import llamacpp_runner
    from gguf import GGUFReader

    from ktconvert.convert import convert
    from ktconvert.formats import open_checkpoint
    from ktconvert.model.tiny import write_tiny_model

    release = tmp_path / "release"
    write_tiny_model(FAMILY, release, quant="mxfp4")
    try:
        ref = ggml_ref.load()
        theirs = llamacpp_convert.convert(release, tmp_path / "llama.gguf")
    except ggml_ref.RefUnavailable as exc:
        if os.environ.get("CI"):
            pytest.fail(f"llama.cpp's converter and ggml's reference required under CI: {exc}")
        pytest.skip(str(exc))
    ours_path = convert(release, tmp_path / "ours", type="F32").out / "model.gguf"
    ours = open_checkpoint(ours_path)
    seen = 0
    for t in GGUFReader(theirs).tensors:
        if t.tensor_type.name != "MXFP4":
            continue
        x = ref.dequantize(np.asarray(t.data).reshape(-1), int(t.tensor_type)).reshape(ours[t.name].shape)
        assert np.array_equal(x.view(np.uint32), ours.read_float32(t.name).view(np.uint32)), t.name
        seen += 1
    assert seen == 9  # gate, up, down of three layers
    ids = [int(i) for i in np.asarray(read_golden(golden_root() / FAMILY).input_ids).reshape(-1)]
    a, _ = llamacpp_runner.run(ours_path, ids, tmp_path)
    b, _ = llamacpp_runner.run(theirs, ids, tmp_path)
    assert float(((a - b) ** 2).mean() / (b ** 2).mean()) <= 1e-3
    assert (a.argmax(-1) == b.argmax(-1)).mean() >= 0.9


# --- the release's YaRN on the compressed layers ------------------------------------------------------------------


@pytest.fixture(scope="module")
def yarn(tiny, tmp_path_factory):
    """The tiny model with the release's kind of rope_scaling (YaRN, here factor 4 over 64 positions): transformers
    and llama.cpp apply it to the compressed layers (and their compressors and indexer) only, without YaRN's
    attention factor."""
    import json

    d = tmp_path_factory.mktemp("deepseek_v4_yarn") / "m"
    shutil.copytree(tiny, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_scaling"] = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32,
                           "beta_slow": 1}
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    return d


def _hf_logits(model_dir, ids):
    transformers = transformers_523()
    m = transformers.AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, attn_implementation="eager", experts_implementation="eager").eval()
    with torch.no_grad():
        return m(input_ids=ids, use_cache=False).logits


def test_yarn_compressed_rope_matches_transformers(yarn, tiny):
    ids = _ids(120)
    want = _hf_logits(yarn, ids)
    assert (want - _hf_logits(tiny, ids)).abs().max().item() > 0.1  # the scaling matters
    with torch.no_grad():
        got = from_pretrained(yarn)(ids).logits
    assert_close(got, want, "logits")
    from ktconvert.families.config import load_config

    c = load_config(yarn)
    assert c.rope.kind == "default" and c.attention.compressed.compress_rope.kind == "yarn"
    assert c.attention.compressed.compress_rope.attention_factor == 1.0


@pytest.mark.interop
def test_llamacpp_runs_the_yarn_gguf_as_transformers(llama_built, yarn, tmp_path):
    """Our GGUF's rope.scaling.* keys (from the release's rope_scaling) make llama.cpp scale the compressed layers as
    transformers does: measured NMSE 5.7e-8 over 120 tokens."""
    import llamacpp_runner

    from ktconvert.convert import convert

    ids = _ids(120)
    want = _hf_logits(yarn, ids)[0].numpy()
    gguf = convert(yarn, tmp_path / "q", type="F32").out / "model.gguf"
    got, _ = llamacpp_runner.run(gguf, [int(i) for i in ids[0]], tmp_path)
    assert float(((got - want) ** 2).mean() / (want ** 2).mean()) <= 1e-4


def test_preflight_accepts_the_mxfp4_release_in_native_names(tiny, tmp_path):
    """kt-kernel's MXFP4 method reads DeepSeek-V4's native ``layers.L.ffn.experts.E.w1.weight`` / ``.scale``: preflight
    finds every MoE layer's experts there and accepts the release; the float tiny model is refused (PF164)."""
    from click.testing import CliRunner

    from ktconvert.cli import cli
    from ktconvert.model.tiny import write_tiny_model

    rel = tmp_path / "mxfp4"
    write_tiny_model(FAMILY, rel, quant="mxfp4")

    def flags(model):
        return ["preflight", "--model-path", str(model), "--kt-weight-path", str(model), "--kt-cpuinfer", "2",
                "--kt-threadpool-count", "1", "--kt-num-gpu-experts", "0", "--kt-method", "MXFP4"]

    ok = CliRunner().invoke(cli, flags(rel))
    assert ok.exit_code == 0, ok.output
    wrong = CliRunner().invoke(cli, flags(tiny))
    assert wrong.exit_code == 1 and "PF164" in wrong.output and "PF163" not in wrong.output, wrong.output


@pytest.mark.interop
def test_q8_0_is_byte_identical_to_llamacpps_quantizer(llama_built, converted, tiny, tmp_path):
    """Our Q8_0 is llama-quantize's Q8_0 of our F32 GGUF, tensor for tensor (the hyper-connection matrices and the
    compressors' ape quantized as llama.cpp does; tid2eid stays I32, norms and routers F32)."""
    assert_q8_0_matches_llama_quantize(tiny, converted["F32"], tmp_path)
