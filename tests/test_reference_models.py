"""Reference models: match the committed transformers goldens at float32 (prefill and token-by-token
decode), read both config spellings and both expert layouts, and expose the module tree rules match."""

from __future__ import annotations

import copy
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from ktconvert.errors import InputError
from ktconvert.golden import golden_root, read_golden
from ktconvert.model import hfnames
from ktconvert.model import FAMILIES, build_model, from_pretrained, load_config, load_weights, module_class_paths, normalize_config
from ktconvert.model.tiny import tiny_config, tiny_tensors, write_tiny_model
from numeric import assert_close

PREFILL = 8  # decode test: prefill this many prompt tokens, then one token at a time


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _max_diff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))))


# --- numerics against the goldens ---------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_matches_the_golden(family, tiny_root):
    golden = read_golden(golden_root() / family)
    model = from_pretrained(tiny_root / family)
    with torch.no_grad():
        out = model(torch.from_numpy(golden.input_ids))
    assert_close(out.logits, golden.logits, "logits")
    hidden = torch.stack(out.hidden_states)
    assert hidden.shape == golden.hidden_states.shape
    for layer in range(hidden.shape[0]):
        assert_close(hidden[layer], golden.hidden_states[layer], f"hidden state {layer}")
    assert_close(out.final_hidden, golden.final_hidden, "final hidden")


@pytest.mark.parametrize("family", FAMILIES)
def test_token_by_token_decode_matches_the_golden(family, tiny_root):
    golden = read_golden(golden_root() / family)
    ids = torch.from_numpy(golden.input_ids)
    model = from_pretrained(tiny_root / family)
    cache = model.new_cache()
    logits, hidden = [], []
    with torch.no_grad():
        out = model(ids[:, :PREFILL], cache)
        logits.append(out.logits)
        hidden.append(torch.stack(out.hidden_states))
        for t in range(PREFILL, ids.shape[1]):
            out = model(ids[:, t : t + 1], cache)
            logits.append(out.logits)
            hidden.append(torch.stack(out.hidden_states))
    assert cache.seq_len == ids.shape[1]
    assert_close(torch.cat(logits, dim=1), golden.logits, "decode logits")
    for layer, (have, want) in enumerate(zip(torch.cat(hidden, dim=2), golden.hidden_states)):
        assert_close(have, want, f"decode hidden state {layer}")
    # the cache is what makes decode agree: without it, one token alone sees no context
    with torch.no_grad():
        alone = model(ids[:, -1:]).logits
    assert _max_diff(alone, golden.logits[:, -1:]) > 1e-3


def test_runs_without_transformers(tiny_root):
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "import torch\n"
        "from ktconvert.model import from_pretrained\n"
        f"m = from_pretrained({str(tiny_root / 'deepseek_v3')!r})\n"
        "print(tuple(m(torch.tensor([[1, 2, 3]])).logits.shape))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "(1, 3, 512)"


def test_importing_the_package_does_not_import_torch():
    code = "import sys, ktconvert.model, ktconvert.families.config, ktconvert.model.hfnames, ktconvert.golden; print('torch' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "False"


# --- both config spellings ----------------------------------------------------------------------


def _hub_spelling(family: str) -> dict:
    """The tiny config as the authors' remote-code configs on the hub spell it."""
    raw = tiny_config(family)
    text = raw.get("text_config", raw)  # a multimodal wrapper nests the text model's keys
    if "rope_parameters" not in text and "rope_theta" in text:  # already the release spelling (DeepSeek-V4)
        raw["torch_dtype"] = raw.pop("dtype")
        return raw
    rope = text.pop("rope_parameters", None)  # None: no rope at all (GLM-5-Next's NoPE attention)
    if rope is not None:
        text["rope_theta"] = rope.pop("rope_theta")
        kind = rope.pop("rope_type")
        if kind != "default":
            rope.setdefault("type", kind)  # the hub's legacy key (Kimi K2.5's text_config has only rope_type in tf5)
    raw.pop("dtype")
    raw["torch_dtype"] = "float32"
    if rope:
        text["rope_scaling"] = rope  # keeps the legacy "type": "yarn" (and Qwen3.5's partial_rotary_factor)
    if family == "qwen3_moe":
        raw["num_experts"] = raw.pop("num_local_experts")
        raw["rope_scaling"] = None
    if family == "qwen2_moe":
        del raw["qkv_bias"], raw["layer_types"]  # the hub config predates both; qkv bias is implied
    if family.startswith("deepseek"):
        del raw["head_dim"], raw["qk_head_dim"]
        raw["moe_layer_freq"] = 1
    if family == "deepseek_v2":
        raw["scoring_func"] = "softmax"
    if family == "deepseek_v3":
        del raw["rope_interleave"]  # transformers-5 only; the hub's V3 always interleaves
        raw.update(scoring_func="sigmoid", topk_method="noaux_tc")
    return raw


