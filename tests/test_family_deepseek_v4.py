"""DeepSeek-V4 (deepseek_v4): the maths and spellings the other families lack, against transformers 5.23's own model.

* the reference model vs transformers at float32 on the tiny model in the release's native names: the golden prompt
  (window-only, ratio-4 and ratio-128 layers, hash and score routing, hyper-connections, grouped output projection),
  a cached decode, and a prompt long enough that the ratio-128 layer closes a window;
* the hash table decides routing (a zeroed tid2eid changes the logits); both config spellings (the release's
  compress_ratios / num_hash_layers / qk_rope_head_dim and transformers' layer_types / compress_rates /
  mlp_layer_types) read alike; bad configs are one error naming the key;
* the native names round-trip through the spec's renames; ``inspect`` is clean; check-rules' probe tree has the
  release's layer layout.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from transformers_helpers import transformers_523
from ktconvert import families
from ktconvert.errors import InputError
from ktconvert.families import normalize_config
from ktconvert.golden import golden_root, read_golden
from ktconvert.model import from_pretrained
from ktconvert.model.tiny import tiny_config, tiny_tensors

FAMILY = "deepseek_v4"
TOL = 1e-5

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tiny_root):
    return tiny_root / FAMILY


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
    assert (out.logits - torch.from_numpy(g.tensors["logits"])).abs().max().item() <= TOL
    states = torch.stack(out.hidden_states)
    assert (states - torch.from_numpy(g.tensors["hidden_states"])).abs().max().item() <= TOL


@pytest.mark.parametrize("n", [31, 140])
def test_reference_matches_transformers_prefill_and_decode(ref, hf, n):
    """140 tokens close the ratio-128 layer's first window (the golden's 31 do not)."""
    ids = _ids(n)
    with torch.no_grad():
        want = hf(input_ids=ids, use_cache=False).logits
        got = ref(ids).logits
        assert (got - want).abs().max().item() <= TOL
        if n > 40:
            return
        out = hf(input_ids=ids[:, :1], use_cache=True)
        hf_steps = [out.logits]
        for t in range(1, n):  # transformers' own cached decode (its stateful compressor) against ours
            out = hf(input_ids=ids[:, t:t + 1], past_key_values=out.past_key_values, use_cache=True)
            hf_steps.append(out.logits)
        cache = ref.new_cache()
        steps = torch.cat([ref(ids[:, t:t + 1], cache).logits for t in range(n)], dim=1)
    assert (steps - torch.cat(hf_steps, dim=1)).abs().max().item() <= TOL
    assert (steps - want).abs().max().item() <= 5 * TOL  # decode vs prefill: float32 rounding only


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
    ours = GatedMLP(cfg.hidden_size, rel.moe_intermediate_size, rel.expert_proj_names, clamp=rel.swiglu_clamp)
    inter = rel.moe_intermediate_size
    with torch.no_grad():
        ours.w1.weight.copy_(experts.gate_up_proj[3, :inter])
        ours.w3.weight.copy_(experts.gate_up_proj[3, inter:])
        ours.w2.weight.copy_(experts.down_proj[3])
        assert (ours.w1(x).abs() > 10).float().mean() > 0.2  # the clamp is exercised
        want = experts(x, torch.full((16, 1), 3), torch.ones(16, 1))
        assert (ours(x) - want).abs().max().item() <= TOL * want.abs().max().item()
        sh = GatedMLP(cfg.hidden_size, rel.shared_experts_inter, clamp=rel.swiglu_clamp)
        sh.load_state_dict(shared.state_dict())
        assert (sh(x) - shared(x)).abs().max().item() <= TOL * shared(x).abs().max().item()
        plain = GatedMLP(cfg.hidden_size, rel.shared_experts_inter)  # no clamp: far from transformers
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
    for field in ("compressed", "hyper", "hash_layers", "indexer", "sliding_window", "rope", "swiglu_clamp",
                  "scoring_func", "routed_scaling_factor", "q_lora_rank", "head_dim"):
        assert getattr(rel, field) == getattr(tf, field), field
    assert rel.compressed.ratios == (0, 4, 128) and rel.hash_layers == (0,)


@pytest.mark.parametrize("change, where", [
    ({"compress_ratios": [0, 4, 64]}, "compress_ratios"),
    ({"num_key_value_heads": 2, "num_attention_heads": 4}, "num_key_value_heads"),
    ({"o_groups": 3}, "o_groups"),
    ({"sliding_window": None}, "sliding_window"),
    ({"scoring_func": "softmax"}, "topk_method"),
    ({"qk_rope_head_dim": 15}, "qk_rope_head_dim"),
    ({"num_hash_layers": -1}, "num_hash_layers"),
    ({"hc_mult": 0}, "hc_mult"),
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


def test_inspect_is_clean(tiny):
    from ktconvert.formats.inspect_report import build_inspect_report

    report = build_inspect_report(tiny)
    assert report["problems"] == [] and report["exit_code"] == 0
    assert report["architecture"]["arch"] == "deepseek4" and report["layouts"]


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
