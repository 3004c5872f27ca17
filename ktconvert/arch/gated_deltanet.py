"""Gated DeltaNet linear attention (the ``linear_attention`` layers of spec ``attention.kind:
gated_deltanet_hybrid``: Qwen3-Next, Qwen3.5), held as ``linear_attn``; its input projections split or grouped per
key head (``attention.linear_packing``). Torch: ``model/linear_attention.py`` ``GatedDeltaNet``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ktconvert.arch.base import Add, AttentionMechanism, layer_prefix

if TYPE_CHECKING:  # arch sits below families (docs/developing/layout.md): the type only, no import
    from ktconvert.families.config import MoeConfig


class GatedDeltaNet(AttentionMechanism):
    name = "gated_deltanet"
    attr = "linear_attn"
    recurrent = True

    def layer_tensors(self, cfg: MoeConfig, layer: int, add: Add, *, experts: bool = True) -> None:
        d, la, h = cfg.linear, f"{layer_prefix(layer)}.linear_attn", cfg.hidden_size
        conv = 2 * d.num_key_heads * d.key_head_dim + d.num_value_heads * d.value_head_dim
        value = d.num_value_heads * d.value_head_dim
        if cfg.spec.linear_packing == "grouped":  # per key head [q, k, v, z] rows and [b, a] rows
            add(f"{la}.in_proj_qkvz.weight", (conv + value, h), "linear")
            add(f"{la}.in_proj_ba.weight", (2 * d.num_value_heads, h), "linear")
        else:
            add(f"{la}.in_proj_qkv.weight", (conv, h), "linear")
            add(f"{la}.in_proj_z.weight", (value, h), "linear")
            add(f"{la}.in_proj_b.weight", (d.num_value_heads, h), "linear")
            add(f"{la}.in_proj_a.weight", (d.num_value_heads, h), "linear")
        add(f"{la}.conv1d.weight", (conv, 1, d.conv_kernel), "conv")
        add(f"{la}.dt_bias", (d.num_value_heads,), "dt_bias")
        add(f"{la}.A_log", (d.num_value_heads,), "a_log")
        add(f"{la}.norm.weight", (d.value_head_dim,), "norm")
        add(f"{la}.out_proj.weight", (h, d.num_value_heads * d.value_head_dim), "out_linear")

    def layer_modules(self, node, cfg: MoeConfig) -> None:
        pre = cfg.spec.prefix
        lin = node.add("linear_attn", f"{pre}GatedDeltaNet")
        for name in cfg.spec.linear_projections:
            lin.add(name, "Linear")
        lin.add("conv1d", "Conv1d")
        lin.add("norm", f"{pre}RMSNormGated")
        lin.add("out_proj", "Linear")

    gguf_keys = {
        # what llama.cpp's Qwen3-Next / Qwen3.5 converters write
        "ssm_conv_kernel": lambda w, c, n: w.add_ssm_conv_kernel(c.linear.conv_kernel),
        "ssm_state_size": lambda w, c, n: w.add_ssm_state_size(c.linear.key_head_dim),
        "ssm_group_count": lambda w, c, n: w.add_ssm_group_count(c.linear.num_key_heads),
        "ssm_time_step_rank": lambda w, c, n: w.add_ssm_time_step_rank(c.linear.num_value_heads),
        "ssm_inner_size": lambda w, c, n: w.add_ssm_inner_size(c.linear.value_head_dim * c.linear.num_value_heads),
        "recurrent_layers": lambda w, c, n: w.add_array(f"{w.arch}.attention.recurrent_layers",
                                                        [t == "linear_attention" for t in c.layer_types]),
        "full_attention_interval": lambda w, c, n: w.add_full_attention_interval(c.linear.full_attention_interval),
    }


MECHANISM = GatedDeltaNet()