@pytest.mark.parametrize("family", FAMILIES)
def test_hub_and_transformers5_spellings_normalise_alike(family, tiny_root):
    hub = normalize_config(_hub_spelling(family))
    tf5 = load_config(tiny_root / family)
    assert hub == tf5  # every field but the raw dict
    model = build_model(hub)
    load_weights(model, tiny_root / family)
    golden = read_golden(golden_root() / family)
    with torch.no_grad():
        assert_close(model(torch.from_numpy(golden.input_ids)).logits, golden.logits, "logits")


def test_real_hub_config_builds_on_meta():
    # DeepSeek-V2-Lite's published config.json (abridged to the fields that matter)
    lite = {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 102400,
        "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
        "num_attention_heads": 16, "num_key_value_heads": 16, "n_shared_experts": 2, "n_routed_experts": 64,
        "routed_scaling_factor": 1.0, "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
        "num_experts_per_tok": 6, "moe_layer_freq": 1, "first_k_dense_replace": 1, "norm_topk_prob": False,
        "scoring_func": "softmax", "aux_loss_alpha": 0.001, "seq_aux": True, "hidden_act": "silu",
        "max_position_embeddings": 163840, "rms_norm_eps": 1e-06, "rope_theta": 10000, "tie_word_embeddings": False,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                         "original_max_position_embeddings": 4096, "type": "yarn"},
    }
    model = build_model(lite, device="meta")
    names = dict(model.named_modules())
    assert "model.layers.0.mlp.gate_proj" in names and "model.layers.0.mlp.experts" not in names
    assert "model.layers.26.mlp.experts.63.down_proj" in names
    assert "model.layers.5.self_attn.q_proj" in names and "model.layers.5.self_attn.q_a_proj" not in names
    assert names["model.layers.3.mlp.gate"].top_k == 6


def test_config_errors_name_the_field():
    raw = tiny_config("deepseek_v3")
    raw["topk_method"] = "top1"
    with pytest.raises(InputError, match="topk_method") as exc:
        normalize_config(raw)
    assert exc.value.where == "topk_method"
    with pytest.raises(InputError, match="supported families"):
        normalize_config({"model_type": "llama"})
    raw = tiny_config("mixtral")
    raw["sliding_window"] = 16
    with pytest.raises(InputError, match="sliding-window"):
        normalize_config(raw)
    raw = tiny_config("qwen3_moe")
    del raw["moe_intermediate_size"]
    with pytest.raises(InputError, match="moe_intermediate_size"):
        normalize_config(raw)


# --- expert layouts and strict loading ----------------------------------------------------------


def _fused(family: str, transposed: bool = False, tf5_names: bool = False) -> dict[str, torch.Tensor]:
    cfg = normalize_config(tiny_config(family))
    g, u, d = cfg.expert_proj_names
    src = {k: torch.from_numpy(v) for k, v in tiny_tensors(family).items()}
    out = {k: v for k, v in src.items() if ".experts." not in k}
    for layer in cfg.mlp.moe_layers:
        p = f"model.layers.{layer}.{cfg.moe_block_name}.experts"
        gate_up = torch.stack([torch.cat([src[f"{p}.{e}.{g}.weight"], src[f"{p}.{e}.{u}.weight"]]) for e in range(cfg.num_experts)])
        down = torch.stack([src[f"{p}.{e}.{d}.weight"] for e in range(cfg.num_experts)])
        if transposed:
            gate_up, down = gate_up.transpose(1, 2).contiguous(), down.transpose(1, 2).contiguous()
        name = p.replace(".block_sparse_moe.", ".mlp.") if tf5_names else p
        out[f"{name}.gate_up_proj"], out[f"{name}.down_proj"] = gate_up, down
    return out


