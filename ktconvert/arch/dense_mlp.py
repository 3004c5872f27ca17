"""The dense gated MLP (``dense_mlp``: DeepSeek's first layers, Qwen's ``mlp_only_layers``, MiniMax-M3's dense
layers): down(act(gate) * up); its projections are also the shape of every expert and shared expert (``moe.py``).
Torch: ``model/modules.py`` ``GatedMLP``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ktconvert.arch.base import Add, layer_prefix

if TYPE_CHECKING:  # arch sits below families (docs/developing/layout.md): the type only, no import
    from ktconvert.families.config import MoeConfig


def mlp_tensors(add: Add, h: int, prefix: str, inter: int, names=("gate_proj", "up_proj", "down_proj"),
                bias: bool = False) -> None:
    """A gated MLP's three projections (and their biases): dense layers, experts and shared experts."""
    add(f"{prefix}.{names[0]}.weight", (inter, h), "linear")
    add(f"{prefix}.{names[1]}.weight", (inter, h), "linear")
    add(f"{prefix}.{names[2]}.weight", (h, inter), "out_linear")
    if bias:
        add(f"{prefix}.{names[0]}.bias", (inter,), "bias")
        add(f"{prefix}.{names[1]}.bias", (inter,), "bias")
        add(f"{prefix}.{names[2]}.bias", (h,), "out_bias")


def mlp_modules(parent, name: str, type_: str, projs=("gate_proj", "up_proj", "down_proj")):
    mlp = parent.add(name, type_)
    for p in projs:
        mlp.add(p, "Linear")
    mlp.add("act_fn", "Activation")
    return mlp


class DenseMlp:
    name = "dense_mlp"
    gguf_keys: dict = {}
    parsers = ()  # its width is the core's (MoeConfig.intermediate_size)
    count_limits: dict = {}
    fills: dict = {}

    def layer_tensors(self, cfg: MoeConfig, layer: int, add: Add, *, experts: bool = True) -> None:
        mlp_tensors(add, cfg.hidden_size, f"{layer_prefix(layer)}.{cfg.ffn_name(layer)}", cfg.intermediate_size)

    def layer_modules(self, node, cfg: MoeConfig) -> None:
        mlp_modules(node, cfg.dense_block_name, f"{cfg.spec.prefix}MLP")


MECHANISM = DenseMlp()
