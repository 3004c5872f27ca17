"""Gated DeltaNet linear attention (the ``linear_attention`` layers of spec ``attention.kind:
gated_deltanet_hybrid``: Qwen3-Next, Qwen3.5), held as ``linear_attn``; its input projections split or grouped per
key head (``attention.linear_packing``). Its part of the config is ``MoeConfig.attention.linear`` (:class:`LinearAttentionDims`)
with each layer's kind (``MoeConfig.attention.layer_types``), parsed here by :func:`parse`. Torch:
``model/linear_attention.py`` ``GatedDeltaNet``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ktconvert.arch.base import Add, AttentionMechanism, ParseContext, Parsed, ParseStep, layer_prefix
from ktconvert.errors import InputError

if TYPE_CHECKING:  # arch sits below families (docs/developing/layout.md): the type only, no import
    from ktconvert.families.config import MoeConfig


@dataclass(frozen=True)
class LinearAttentionDims:
    """Gated DeltaNet linear-attention sizes (config keys ``linear_*``)."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    # the hub's every-n-th-layer-full key, as llama.cpp's converter writes it (default 4; transformers turns it into
    # layer_types and drops it): a GGUF fact, not a size, so two spellings of one model still compare equal
    full_attention_interval: int = field(default=4, compare=False)


KINDS = ("linear_attention", "full_attention")


def parse(ctx: ParseContext) -> Parsed | None:
    """layer_types (or every ``full_attention_interval``-th layer full, transformers' default) and the Gated DeltaNet
    dims of a hybrid-attention family (spec ``attention.kind: gated_deltanet_hybrid``)."""
    if ctx.attention_spec["kind"] != "gated_deltanet_hybrid":
        return None
    g, raw, layers, path = ctx.g, ctx.raw, ctx.layers, ctx.path
    types = raw.get("layer_types")
    if types is None:
        every = int(g.opt("full_attention_interval", 4))
        types = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or any(t not in KINDS for t in types):
        raise InputError(f"layer_types must list {layers} entries, each one of {', '.join(KINDS)}",
                         path=path, where="layer_types")
    dims = LinearAttentionDims(
        num_key_heads=g.int("linear_num_key_heads"), num_value_heads=g.int("linear_num_value_heads"),
        key_head_dim=g.int("linear_key_head_dim"), value_head_dim=g.int("linear_value_head_dim"),
        conv_kernel=g.int("linear_conv_kernel_dim"), full_attention_interval=int(g.opt("full_attention_interval", 4)))
    if dims.num_value_heads % dims.num_key_heads:
        raise InputError(f"linear_num_value_heads={dims.num_value_heads} is not a multiple of "
                         f"linear_num_key_heads={dims.num_key_heads}", path=path, where="linear_num_value_heads")
    return {"attention": {"layer_types": tuple(types), "linear": dims}}


class GatedDeltaNet(AttentionMechanism):
    name = "gated_deltanet"
    attr = "linear_attn"
    recurrent = True
    parsers = (ParseStep(20, parse),)
    count_limits = {"linear_num_key_heads": (1, 4096), "linear_num_value_heads": (1, 4096),
                    "linear_key_head_dim": (1, 1 << 14), "linear_value_head_dim": (1, 1 << 14),
                    "linear_conv_kernel_dim": (1, 1024)}

    def layer_tensors(self, cfg: MoeConfig, layer: int, add: Add, *, experts: bool = True) -> None:
        d, la, h = cfg.attention.linear, f"{layer_prefix(layer)}.linear_attn", cfg.hidden_size
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
        "ssm_conv_kernel": lambda w, c, n: w.add_ssm_conv_kernel(c.attention.linear.conv_kernel),
        "ssm_state_size": lambda w, c, n: w.add_ssm_state_size(c.attention.linear.key_head_dim),
        "ssm_group_count": lambda w, c, n: w.add_ssm_group_count(c.attention.linear.num_key_heads),
        "ssm_time_step_rank": lambda w, c, n: w.add_ssm_time_step_rank(c.attention.linear.num_value_heads),
        "ssm_inner_size": lambda w, c, n: w.add_ssm_inner_size(c.attention.linear.value_head_dim * c.attention.linear.num_value_heads),
        "recurrent_layers": lambda w, c, n: w.add_array(f"{w.arch}.attention.recurrent_layers",
                                                        [t == "linear_attention" for t in c.attention.layer_types]),
        "full_attention_interval": lambda w, c, n: w.add_full_attention_interval(c.attention.linear.full_attention_interval),
    }


MECHANISM = GatedDeltaNet()
