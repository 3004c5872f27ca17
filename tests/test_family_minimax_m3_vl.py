"""MiniMax-M3 (minimax_m3_vl), the maths and spellings the other families lack, against transformers' own modules; and
its conversion end to end.

* reference blocks vs transformers 5.23 at float32: MiniMax Sparse Attention (MiniMaxM3VLAttention with its
  lightning indexer, eager, prefill and a cached decode step) on a prompt long enough that the block selection
  drops blocks; the swigluoai experts with inputs past the clamp limit (MiniMaxM3VLExperts);
* the block selection decides the golden; config quirks: the hub's ``sparse_attention_config`` and transformers'
  ``index_*`` read alike, ``rotary_dim`` is ignored as transformers ignores it but kept in the GGUF, unsupported
  layouts are one error naming the key;
* leading dense layers (the ``dense`` variant: ``moe_layer_freq`` 0 for layer 0, transformers'
  ``mlp_layer_types`` dense): the config reads alike in both spellings, the dense MLP (split gate/up as released,
  transformers fuses them) and the model match transformers, the GGUF is what llama.cpp's converter writes and
  llama.cpp runs it, the MXFP8 release inspects, converts and passes verify; inconsistent dense configs are one line;
* ``quantize`` writes what llama.cpp's minimax-m3 reads (sparse-attention keys, rotary_dim, 1 + w norms baked, the
  indexer projections F32 as llama-quantize keeps them); ``inspect`` is clean, ``verify`` passes the F32 and Q8_0
  conversions and names the layer and module of a broken one; ``check-rules`` is clean on the shipped port.

llama.cpp's agreement is in ``tests/test_interop_llamacpp.py`` (F32 and Q8_0, flash attention on); here: with
flash attention off llama.cpp attends densely and misses the golden, and our Q8_0 is llama-quantize's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from family_checks import assert_swap_localised, assert_verify_passes
from convert_helpers import assert_q8_0_matches_llama_quantize
from transformers_helpers import modeling_523
from ktconvert.errors import InputError
from ktconvert.families import normalize_config
from ktconvert.golden import golden_root, read_golden
from ktconvert.io.resources import rules_dir
from ktconvert.model import from_pretrained
from ktconvert.model.modules import GatedMLP
from ktconvert.model.tiny import tiny_config
from numeric import assert_close

FAMILY = "minimax_m3_vl"
RULES = rules_dir() / "optimize" / f"{FAMILY}.yaml"


def _transformers():
    return modeling_523("minimax_m3_vl")


def _hf_text_config():
    transformers, _ = _transformers()
    cfg = transformers.AutoConfig.for_model(**tiny_config(FAMILY)).text_config
    cfg._attn_implementation = "eager"
    return cfg


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tiny_root):
    return tiny_root / FAMILY


@pytest.fixture(scope="module")
def converted(tiny, tmp_path_factory):
    from ktconvert.convert import convert

    root = tmp_path_factory.mktemp("minimax_m3_q")
    return {t: convert(tiny, root / t, type=t).out / "model.gguf" for t in ("F32", "Q8_0")}


# --- reference blocks against transformers' own modules ---------------------------------------------------------


def test_sparse_attention_matches_transformers_and_drops_blocks(tiny):
    """Layer 0's attention of the tiny model on 40 random positions (5 blocks of 8, 2 kept per query and KV group):
    prefill and one cached decode step equal transformers' eager MiniMaxM3VLAttention + MiniMaxM3VLIndexer."""
    _, hf = _transformers()
    from transformers.cache_utils import DynamicCache

    cfg = _hf_text_config()
    ours = from_pretrained(tiny).model.layers[0].self_attn
    theirs = hf.MiniMaxM3VLAttention(cfg, 0).eval()
    prefix = "model.layers.0.self_attn."
    state = {k[len(prefix):]: v for k, v in from_pretrained(tiny).state_dict().items() if k.startswith(prefix)}
    state = {k.replace("index_", "indexer.") if k.startswith("index_") else k: v for k, v in state.items()}
    missing, unexpected = theirs.load_state_dict(state, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    rope = hf.MiniMaxM3VLRotaryEmbedding(cfg)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 41, cfg.hidden_size, generator=g)
    pos = torch.arange(41)[None]
    mask = torch.full((41, 41), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        cos, sin = rope(x, pos)
        want, _ = theirs(x[:, :40], (cos[:, :40], sin[:, :40]), mask[..., :40, :40], position_ids=pos[:, :40])
        cache = DynamicCache(config=cfg)
        theirs(x[:, :40], (cos[:, :40], sin[:, :40]), mask[..., :40, :40], past_key_values=cache, position_ids=pos[:, :40])
        want_step, _ = theirs(x[:, 40:], (cos[:, 40:], sin[:, 40:]), None, past_key_values=cache, position_ids=pos[:, 40:])
        got = ours(x[:, :40], pos[:, :40])
        from ktconvert.model.modules import KVCache

        kv = KVCache()
        ours(x[:, :40], pos[:, :40], kv)
        got_step = ours(x[:, 40:], pos[:, 40:], kv)
        ours.msa = False  # every visible key instead: the selection must matter here
        dense = ours(x[:, :40], pos[:, :40])
    assert_close(got, want, "prefill")
    assert_close(got_step, want_step, "decode step")
    assert (dense - want).abs().max() > 1e-2


def test_swigluoai_experts_match_transformers():
    """(clamp(up, +-7) + 1) * g * sigmoid(1.702 g), g = min(gate, 7), gate/up not interleaved: our per-expert
    modules against MiniMaxM3VLExperts on inputs that push many gate and up values past the limit."""
    _, hf = _transformers()
    cfg = _hf_text_config()
    theirs = hf.MiniMaxM3VLExperts(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        theirs.gate_up_proj.copy_(torch.randn(theirs.gate_up_proj.shape, generator=g) * 0.3)
        theirs.down_proj.copy_(torch.randn(theirs.down_proj.shape, generator=g) * 0.05)
    inter = cfg.intermediate_size
    ours = []
    for e in range(cfg.num_local_experts):
        m = GatedMLP(cfg.hidden_size, inter, ("w1", "w3", "w2"), clamp=(cfg.swiglu_alpha, cfg.swiglu_limit))
        with torch.no_grad():
            m.w1.weight.copy_(theirs.gate_up_proj[e, :inter])
            m.w3.weight.copy_(theirs.gate_up_proj[e, inter:])
            m.w2.weight.copy_(theirs.down_proj[e])
        ours.append(m)
    x = torch.randn(12, cfg.hidden_size, generator=g)
    ids = torch.tensor([[e % 8, (e + 3) % 8] for e in range(12)])
    w = torch.rand(12, 2, generator=g)
    with torch.no_grad():
        want = theirs(x, ids, w)
        got = torch.zeros_like(x)
        for t in range(12):
            for k in range(2):
                got[t] += ours[int(ids[t, k])](x[t:t + 1])[0] * w[t, k]
        gu = torch.einsum("th,eih->tei", x, theirs.gate_up_proj)
    assert (gu[..., :inter] > 7).sum() > 50 and (gu[..., inter:].abs() > 7).sum() > 50
    assert_close(got, want, "experts")


def test_the_block_selection_decides_the_golden(tiny):
    gold = read_golden(golden_root() / FAMILY)
    m = from_pretrained(tiny)
    ids = torch.from_numpy(gold.input_ids)
    with torch.no_grad():
        sparse = m(ids).logits.numpy()
        for layer in m.model.layers:
            layer.self_attn.msa = False
        dense = m(ids).logits.numpy()
    assert_close(sparse, gold.logits, "logits")
    assert np.abs(dense - gold.logits).max() > 0.1


# --- config spellings and refusals -------------------------------------------------------------------------------


def test_hub_and_transformers_spellings_read_alike():
    hub = tiny_config(FAMILY)
    text = dict(hub["text_config"])
    sac = text.pop("sparse_attention_config")
    text.pop("moe_layer_freq")
    text.update(index_n_heads=sac["sparse_num_index_heads"], index_head_dim=sac["sparse_index_dim"],
                index_block_size=sac["sparse_block_size"], index_topk_blocks=sac["sparse_topk_blocks"],
                index_local_blocks=sac["sparse_local_block"], layer_types=["minimax_m3_sparse"] * 2,
                mlp_layer_types=["sparse", "sparse"], hidden_act="silu")
    a, b = normalize_config(hub), normalize_config({**hub, "text_config": text})
    assert a == b
    assert a.attention.indexer.sparse_layers == (0, 1) and (a.attention.indexer.block_size, a.attention.indexer.topk, a.attention.indexer.local_blocks) == (8, 2, 1)
    assert a.mlp.shared_experts_width == 256 and a.mlp.n_shared_experts == 1 and a.routing.routed_scaling_factor == 2.0
    assert a.activation.clamp == (1.702, 7.0)


def test_rotary_dim_is_ignored_as_transformers_ignores_it():
    """transformers 5.23 rotates what rope_parameters.partial_rotary_factor says, else the whole head; rotary_dim
    alone changes nothing (llama.cpp honours it: the GGUF carries it, see below)."""
    raw = tiny_config(FAMILY)
    raw["text_config"]["rope_parameters"].pop("partial_rotary_factor")
    assert normalize_config(raw).rope.dim == 64  # the whole head, although rotary_dim says 32
    transformers, _ = _transformers()
    cfg = transformers.AutoConfig.for_model(**raw).text_config
    assert cfg.rotary_dim == 32 and "partial_rotary_factor" not in cfg.rope_parameters


@pytest.mark.parametrize("change,where", [
    ({"moe_layer_freq": [1, 0]}, "mlp_layer_types"),  # a dense layer after an MoE one (see the dense section)
    ({"sparse_attention_config": {"sparse_num_index_heads": 4, "sparse_index_dim": 64, "sparse_block_size": 8,
                                  "sparse_topk_blocks": 2, "sparse_local_block": 1}}, "index_n_heads"),
    ({"sparse_attention_config": {"sparse_num_index_heads": 2, "sparse_index_dim": 16, "sparse_block_size": 8,
                                  "sparse_topk_blocks": 2, "sparse_local_block": 1}}, "index_head_dim"),
    ({"sparse_attention_config": {"sparse_num_index_heads": 2, "sparse_index_dim": 64, "sparse_block_size": 0,
                                  "sparse_topk_blocks": 2, "sparse_local_block": 1}}, "index_block_size"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_unsupported_config_is_one_error_naming_the_key(change, where):
    raw = tiny_config(FAMILY)
    raw["text_config"].update(change)
    with pytest.raises(InputError) as exc:
        normalize_config(raw, path="config.json")
    assert exc.value.where == where and "config.json" in str(exc.value)


# --- conversion, inspect, verify, check-rules ----------------------------------------------------------------------


def test_gguf_keeps_what_llamacpp_reads(tiny, converted):
    from ktconvert.formats import open_checkpoint

    ck = open_checkpoint(converted["F32"])
    md = ck.metadata
    assert md["general.architecture"] == "minimax-m3"
    assert md["minimax-m3.rope.dimension_count"] == 32  # rotary_dim
    assert [md[f"minimax-m3.attention.indexer.{k}"] for k in ("head_count", "key_length", "top_k", "block_size",
                                                                "local_blocks")] == [2, 64, 2, 8, 1]
    assert md["minimax-m3.expert_shared_count"] == 1 and md["minimax-m3.expert_weights_scale"] == 2.0
    assert md["minimax-m3.expert_weights_norm"] is True and md["minimax-m3.leading_dense_block_count"] == 0
    assert md["minimax-m3.expert_feed_forward_length"] == 256 and md["minimax-m3.expert_gating_func"] == 2  # sigmoid
    model = from_pretrained(tiny)
    attn = model.model.layers[1].self_attn
    for gname, norm in (("blk.1.indexer.q_norm.weight", attn.index_q_norm), ("blk.1.attn_k_norm.weight", attn.k_norm)):
        assert np.array_equal(np.asarray(ck.read(gname)).reshape(-1), 1.0 + norm.weight.detach().numpy())
    q8 = open_checkpoint(converted["Q8_0"])
    types = {n: q8[n].dtype for n in q8}
    assert types["blk.0.indexer.q_proj.weight"] == types["blk.0.indexer.k_proj.weight"] == "F32"
    assert types["blk.0.ffn_gate_shexp.weight"] == types["blk.0.ffn_down_exps.weight"] == "Q8_0"


def test_inspect_is_clean(tiny, converted):
    from ktconvert.formats import detect_layout, open_checkpoint

    for src in (tiny, converted["Q8_0"]):
        report = detect_layout(open_checkpoint(src), None)
        assert report.arch == "minimax-m3" and not report.all_problems and not report.unknown, src


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_verify_passes_the_conversions(tiny, converted, qtype):
    assert_verify_passes(tiny, RULES, FAMILY, converted[qtype], qtype)


def test_verify_localises_swapped_gate_and_up_in_one_layer(tiny, converted, tmp_path):
    """Layer 1's experts with gate and up exchanged (w1 and w3 mixed up): verify fails there, in both phases, at
    the MoE block."""
    assert_swap_localised(tiny, RULES, FAMILY, converted["F32"], tmp_path, 1, "block_sparse_moe")


def test_check_rules_clean_on_the_shipped_port(tiny, converted):
    from click.testing import CliRunner

    from ktconvert.cli import cli
    from ktconvert.rules import modeltree

    rules = str(RULES)
    for args in ([rules], [rules, "--model", str(tiny)], [rules, "--model", str(tiny), "--weights", str(converted["Q8_0"])]):
        res = CliRunner().invoke(cli, ["check-rules", *args])
        assert res.exit_code == 0 and "0 error(s), 0 warning(s)" in res.output, res.output
    tree = modeltree.probe_tree(FAMILY)
    types = {n.path: n.type for n in tree.nodes}
    assert tree.num_layers == 60 and types["model.layers.59.block_sparse_moe.gate"] == "MiniMaxM3VLTopKRouter"
    assert types["model.layers.0.self_attn.index_q_proj"] == "Linear"
    assert types["model.layers.0.block_sparse_moe.shared_experts"] == "MiniMaxM3VLMLP"


# --- llama.cpp -----------------------------------------------------------------------------------------------------


@pytest.mark.interop
def test_llamacpp_attends_densely_without_flash_attention(llama_built, converted, tmp_path):
    """llama.cpp 0.3.36 runs MiniMax-M3's sparse attention only with flash attention on: off, it warns and attends to
    every key, which is not the model (the interop test turns it on and agrees with the golden)."""
    import llamacpp_runner

    gold = read_golden(golden_root() / FAMILY)
    ids = [int(i) for i in np.asarray(gold.input_ids).reshape(-1)]
    want = np.asarray(gold.logits, dtype=np.float32).reshape(len(ids), -1)
    nmse = {}
    for fa in (True, False):
        got, _ = llamacpp_runner.run(converted["F32"], ids, tmp_path, flash_attn=fa)
        nmse[fa] = float(((got - want) ** 2).sum() / (want ** 2).sum())
    assert nmse[True] <= 1e-4 and nmse[False] > 1e-2, nmse


@pytest.mark.interop
def test_q8_0_is_llamacpps_quantizer(llama_built, tiny, converted, tmp_path):
    assert_q8_0_matches_llama_quantize(tiny, converted["F32"], tmp_path)


# --- the MXFP8 release ---------------------------------------------------------------------------------------------


def test_tiny_mxfp8_release_reads_and_converts_exactly(tmp_path):
    """``tiny-model minimax_m3_vl --quant mxfp8``: the released names (language_model.model.layers.L.block_sparse_moe
    .experts.E.w1.weight F8_E4M3 + weight_scale_inv UE8M0 per 32 columns); inspect names MXFP8, preflight accepts it
    for kt-kernel's MXFP8 method (and sends FP8 there), and the F32 GGUF holds the exact decoding."""
    from click.testing import CliRunner

    from ktconvert.cli import cli
    from ktconvert.convert import convert
    from ktconvert.formats import detect_layout, open_checkpoint, quantized
    from ktconvert.model.tiny import write_tiny_model

    rel = tmp_path / "mxfp8"
    write_tiny_model(FAMILY, rel, quant="mxfp8")
    ck = open_checkpoint(rel)
    w = "language_model.model.layers.1.block_sparse_moe.experts.3.w1.weight"
    assert ck[w].dtype == "F8_E4M3" and ck[w + "_scale_inv"].shape == (256, 8)
    report = detect_layout(ck, None)
    assert report.arch == "minimax-m3" and not report.all_problems and not report.unknown
    qmap = quantized.analyze(ck)
    assert qmap.weights[w].fmt == "MXFP8"
    flags = ["--model-path", str(rel), "--kt-weight-path", str(rel), "--kt-cpuinfer", "2", "--kt-threadpool-count", "1",
             "--kt-num-gpu-experts", "0"]
    ok = CliRunner().invoke(cli, ["preflight", *flags, "--kt-method", "MXFP8"])
    assert ok.exit_code == 0, ok.output
    wrong = CliRunner().invoke(cli, ["preflight", *flags, "--kt-method", "FP8"])
    assert wrong.exit_code == 1 and "PF162" in wrong.output and "MXFP8" in wrong.output
    gguf = convert(rel, tmp_path / "f32", type="F32").out / "model.gguf"
    got = np.asarray(open_checkpoint(gguf).read("blk.1.ffn_gate_exps.weight")).reshape(8, 256, 256)[3]
    np.testing.assert_array_equal(got, quantized.read_float32(ck, qmap.weights[w]))


def test_kt_amx_is_refused_the_amx_kernel_has_no_swigluoai(tiny, tmp_path):
    """kt-kernel 0.7.2's AMXINT8/AMXINT4 compute silu(gate) * up (swiglu_limit / alpha reach only FP8, MXFP4, MXFP8
    and LLAMAFILE): a kt-amx directory would serve MiniMax-M3 the wrong activation, so none is written."""
    from ktconvert.convert import convert
    from ktconvert.errors import UsageProblem

    with pytest.raises(UsageProblem, match="silu") as exc:
        convert(tiny, tmp_path / "amx", format="kt-amx", type="AMXINT8")
    assert "LLAMAFILE" in exc.value.fix
    assert not (tmp_path / "amx").exists()


# --- leading dense layers (the dense variant) ----------------------------------------------------------------------

DENSE = "dense"


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """The dense variant (layer 0 a dense MLP of dense_intermediate_size 576, full attention), float32 as every tiny
    model, and its MXFP8 release (``tiny-model --variant dense --quant mxfp8``)."""
    from ktconvert.model.tiny import write_tiny_model

    root = tmp_path_factory.mktemp("minimax_m3_dense")
    write_tiny_model(FAMILY, root / "model", variant=DENSE)
    write_tiny_model(FAMILY, root / "mxfp8", variant=DENSE, quant="mxfp8")
    return root


@pytest.fixture(scope="module")
def dense_golden():
    """transformers 5.23's golden of the dense variant (``golden/minimax_m3_vl-dense``, the family golden's prompt)."""
    return golden_root() / f"{FAMILY}-{DENSE}"


def test_tiny_model_writes_the_dense_release(dense, tmp_path):
    """``tiny-model minimax_m3_vl --variant dense --quant mxfp8`` writes the fixture's bytes (a variant now takes a
    release format; --fp8 still does not combine with one: exit 2, nothing written)."""
    import hashlib

    from click.testing import CliRunner

    from ktconvert.cli import cli

    out = tmp_path / "rel"
    res = CliRunner().invoke(cli, ["tiny-model", FAMILY, str(out), "--variant", DENSE, "--quant", "mxfp8"])
    assert res.exit_code == 0 and "mxfp8 (dense)" in res.output, res.output
    for f in ("config.json", "model.safetensors"):
        assert hashlib.sha256((out / f).read_bytes()).digest() == hashlib.sha256((dense / "mxfp8" / f).read_bytes()).digest()
    bad = CliRunner().invoke(cli, ["tiny-model", FAMILY, str(tmp_path / "no"), "--variant", DENSE, "--fp8"])
    assert bad.exit_code == 2 and "--fp8 and --variant do not combine" in bad.output and not (tmp_path / "no").exists()


def test_dense_layers_read_alike_in_both_spellings():
    """The hub's moe_layer_freq [0, 1] and transformers' mlp_layer_types [dense, sparse] name the same layers;
    transformers reads the variant's config to the same dense layer and width."""
    hub = tiny_config(FAMILY, DENSE)
    text = dict(hub["text_config"])
    text.pop("moe_layer_freq")
    text.update(mlp_layer_types=["dense", "sparse"])
    a, b = normalize_config(hub), normalize_config({**hub, "text_config": text})
    assert a == b
    assert a.mlp.moe_layers == (1,) and a.attention.indexer.sparse_layers == (1,) and a.mlp.intermediate_size == 576 and a.mlp.moe_intermediate_size == 256
    assert a.activation.dense and a.activation.clamp == (1.702, 7.0)
    assert (a.ffn_name(0), a.ffn_name(1)) == ("mlp", "block_sparse_moe")
    transformers, _ = _transformers()
    cfg = transformers.AutoConfig.for_model(**hub).text_config
    assert cfg.mlp_layer_types == ["dense", "sparse"] and cfg.dense_intermediate_size == 576
    assert cfg.layer_types == ["full_attention", "minimax_m3_sparse"]


def test_dense_mlp_matches_transformers_past_the_clamp():
    """Our dense MLP (gate_proj / up_proj / down_proj as released, the experts' swigluoai) against
    MiniMaxM3VLDenseMLP, whose gate_up_proj is the two concatenated (transformers' conversion mapping), on inputs
    that push gate and up past the limit."""
    _, hf = _transformers()
    cfg = _transformers()[0].AutoConfig.for_model(**tiny_config(FAMILY, DENSE)).text_config
    theirs = hf.MiniMaxM3VLDenseMLP(cfg, intermediate_size=cfg.dense_intermediate_size)
    inter = cfg.dense_intermediate_size
    g = torch.Generator().manual_seed(1)
    ours = GatedMLP(cfg.hidden_size, inter, clamp=(cfg.swiglu_alpha, cfg.swiglu_limit))
    with torch.no_grad():
        for m in (ours.gate_proj, ours.up_proj):
            m.weight.copy_(torch.randn(m.weight.shape, generator=g) * 0.3)
        ours.down_proj.weight.copy_(torch.randn(ours.down_proj.weight.shape, generator=g) * 0.05)
        theirs.gate_up_proj.weight.copy_(torch.cat([ours.gate_proj.weight, ours.up_proj.weight]))
        theirs.down_proj.weight.copy_(ours.down_proj.weight)
        x = torch.randn(12, cfg.hidden_size, generator=g)
        gu = theirs.gate_up_proj(x)
        want, got = theirs(x), ours(x)
    assert (gu[:, :inter] > 7).sum() > 50 and (gu[:, inter:].abs() > 7).sum() > 50
    assert_close(got, want, "dense MLP")


def test_dense_model_matches_transformers(dense, dense_golden):
    """The reference model of the dense variant against transformers 5.23's logits (the golden tolerance)."""
    gold = read_golden(dense_golden)
    assert gold.manifest["model"]["tiny_model"] == f"{FAMILY}-{DENSE}"
    m = from_pretrained(dense / "model")
    assert type(m.model.layers[0].mlp) is GatedMLP and not hasattr(m.model.layers[0], "block_sparse_moe")
    with torch.no_grad():
        got = m(torch.from_numpy(gold.input_ids)).logits
    assert_close(got, gold.logits, "logits")


def test_dense_release_inspects_and_converts(dense, tmp_path):
    """The MXFP8 release with dense layer 0: inspect names the dense layer (no missing-experts error), quantize
    writes llama.cpp's leading dense block (ffn_gate / ffn_up / ffn_down of dense_intermediate_size, no indexer
    there) with the experts' exact decoding, and preflight accepts it for kt-kernel's MXFP8."""
    from click.testing import CliRunner

    from ktconvert.cli import cli
    from ktconvert.formats import open_checkpoint, quantized

    rel = dense / "mxfp8"
    res = CliRunner().invoke(cli, ["inspect", str(rel)])
    assert res.exit_code == 0, res.output
    assert "experts in 1 (hf-split); dense layer 0" in res.output and "makes it an MoE layer" not in res.output
    assert "0 error(s), 0 warning(s)" in res.output
    res = CliRunner().invoke(cli, ["quantize", str(rel), str(tmp_path / "f32"), "--type", "F32"])
    assert res.exit_code == 0, res.output
    again = CliRunner().invoke(cli, ["inspect", str(tmp_path / "f32" / "model.gguf")])  # from leading_dense_block_count
    assert again.exit_code == 0 and "experts in 1 (gguf-merged); dense layer 0" in again.output, again.output
    ck = open_checkpoint(tmp_path / "f32" / "model.gguf")
    md = ck.metadata
    assert md["minimax-m3.leading_dense_block_count"] == 1 and md["minimax-m3.feed_forward_length"] == 576
    assert md["minimax-m3.expert_feed_forward_length"] == 256
    assert sorted(n[len("blk.0."):] for n in ck if n.startswith("blk.0.ffn")) == [
        "ffn_down.weight", "ffn_gate.weight", "ffn_norm.weight", "ffn_up.weight"]
    assert ck["blk.0.ffn_gate.weight"].shape == ck["blk.0.ffn_up.weight"].shape
    assert not [n for n in ck if n.startswith("blk.0.indexer")] and "blk.1.indexer.q_proj.weight" in ck
    src = open_checkpoint(rel)
    qmap = quantized.analyze(src)
    w = "language_model.model.layers.1.block_sparse_moe.experts.5.w3.weight"
    got = np.asarray(ck.read("blk.1.ffn_up_exps.weight")).reshape(8, 256, 256)[5]
    np.testing.assert_array_equal(got, quantized.read_float32(src, qmap.weights[w]))
    np.testing.assert_array_equal(np.asarray(ck.read("blk.0.ffn_down.weight")).reshape(256, 576),
                                  np.asarray(src.read("language_model.model.layers.0.mlp.down_proj.weight")))
    flags = ["--model-path", str(rel), "--kt-weight-path", str(rel), "--kt-cpuinfer", "2", "--kt-threadpool-count", "1",
             "--kt-num-gpu-experts", "0", "--kt-method", "MXFP8"]
    ok = CliRunner().invoke(cli, ["preflight", *flags])
    assert ok.exit_code == 0, ok.output


def test_dense_bf16_release_matches_transformers(dense, tmp_path):
    """The MXFP8 release written back as a BF16 one (``quantize --to hf --type BF16``: the experts decoded to BF16,
    exactly, the rest as stored) still names its dense layer in inspect, and the reference's logits on it equal
    transformers 5.23's on the same files (the golden tolerance)."""
    from click.testing import CliRunner

    from ktconvert.cli import cli
    from ktconvert.golden.generate import compute_golden

    _transformers()
    rel = tmp_path / "bf16"
    res = CliRunner().invoke(cli, ["quantize", str(dense / "mxfp8"), str(rel), "--to", "hf", "--type", "BF16"])
    assert res.exit_code == 0, res.output
    shown = CliRunner().invoke(cli, ["inspect", str(rel)])
    assert shown.exit_code == 0 and "; dense layer 0" in shown.output and "BF16              24 tensor(s)" in shown.output
    ids = [int(i) for i in np.asarray(read_golden(golden_root() / f"{FAMILY}-{DENSE}").input_ids).reshape(-1)]
    want = compute_golden(rel, ids, decode_check=False).tensors["logits"]
    with torch.no_grad():
        got = from_pretrained(rel)(torch.tensor([ids])).logits
    assert_close(got, want, "logits")


def test_dense_release_kt_amx_is_refused(dense, tmp_path):
    """kt-amx stays refused for this family (the AMX kernels compute silu(gate) * up, not swigluoai), dense layers or
    not: exit 2, nothing written."""
    from click.testing import CliRunner

    from ktconvert.cli import cli

    res = CliRunner().invoke(cli, ["quantize", str(dense / "mxfp8"), str(tmp_path / "amx"), "--to", "kt-amx",
                                   "--type", "AMXINT8"])
    assert res.exit_code == 2 and "silu(gate) * up" in res.output, res.output
    assert not (tmp_path / "amx").exists() and not list(tmp_path.glob(".amx*"))


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_dense_verify_passes(dense, dense_golden, tmp_path, qtype):
    from ktconvert.convert import convert
    from ktconvert.verify import run_verify

    gguf = convert(dense / "model", tmp_path / "q", type=qtype).out / "model.gguf"
    report = run_verify(dense / "model", RULES, dense_golden, weights=gguf)
    assert report.profile.name == qtype.lower() and report.passed, [b.line() for b in report.breaches]


def _dense_bad(tmp_path, dense, **text):
    import json
    import shutil

    d = tmp_path / "bad"
    shutil.copytree(dense / "model", d)
    cfg = json.loads((d / "config.json").read_text())
    for k, v in text.items():
        if v is None:
            cfg["text_config"].pop(k)
        else:
            cfg["text_config"][k] = v
    (d / "config.json").write_text(json.dumps(cfg))
    return d


_SAC = {"sparse_block_size": 8, "sparse_index_dim": 64, "sparse_local_block": 1, "sparse_num_index_heads": 2,
        "sparse_topk_blocks": 2}

DENSE_REFUSALS = {
    "freq-length": ({"moe_layer_freq": [0, 1, 1]}, "moe_layer_freq", "num_hidden_layers=2", "one entry per layer"),
    "types-length": ({"mlp_layer_types": ["dense"], "moe_layer_freq": None}, "mlp_layer_types", "num_hidden_layers=2",
                     "one entry per layer"),
    "types-value": ({"mlp_layer_types": ["dense", "moe"], "moe_layer_freq": None}, "mlp_layer_types",
                    "sparse / dense", "one entry per layer"),
    "disagree": ({"mlp_layer_types": ["sparse", "sparse"]}, "mlp_layer_types", "disagrees", "same dense layers"),
    "not-leading": ({"moe_layer_freq": [1, 0], "sparse_attention_config": {**_SAC, "sparse_attention_freq": [1, 0]}},
                    "mlp_layer_types", "do not lead", "first ones"),
    "sparse-attention": ({"sparse_attention_config": {**_SAC, "sparse_attention_freq": [1, 1]}}, "layer_types",
                         "MiniMax Sparse Attention", "full_attention"),
    "no-width": ({"dense_intermediate_size": None}, "dense_intermediate_size", "width is missing", "as the release"),
}


@pytest.mark.parametrize("case", sorted(DENSE_REFUSALS))
def test_inconsistent_dense_config_is_one_line(dense, tmp_path, case):
    """Each inconsistent dense layout: quantize exits 3 with one line naming config.json, the key and the fix, and
    writes nothing."""
    from click.testing import CliRunner

    from ktconvert.cli import cli

    change, key, needle, fix = DENSE_REFUSALS[case]
    bad = _dense_bad(tmp_path, dense, **change)
    out = tmp_path / "out"
    res = CliRunner().invoke(cli, ["quantize", str(bad), str(out), "--type", "F32"])
    line = res.output.strip()
    assert res.exit_code == 3, res.output
    assert "\n" not in line and f"config.json:{key}:" in line and needle in line and fix in line, line
    assert not out.exists() and not list(tmp_path.glob(".out*"))


@pytest.mark.interop
def test_dense_gguf_is_llamacpps_and_llamacpp_runs_it(llama_built, dense, dense_golden, tmp_path):
    """Against llama.cpp's own converter (conversion/minimax.py, MiniMaxM3Model: leading zeros of moe_layer_freq ->
    leading_dense_block_count, dense_intermediate_size -> feed_forward_length; read from config.json as written, since
    transformers 5.23's config drops the hub keys it needs): the same tensors, bit for bit, and the same minimax-m3
    keys but two it does not write (expert_gating_func, which llama.cpp's minimax-m3 loader requires, and
    vocab_size). llama.cpp runs our GGUF (its minimax-m3 attends fully on the leading dense layers) at the f32
    profile against transformers' logits."""
    import os

    import ggml_ref
    import llamacpp_convert
    import llamacpp_runner
    from gguf import GGUFReader

    from ktconvert.convert import convert
    from ktconvert.verify.profile import evaluate, load_profile

    ours_path = convert(dense / "model", tmp_path / "ours", type="F32").out / "model.gguf"
    try:
        theirs_path = llamacpp_convert.convert(dense / "model", tmp_path / "llama.gguf", raw_config=True)
    except ggml_ref.RefUnavailable as exc:
        if os.environ.get("CI"):
            pytest.fail(f"llama.cpp's converter required under CI: {exc}")
        pytest.skip(str(exc))
    ours, theirs = GGUFReader(ours_path), GGUFReader(theirs_path)

    def arch_kv(r):
        return {k: f.contents() for k, f in r.fields.items() if k.startswith("minimax-m3.")}

    a, b = arch_kv(ours), arch_kv(theirs)
    assert {k for k in a if k not in b} == {"minimax-m3.expert_gating_func", "minimax-m3.vocab_size"} and set(b) <= set(a)
    assert {k: a[k] for k in b} == b
    assert b["minimax-m3.leading_dense_block_count"] == 1 and b["minimax-m3.feed_forward_length"] == 576
    ot, tt = {t.name: t for t in ours.tensors}, {t.name: t for t in theirs.tensors}
    assert set(ot) == set(tt)
    for name, t in tt.items():
        assert ot[name].tensor_type == t.tensor_type and np.array_equal(np.asarray(ot[name].data), np.asarray(t.data)), name
    gold = read_golden(dense_golden)
    ids = [int(i) for i in np.asarray(gold.input_ids).reshape(-1)]
    got, _ = llamacpp_runner.run(ours_path, ids, tmp_path, flash_attn=True)
    want = np.asarray(gold.logits, dtype=np.float32).reshape(len(ids), -1)
    profile = load_profile("f32").for_family(FAMILY)
    stats = profile.compare(want, got).summary()
    assert evaluate(profile, "llama.cpp", stats, []) == [], stats