@pytest.mark.parametrize("family,transposed,tf5_names", [
    ("qwen3_moe", False, False), ("deepseek_v3", True, False), ("mixtral", False, True), ("qwen2_moe", True, False),
])
def test_fused_experts_load_like_per_expert(family, transposed, tf5_names):
    golden = read_golden(golden_root() / family)
    model = build_model(tiny_config(family))
    report = load_weights(model, _fused(family, transposed, tf5_names))
    assert set(report.fused_layout.values()) == {"transposed" if transposed else "standard"}
    with torch.no_grad():
        assert_close(model(torch.from_numpy(golden.input_ids)).logits, golden.logits, "logits")


def test_fused_experts_with_wrong_dims_are_refused():
    tensors = _fused("qwen3_moe")
    key = "model.layers.1.mlp.experts.down_proj"
    tensors[key] = tensors[key][:, :, :128]
    with pytest.raises(InputError, match="fit neither"):
        load_weights(build_model(tiny_config("qwen3_moe")), tensors)


def test_strict_loading_names_the_offending_tensor():
    base = {k: torch.from_numpy(v) for k, v in tiny_tensors("qwen2_moe").items()}
    missing = dict(base)
    del missing["model.layers.1.mlp.experts.5.up_proj.weight"]
    with pytest.raises(InputError, match="experts.5.up_proj"):
        load_weights(build_model(tiny_config("qwen2_moe")), missing)
    extra = dict(base, **{"model.layers.0.self_attn.q_proj.weight_scale_inv": torch.ones(1)})
    with pytest.raises(InputError, match="weight_scale_inv"):
        load_weights(build_model(tiny_config("qwen2_moe")), extra)
    wrong = dict(base)
    wrong["model.layers.0.mlp.gate.weight"] = wrong["model.layers.0.mlp.gate.weight"].t()
    with pytest.raises(InputError, match="does not match") as exc:
        load_weights(build_model(tiny_config("qwen2_moe")), wrong)
    assert exc.value.where == "model.layers.0.mlp.gate.weight"


def test_mtp_layers_and_rotary_tables_are_skipped():
    tensors = {k: torch.from_numpy(v) for k, v in tiny_tensors("deepseek_v3").items()}
    tensors["model.layers.3.mlp.gate.weight"] = torch.zeros(8, 256)  # a multi-token-prediction layer
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(8)
    report = load_weights(build_model(tiny_config("deepseek_v3")), tensors)
    assert set(report.skipped) == {"model.layers.3.mlp.gate.weight", "model.layers.0.self_attn.rotary_emb.inv_freq"}


