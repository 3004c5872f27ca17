"""Kimi Delta Attention (GLM-5-Next's ``linear_attention`` layers, spec ``attention.linear_attention: kda``), held
as ``self_attn``: q / k / v with per-projection short convolutions, the low-rank forget and output gates.
Torch: ``model/linear_attention.py`` ``KimiDeltaAttention``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ktconvert.arch.base import Add, AttentionMechanism, layer_prefix, when

if TYPE_CHECKING:  # arch sits below families (docs/developing/layout.md): the type only, no import
    from ktconvert.families.config import MoeConfig


class Kda(AttentionMechanism):
    name = "kda"
    recurrent = True

    def layer_tensors(self, cfg: MoeConfig, layer: int, add: Add, *, experts: bool = True) -> None:
        d, a, h = cfg.kda, f"{layer_prefix(layer)}.self_attn", cfg.hidden_size
        dim = d.num_heads * d.head_dim
        for proj in ("q", "k", "v"):
            add(f"{a}.{proj}_proj.weight", (dim, h), "linear")
        for proj in ("q", "k", "v"):  # per projection, as released (transformers concatenates them)
            add(f"{a}.{proj}_conv1d.weight", (dim, 1, d.conv_kernel), "conv")
        add(f"{a}.f_a_proj.weight", (d.head_dim, h), "linear")
        add(f"{a}.f_b_proj.weight", (dim, d.head_dim), "linear")
        add(f"{a}.dt_bias", (dim,), "dt_bias")
        add(f"{a}.A_log", (d.num_heads,), "a_log")
        add(f"{a}.b_proj.weight", (d.num_heads, h), "linear")
        add(f"{a}.g_a_proj.weight", (d.head_dim, h), "linear")
        add(f"{a}.g_b_proj.weight", (dim, d.head_dim), "linear")
        add(f"{a}.o_norm.weight", (d.head_dim,), "norm")
        add(f"{a}.o_proj.weight", (h, dim), "out_linear")

    def layer_modules(self, node, cfg: MoeConfig) -> None:
        pre = cfg.spec.prefix
        lin = node.add("self_attn", cfg.spec.classes.linear_attention or f"{pre}GatedDeltaNet")
        for name in ("q_proj", "k_proj", "v_proj"):
            lin.add(name, "Linear")
        for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
            lin.add(name, "Conv1d")
        for name in ("f_a_proj", "f_b_proj", "b_proj", "g_a_proj", "g_b_proj"):
            lin.add(name, "Linear")
        lin.add("o_norm", f"{pre}RMSNormGated")
        lin.add("o_proj", "Linear")

    gguf_keys = {
        # head_count_kv per layer, 0 marking a recurrent layer: written in the single value's place by
        # ``ktconvert/convert/metadata.py`` (``hf_kv``), so this entry writes nothing of its own
        "recurrent_head_count_kv": lambda w, c, n: None,
        # the KDA sizes from linear_attn_config (what llama.cpp's Glm5NextModel converter writes)
        "kda": lambda w, c, n: (w.add_ssm_conv_kernel(c.kda.conv_kernel),
                                w.add_uint32(f"{w.arch}.kda.head_dim", c.kda.head_dim),
                                when(c.kda.lower_bound is not None, lambda: w.add_float32(
                                    f"{w.arch}.kda.gate_lower_bound", c.kda.lower_bound))),
    }


MECHANISM = Kda()
