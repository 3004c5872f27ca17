"""gpt-oss, the maths the other families lack, against transformers' own modules; and its conversion end to end.

* reference blocks vs transformers 5.23 at float32: attention with sinks and a sliding window (GptOssAttention,
  eager), the clamped SwiGLU experts with inputs well past the clamp limit (GptOssExperts), top-k-then-softmax
  routing with a router bias (GptOssTopKRouter);
* ``quantize`` de-interleaves the fused gate/up experts and their biases exactly (F32 GGUF = the checkpoint);
* ``inspect`` is clean, ``verify`` passes the F32 and Q8_0 conversions and names the layer and module of a
  broken one; ``check-rules`` is clean on the shipped port ``rules/optimize/gpt_oss.yaml`` (model and probe tree).

llama.cpp's agreement is in ``tests/test_interop_llamacpp.py`` (F32 and Q8_0 cases of gpt_oss).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from family_checks import assert_swap_localised, assert_verify_passes
from transformers_helpers import modeling_523
from ktconvert.io.resources import rules_dir
from ktconvert.model import from_pretrained, load_config
from ktconvert.model.modules import GatedMLP, attend, topk_softmax
from ktconvert.model.tiny import tiny_config
from numeric import assert_close

FAMILY = "gpt_oss"


def _transformers():
    return modeling_523("gpt_oss")


def _hf_config(**over):
    transformers, _ = _transformers()
    cfg = transformers.GptOssConfig(**{**tiny_config(FAMILY), **over})
    cfg._attn_implementation = "eager"
    return cfg


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tiny_root):
    return tiny_root / FAMILY


@pytest.fixture(scope="module")
def converted(tiny, tmp_path_factory):
    from ktconvert.convert import convert

    root = tmp_path_factory.mktemp("gpt_oss_q")
    return {t: convert(tiny, root / t, type=t).out / "model.gguf" for t in ("F32", "Q8_0")}


# --- reference blocks against transformers' own modules ---------------------------------------------------------


@pytest.mark.parametrize("layer", [0, 1], ids=["sliding", "full"])
def test_attention_with_sinks_and_window_matches_transformers(layer):
    _, m = _transformers()
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    cfg = _hf_config()
    torch.manual_seed(0)
    hf = m.GptOssAttention(cfg, layer).eval()
    for p in hf.parameters():
        torch.nn.init.normal_(p, std=0.2)
    with torch.no_grad():
        hf.sinks.copy_(torch.tensor([3.0, -2.0, 0.5, 8.0]))  # one head mostly attends to its sink
    x = torch.randn(1, 12, cfg.hidden_size)
    pos = torch.arange(12)[None]
    rope = m.GptOssRotaryEmbedding(cfg)
    make = create_sliding_window_causal_mask if cfg.layer_types[layer] == "sliding_attention" else create_causal_mask
    mask = make(config=cfg, inputs_embeds=x, attention_mask=None, past_key_values=None, position_ids=pos)
    with torch.no_grad():
        want = hf(x, rope(x, pos), mask)[0]
        from ktconvert.model.modules import Attention

        ours = Attention(load_config(tiny_config(FAMILY)), layer).eval()
        ours.load_state_dict(hf.state_dict(), strict=True)
        got = ours(x, pos)
    assert ours.window == (cfg.sliding_window if layer == 0 else None)
    assert_close(got, want, "attention")
    # the sinks and the window both matter here: without either the output moves far past the tolerance
    with torch.no_grad():
        q = torch.randn(1, 4, 12, 64)
        k = torch.randn(1, 2, 12, 64)
        v = torch.randn(1, 2, 12, 64)
        base = attend(q, k, v, 0.125, window=4, sinks=hf.sinks)
        assert (attend(q, k, v, 0.125, window=4) - base).abs().max() > 1e-2
        assert (attend(q, k, v, 0.125, sinks=hf.sinks) - base).abs().max() > 1e-2


def test_clamped_swiglu_experts_match_transformers():
    _, m = _transformers()
    cfg = _hf_config()
    torch.manual_seed(1)
    hf = m.GptOssExperts(cfg).eval()
    for p in hf.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(20, cfg.hidden_size)
    ids = torch.stack([torch.randperm(8)[:2] for _ in range(20)])
    weights = torch.softmax(torch.randn(20, 2), dim=-1)
    lim, alpha = cfg.swiglu_limit, cfg.swiglu_alpha
    with torch.no_grad():
        want = hf(x, ids, weights)
        i = cfg.intermediate_size
        got = torch.zeros_like(x)
        clamped = 0
        for e in range(8):
            mlp = GatedMLP(cfg.hidden_size, i, bias=True, clamp=(alpha, lim))
            mlp.gate_proj.weight.copy_(hf.gate_up_proj[e][:, ::2].T)
            mlp.up_proj.weight.copy_(hf.gate_up_proj[e][:, 1::2].T)
            mlp.gate_proj.bias.copy_(hf.gate_up_proj_bias[e][::2])
            mlp.up_proj.bias.copy_(hf.gate_up_proj_bias[e][1::2])
            mlp.down_proj.weight.copy_(hf.down_proj[e].T)
            mlp.down_proj.bias.copy_(hf.down_proj_bias[e])
            tok, k = torch.where(ids == e)
            got.index_add_(0, tok, mlp(x[tok]) * weights[tok, k, None])
            clamped += int((mlp.gate_proj(x[tok]) > lim).sum() + (mlp.up_proj(x[tok]).abs() > lim).sum())
    assert clamped > 100  # the clamp is exercised, not just present
    assert_close(got, want, "experts")


def test_topk_then_softmax_routing_matches_transformers():
    _, m = _transformers()
    cfg = _hf_config()
    torch.manual_seed(2)
    hf = m.GptOssTopKRouter(cfg)
    torch.nn.init.normal_(hf.weight)
    torch.nn.init.normal_(hf.bias)
    x = torch.randn(16, cfg.hidden_size)
    with torch.no_grad():
        logits, scores, idx = hf(x)
        ids, w = topk_softmax(logits, cfg.num_experts_per_tok)
    # a fixed bound is right: both sides run the same softmax on the same 2 floats in this process; weights are <= 1,
    # so 1e-7 is one float32 ulp at their scale
    assert torch.equal(ids, idx) and float((w - scores).abs().max()) <= 1e-7


# --- conversion, inspect, verify, check-rules ----------------------------------------------------------------------


def test_f32_gguf_holds_the_checkpoint_de_interleaved(tiny, converted):
    from ktconvert.formats import open_checkpoint

    ck = open_checkpoint(converted["F32"])
    model = from_pretrained(tiny)
    experts = model.model.layers[1].mlp.experts
    gate = np.asarray(ck.read("blk.1.ffn_gate_exps.weight")).reshape(8, 256, 256)
    up_b = np.asarray(ck.read("blk.1.ffn_up_exps.bias")).reshape(8, 256)
    down_b = np.asarray(ck.read("blk.1.ffn_down_exps.bias")).reshape(8, 256)
    for e in (0, 5):
        assert np.array_equal(gate[e], experts[e].gate_proj.weight.detach().numpy())
        assert np.array_equal(up_b[e], experts[e].up_proj.bias.detach().numpy())
        assert np.array_equal(down_b[e], experts[e].down_proj.bias.detach().numpy())
    sinks = np.asarray(ck.read("blk.0.attn_sinks.weight")).reshape(-1)
    assert np.array_equal(sinks, model.model.layers[0].self_attn.sinks.detach().numpy())
    assert ck.metadata["gpt-oss.attention.sliding_window"] == 4
    assert [bool(v) for v in ck.metadata["gpt-oss.attention.sliding_window_pattern"].values] == [True, False]


def test_inspect_is_clean(tiny, converted):
    from ktconvert.formats import detect_layout, open_checkpoint

    for src in (tiny, converted["Q8_0"]):
        report = detect_layout(open_checkpoint(src), None)
        assert report.arch == "gpt-oss" and not report.all_problems and not report.unknown, src


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_verify_passes_the_conversions(tiny, converted, qtype):
    assert_verify_passes(tiny, rules_dir() / "optimize" / "gpt_oss.yaml", FAMILY, converted[qtype], qtype)


def test_verify_localises_swapped_gate_and_up_in_one_layer(tiny, converted, tmp_path):
    """Layer 1's experts with gate and up exchanged (a de-interleaving bug): verify fails there, in both phases, at
    the MoE block."""
    assert_swap_localised(tiny, rules_dir() / "optimize" / "gpt_oss.yaml", FAMILY, converted["F32"], tmp_path, 1, "mlp")


def test_check_rules_clean_on_the_shipped_port(tiny):
    from click.testing import CliRunner

    from ktconvert.cli import cli
    from ktconvert.rules import modeltree

    rules = str(rules_dir() / "optimize" / "gpt_oss.yaml")
    for args in ([rules], [rules, "--model", str(tiny)]):
        res = CliRunner().invoke(cli, ["check-rules", *args])
        assert res.exit_code == 0 and "0 error(s), 0 warning(s)" in res.output, res.output
    tree = modeltree.probe_tree(FAMILY)
    types = {n.path: n.type for n in tree.nodes}
    assert tree.num_layers == 24 and types["model.layers.23.mlp.router"] == "GptOssTopKRouter"
    assert types["model.layers.0.mlp"] == "GptOssMLP" and types["model.layers.0.mlp.experts.1"] == "Module"
