"""The torch computation of each mechanism of ``ktconvert/arch/``, under the name it is registered there: how
``ktconvert/model/reference.py`` builds a decoder layer from ``arch.attention_for`` / ``arch.feed_forward_for`` /
``arch.residual_for`` without a ladder of its own. ``tests/test_architecture.py`` checks both registries name the
same mechanisms."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ktconvert.families.config import MoeConfig
from ktconvert.model.compressed import CompressedAttention, HashRoutedMoE, HyperConnection
from ktconvert.model.linear_attention import GatedDeltaNet, KimiDeltaAttention
from ktconvert.model.modules import Attention, DeepseekMoE, GatedMLP, MLAttention, SparseMoeBlock

#: attention mechanisms: ``(cfg, layer) -> module``, held as the layer's ``arch`` attribute (self_attn / linear_attn)
ATTENTION: dict[str, Callable[[MoeConfig, int], nn.Module]] = {
    "gqa": Attention,
    "mla": MLAttention,
    "compressed_mqa": CompressedAttention,
    "gated_deltanet": GatedDeltaNet,
    "kda": KimiDeltaAttention,
}


def _moe(cfg: MoeConfig, layer: int) -> nn.Module:
    """The spec's routing maths picks the block (softmax top-k, or DeepSeek's grouped routing with shared experts),
    independently of the attention kind."""
    return SparseMoeBlock(cfg) if cfg.routing.logits_router else DeepseekMoE(cfg)


#: feed-forward mechanisms: ``(cfg, layer) -> module``
FEED_FORWARD: dict[str, Callable[[MoeConfig, int], nn.Module]] = {
    "dense_mlp": lambda cfg, layer: GatedMLP(cfg.hidden_size, cfg.intermediate_size,
                                             clamp=cfg.swiglu_clamp if cfg.dense_swiglu else None),
    "moe": _moe,
    "hash_routing": lambda cfg, layer: HashRoutedMoE(cfg),
}


def _hyper_connections(layer: nn.Module, cfg: MoeConfig) -> None:
    """Modules of their own (``attn_hc`` / ``ffn_hc``) as transformers' tree has them, else parameters on the layer
    under the checkpoint's names (``hc_attn_fn``, ...)."""
    if cfg.hc_modules:
        layer.attn_hc = HyperConnection(cfg)
        layer.ffn_hc = HyperConnection(cfg)
        return
    hc = cfg.hyper_connections
    width = (2 + hc.mult) * hc.mult
    for part in ("attn", "ffn"):
        setattr(layer, f"hc_{part}_fn", nn.Parameter(torch.zeros(width, hc.mult * cfg.hidden_size)))
        setattr(layer, f"hc_{part}_base", nn.Parameter(torch.zeros(width)))
        setattr(layer, f"hc_{part}_scale", nn.Parameter(torch.ones(3)))


#: residual-stream mechanisms: ``attach(layer, cfg)`` puts their weights on the decoder layer
RESIDUAL: dict[str, Callable[[nn.Module, MoeConfig], None]] = {
    "hyper_connections": _hyper_connections,
}