def test_missing_checkpoint_is_an_input_error(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(InputError, match="supported families"):
        from_pretrained(tmp_path)
    write_tiny_model("mixtral", tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").unlink()
    with pytest.raises(InputError, match=r"no \.safetensors, \.gguf"):
        from_pretrained(tmp_path / "m")


# --- module tree and classes, as upstream rules see them ----------------------------------------

TREE = {
    "qwen2_moe": ["model.layers.1.mlp.gate", "model.layers.1.mlp.experts.7.down_proj", "model.layers.0.mlp.shared_expert.up_proj",
                  "model.layers.0.mlp.shared_expert_gate", "model.layers.0.self_attn.rotary_emb"],
    "qwen3_moe": ["model.layers.0.self_attn.q_norm", "model.layers.1.mlp.experts.0.gate_proj", "model.norm"],
    "mixtral": ["model.layers.0.block_sparse_moe.gate", "model.layers.1.block_sparse_moe.experts.3.w1",
                "model.layers.1.block_sparse_moe.experts.3.w2", "model.layers.1.block_sparse_moe.experts.3.w3"],
    "deepseek_v2": ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.shared_experts.gate_proj",
                    "model.layers.2.self_attn.q_proj", "model.layers.2.self_attn.kv_a_proj_with_mqa", "model.layers.2.self_attn.kv_b_proj"],
    "deepseek_v3": ["model.layers.1.mlp.gate", "model.layers.2.self_attn.q_a_proj", "model.layers.2.self_attn.q_a_layernorm",
                    "model.layers.2.self_attn.q_b_proj", "model.layers.1.self_attn.kv_a_layernorm", "lm_head", "model.embed_tokens"],
    "glm4_moe": ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.gate", "model.layers.2.mlp.shared_experts.up_proj",
                 "model.layers.1.self_attn.q_norm", "model.layers.2.mlp.experts.7.down_proj"],
    "minimax_m2": ["model.layers.0.block_sparse_moe.gate", "model.layers.1.block_sparse_moe.experts.3.w1",
                   "model.layers.0.self_attn.k_norm"],
    "gpt_oss": ["model.layers.0.mlp.router", "model.layers.1.mlp.experts.7.down_proj", "model.layers.0.self_attn.o_proj"],
    "qwen3_5_moe": ["model.layers.0.linear_attn.in_proj_qkv", "model.layers.0.linear_attn.conv1d", "model.layers.0.linear_attn.norm",
                    "model.layers.0.linear_attn.out_proj", "model.layers.1.self_attn.q_norm", "model.layers.1.self_attn.rotary_emb",
                    "model.layers.0.mlp.shared_expert_gate", "model.layers.1.mlp.experts.7.down_proj"],
    "glm_moe_dsa": ["model.layers.0.mlp.down_proj", "model.layers.1.self_attn.indexer.wq_b", "model.layers.2.self_attn.indexer.k_norm",
                    "model.layers.1.mlp.gate", "model.layers.2.mlp.shared_experts.up_proj"],
    "qwen3_vl_moe": ["model.layers.0.self_attn.q_norm", "model.layers.1.mlp.experts.7.gate_proj", "model.layers.1.mlp.gate",
                     "model.norm", "lm_head"],
    "kimi_k25": ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.gate", "model.layers.2.self_attn.q_a_layernorm",
                 "model.layers.1.mlp.shared_experts.up_proj", "model.embed_tokens", "lm_head"],
    "deepseek_v32": ["model.layers.0.mlp.down_proj", "model.layers.1.self_attn.indexer.wq_b", "model.layers.2.self_attn.indexer.k_norm",
                     "model.layers.1.mlp.gate", "model.layers.2.self_attn.q_a_layernorm"],
    "qwen3_next": ["model.layers.0.linear_attn.in_proj_qkvz", "model.layers.0.linear_attn.in_proj_ba",
                   "model.layers.0.linear_attn.conv1d", "model.layers.0.linear_attn.norm", "model.layers.0.linear_attn.out_proj",
                   "model.layers.1.self_attn.k_norm", "model.layers.1.self_attn.rotary_emb", "model.layers.1.mlp.shared_expert_gate",
                   "model.layers.1.mlp.shared_expert.down_proj", "model.layers.0.mlp.experts.7.up_proj"],
    "minimax_m3_vl": ["model.layers.0.block_sparse_moe.gate", "model.layers.1.block_sparse_moe.experts.3.w1",
                      "model.layers.0.block_sparse_moe.shared_experts.up_proj", "model.layers.1.self_attn.index_q_proj",
                      "model.layers.0.self_attn.index_k_norm", "model.layers.0.self_attn.k_norm"],
    "glm5_next": ["model.layers.0.self_attn.q_conv1d", "model.layers.0.self_attn.f_b_proj", "model.layers.0.self_attn.o_norm",
                  "model.layers.0.mlp.down_proj", "model.layers.1.self_attn.indexer.wq_b", "model.layers.1.self_attn.kv_b_proj",
                  "model.layers.2.self_attn.q_a_layernorm", "model.layers.1.mlp.gate", "model.layers.3.mlp.shared_experts.up_proj"],
    "deepseek_v4": ["model.layers.0.attn_hc", "model.layers.1.ffn_hc", "model.hc_head", "model.layers.0.self_attn.o_a_proj",
                    "model.layers.1.self_attn.compressor.indexer.scorer.weights_proj", "model.layers.2.self_attn.compressor.kv_norm",
                    "model.layers.0.mlp.gate", "model.layers.2.mlp.experts.7.w3", "model.layers.2.mlp.shared_experts.down_proj"],
}


@pytest.mark.parametrize("family", FAMILIES)
def test_module_names_are_the_hf_ones(family):
    names = dict(build_model(tiny_config(family), device="meta").named_modules())
    for name in TREE[family]:
        assert name in names, name


def _matches(model, name_re: str | None = None, cls: str | None = None) -> list[str]:
    """Upstream's matching: re.search on the dotted path, isinstance on the class (both when both given)."""
    return [
        n for n, m in model.named_modules()
        if (name_re is None or re.search(name_re, n)) and (cls is None or cls in module_class_paths(m))
    ]


