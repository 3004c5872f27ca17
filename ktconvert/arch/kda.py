"""Kimi Delta Attention (GLM-5-Next's ``linear_attention`` layers, spec ``attention.linear_attention: kda``), held
as ``self_attn``: q / k / v with per-projection short convolutions, the low-rank forget and output gates.
Its part of the config is ``MoeConfig.attention.kda`` (:class:`KdaDims`) with each layer's kind (``MoeConfig.attention.layer_types``),
parsed here by :func:`parse`. Torch: ``model/linear_attention.py`` ``KimiDeltaAttention``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ktconvert.arch.base import Add, AttentionMechanism, ParseContext, Parsed, ParseStep, layer_prefix, when
from ktconvert.errors import InputError

if TYPE_CHECKING:  # arch sits below families (docs/developing/layout.md): the type only, no import
    from ktconvert.families.config import MoeConfig


@dataclass(frozen=True)
class KdaDims:
    """Kimi Delta Attention sizes (the release's ``linear_attn_config``, or transformers' ``linear_*`` keys)."""

    num_heads: int
    head_dim: int
    conv_kernel: int
    lower_bound: float | None  # the forget gate's safe lower bound; None: -exp(A_log) * softplus


KINDS = ("linear_attention", "indexed_attention", "full_attention")
_KEYS = {"num_heads": "linear_num_heads", "head_dim": "linear_head_dim",
         "short_conv_kernel_size": "linear_conv_kernel_dim", "gate_lower_bound": "linear_lower_bound"}


def parse(ctx: ParseContext) -> Parsed | None:
    """Kimi Delta Attention layers (``layer_types`` ``linear_attention``; the others are attention, transformers'
    ``full_attention`` read as ``indexed_attention``) and sizes, from the release's ``linear_attn_config`` or
    transformers' ``linear_*`` keys, whichever the config holds (the dict wins, as transformers reads it); where the
    spec's ``attention.linear_attention`` names it."""
    if ctx.attention_spec.get("linear_attention") != "kda":
        return None
    raw, layers, heads, path = ctx.raw, ctx.layers, ctx.heads, ctx.path
    types = raw.get("layer_types")
    if types is None:  # transformers' default: every fourth layer attention
        types = ["linear_attention" if i % 4 != 3 else "indexed_attention" for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or any(t not in KINDS for t in types):
        raise InputError(f"layer_types must list {layers} entries, each one of {', '.join(KINDS)}",
                         path=path, where="layer_types")
    hub = raw.get("linear_attn_config")
    hub = hub if isinstance(hub, dict) else {}
    vals = {}
    for key, flat in _KEYS.items():
        v = hub.get(key, raw.get(flat))
        if key == "gate_lower_bound":
            if v is None and (key not in hub and flat not in raw or hub.get("safe_gate", True)):
                v = -5.0  # transformers' default and its safe_gate rule
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise InputError(f"linear_attn_config.{key} must be a number, got {v!r}", path=path, where=key)
        elif isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InputError(f"linear_attn_config.{key} ({flat}) must be a positive integer, got {v!r}", path=path,
                             where=key, fix="write the release's linear_attn_config")
        vals[key] = v
    if vals["num_heads"] != heads:
        raise InputError(f"linear_attn_config.num_heads ({vals['num_heads']}) must equal num_attention_heads ({heads})",
                         path=path, where="linear_attn_config.num_heads")
    dims = KdaDims(num_heads=vals["num_heads"], head_dim=vals["head_dim"], conv_kernel=vals["short_conv_kernel_size"],
                   lower_bound=None if vals["gate_lower_bound"] is None else float(vals["gate_lower_bound"]))
    return {"attention": {"layer_types": tuple("linear_attention" if t == "linear_attention" else "indexed_attention"
                                               for t in types), "kda": dims}}


class Kda(AttentionMechanism):
    name = "kda"
    recurrent = True
    parsers = (ParseStep(30, parse),)

    def layer_tensors(self, cfg: MoeConfig, layer: int, add: Add, *, experts: bool = True) -> None:
        d, a, h = cfg.attention.kda, f"{layer_prefix(layer)}.self_attn", cfg.hidden_size
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
        "kda": lambda w, c, n: (w.add_ssm_conv_kernel(c.attention.kda.conv_kernel),
                                w.add_uint32(f"{w.arch}.kda.head_dim", c.attention.kda.head_dim),
                                when(c.attention.kda.lower_bound is not None, lambda: w.add_float32(
                                    f"{w.arch}.kda.gate_lower_bound", c.attention.kda.lower_bound))),
    }


MECHANISM = Kda()
