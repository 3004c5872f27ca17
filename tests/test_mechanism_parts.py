"""Each mechanism parses its own part of config.json and bounds its own counts (``ktconvert/arch/<name>.py``):
``normalize_config`` runs the registered mechanisms' parse steps in their order and ``ktconvert/families/limits.py``
gathers their count bounds, so neither names a mechanism (docs/developing/adding-a-mechanism.md)."""

from __future__ import annotations

import pytest

from ktconvert import arch
from ktconvert.errors import InputError
from ktconvert.families import limits, normalize_config
from ktconvert.model.tiny import tiny_config

#: the order the parts are parsed in, so the order their refusals come in (as before the steps were the mechanisms'
#: own): DSA's shared layers after Kimi Delta Attention's layer kinds they read
PARSE_ORDER = [("mla", "parse"), ("gated_deltanet", "parse"), ("kda", "parse"), ("mla", "parse_shared"),
               ("hyper_connections", "parse"), ("gqa", "parse_msa"), ("compressed_mqa", "parse"),
               ("hash_routing", "parse")]


def test_the_parse_steps_run_in_their_order():
    steps = arch.parse_steps()
    assert [(s.parse.__module__.rsplit(".", 1)[1], s.parse.__name__) for s in steps] == PARSE_ORDER
    assert [s.order for s in steps] == sorted({s.order for s in steps})


_LAYER_TYPES = ["linear_attention", "sliding_attention", "indexed_attention", "linear_attention"]
_INDEXER_TYPES = ["full", "full", "sometimes", "full"]


@pytest.mark.parametrize("family, change, drop, where", [
    # MLA's part before Kimi Delta Attention's, KDA's before DSA's shared layers, those before the residual streams
    ("glm5_next", {"layer_types": _LAYER_TYPES}, ("kv_lora_rank",), "kv_lora_rank"),
    ("glm5_next", {"layer_types": _LAYER_TYPES, "indexer_types": _INDEXER_TYPES}, (), "layer_types"),
    ("glm5_next", {"indexer_types": _INDEXER_TYPES, "hc_eps": 0.0}, (), "indexer_types"),
    # DeepSeek-V4: hyper-connections, then compressed MQA, then hash routing
    ("deepseek_v4", {"hc_eps": 0.0, "compress_ratios": [0, 4, 64]}, (), "hc_eps"),
    ("deepseek_v4", {"compress_ratios": [0, 4, 64], "mlp_layer_types": ["moe", "hash_moe", "moe"]}, (),
     "compress_ratios"),
])
def test_two_bad_parts_refuse_the_first_parsed(family, change, drop, where):
    raw = {k: v for k, v in {**tiny_config(family), **change}.items() if k not in drop}
    with pytest.raises(InputError) as err:
        normalize_config(raw, path="config.json")
    assert err.value.where == where and str(err.value).startswith(f"config.json:{where}: ")


def test_the_count_limits_are_the_cores_and_each_mechanisms():
    mechanisms = arch.count_limits()
    assert limits.FIELD_LIMITS == {**limits.CORE_LIMITS, **mechanisms}
    assert not set(limits.CORE_LIMITS) & set(mechanisms)
    assert mechanisms["kv_lora_rank"] == arch.mechanism("mla").count_limits["kv_lora_rank"]
    assert {"linear_num_key_heads", "o_groups", "hc_mult", "num_hash_layers", "n_group", "index_topk"} <= set(mechanisms)


@pytest.mark.parametrize("field, value, message", [
    ("kv_lora_rank", 0, "kv_lora_rank=0 must be at least 1"),
    ("hc_mult", 65, "hc_mult=65 must be at most 64 (far beyond any released model"),
    ("linear_conv_kernel_dim", 1 << 20, "linear_conv_kernel_dim=1048576 must be at most 1024"),
])
def test_a_mechanisms_count_is_refused_by_the_one_validator(field, value, message):
    with pytest.raises(InputError) as err:
        limits.check_counts({field: value}, "config.json")
    assert err.value.where == field and message in str(err.value)


def test_a_shared_dsa_layer_is_linked_to_the_previous_layers_attention():
    """``MLAttention.link`` (called by ``DecoderModel``): GLM-5-Next's shared layer 2 reads layer 1's selection,
    held as a plain attribute, so that it stays a module of its own layer only."""
    from ktconvert.model.reference import build_skeleton

    model = build_skeleton(tiny_config("glm5_next"))
    layers = model.model.layers
    sources = {i: layer.mixer.selection_source for i, layer in enumerate(layers)
               if hasattr(layer.mixer, "selection_source")}  # the MLA layers (the others run Kimi Delta Attention)
    assert sources.keys() >= {1, 2} and all(sources[i] is None for i in sources if i != 2)
    assert layers[2].mixer.selection_source is layers[1].mixer and layers[2].mixer.indexer is None
    assert "selection_source" not in dict(layers[2].mixer.named_children())


def test_hash_routings_table_is_filled_by_its_mechanism():
    from ktconvert.arch import hash_routing

    assert arch.role_fills() == {"tid2eid": hash_routing.fill_tid2eid}