def test_upstream_rule_patterns_select_the_same_modules():
    v3 = build_model(tiny_config("deepseek_v3"), device="meta")
    assert _matches(v3, r"^model\.layers\..*\.mlp\.experts$") == ["model.layers.1.mlp.experts", "model.layers.2.mlp.experts"]
    assert _matches(v3, r"^model\.layers\..*\.mlp$", "ktransformers.models.modeling_deepseek_v3.DeepseekV3MoE") == [
        "model.layers.1.mlp", "model.layers.2.mlp"]
    assert _matches(v3, cls="ktransformers.models.modeling_deepseek_v3.MoEGate") == ["model.layers.1.mlp.gate", "model.layers.2.mlp.gate"]
    rope = _matches(v3, r"^model\.layers\.(0|1)\.", "ktransformers.models.modeling_deepseek_v3.DeepseekV3RotaryEmbedding")
    assert rope == ["model.layers.0.self_attn.rotary_emb", "model.layers.1.self_attn.rotary_emb"]
    linears = _matches(v3, r"^model\.layers\.(?!.*self_attn\.kv_b_proj).*$", "torch.nn.Linear")
    assert "model.layers.1.self_attn.kv_b_proj" not in linears and "model.layers.1.mlp.experts.0.up_proj" in linears
    assert "model.layers.1.mlp.gate" not in linears  # MoEGate is no Linear upstream either
    dense = _matches(v3, r"^model\.layers\.0\.mlp$", "ktransformers.models.modeling_deepseek_v3.DeepseekV3MLP")
    assert dense == ["model.layers.0.mlp"]
    q3 = build_model(tiny_config("qwen3_moe"), device="meta")
    assert _matches(q3, r"^model\.layers\..*\.mlp$", "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock") == [
        "model.layers.0.mlp", "model.layers.1.mlp"]
    assert "model.layers.0.mlp.gate" in _matches(q3, r"^model\.layers\.", "torch.nn.Linear")  # a Linear upstream too
    mix = build_model(tiny_config("mixtral"), device="meta")
    assert _matches(mix, r"^model\.layers\..*\.block_sparse_moe$", "ktransformers.models.modeling_mixtral.MixtralSparseMoeBlock") == [
        "model.layers.0.block_sparse_moe", "model.layers.1.block_sparse_moe"]


def test_every_reference_module_declares_its_classes():
    for family in FAMILIES:
        model = build_model(tiny_config(family), device="meta")
        no_kt = hfnames.classes_module(family) is None
        for name, mod in model.named_modules():
            if no_kt and re.search(r"\.experts\.\d+$", name):
                # transformers 5 fuses routed experts and ktransformers has no modeling file: no class upstream
                assert mod.hf_class is None and not mod.hf_class_paths, f"{family}: {name} claims {mod.hf_class}"
                continue
            if type(mod).__module__.startswith("ktconvert."):
                assert mod.hf_class and mod.hf_class_paths, f"{family}: {name or '<root>'} has no HF class"
        assert model.model.layers[1].feed_forward.experts.hf_class.endswith("Experts")
        assert "torch.nn.ModuleList" in module_class_paths(model.model.layers[1].feed_forward.experts)


def test_experts_are_swappable_through_their_contract():
    """An operator with the experts' contract (hidden, topk_ids, topk_weights) can replace them."""
    golden = read_golden(golden_root() / "qwen3_moe")
    model = build_model(tiny_config("qwen3_moe"))
    load_weights(model, {k: torch.from_numpy(v) for k, v in tiny_tensors("qwen3_moe").items()})
    block = model.model.layers[1].mlp
    original = block.experts
    calls = []

    class Recording(torch.nn.Module):
        def forward(self, hidden, topk_ids, topk_weights):
            calls.append(tuple(topk_ids.shape))
            return original(hidden, topk_ids, topk_weights)

    block.experts = Recording()
    with torch.no_grad():
        logits = model(torch.from_numpy(golden.input_ids)).logits
    assert calls == [(31, 2)]
    assert_close(logits, golden.logits, "logits")
    broken = copy.deepcopy(original)
    broken[0], broken[1] = broken[1], broken[0]  # the expert-order misreading
    block.experts = broken
    with torch.no_grad():
        assert _max_diff(model(torch.from_numpy(golden.input_ids)).logits, golden.logits) > 1e-2


def test_impossible_expert_ids_are_an_error():
    model = build_model(tiny_config("mixtral"), device="meta")
    experts = model.model.layers[0].block_sparse_moe.experts
    with pytest.raises(ValueError, match="outside 0..7"):
        experts(torch.zeros(2, 256), torch.tensor([[0, 8], [1, 2]]), torch.ones(2, 2))
