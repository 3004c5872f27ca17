"""The torch computation of each mechanism of ``ktconvert/arch/``, under the name it is registered there: how
``ktconvert/model/reference.py`` builds a decoder layer from ``arch.attention_for`` / ``arch.feed_forward_for`` /
``arch.residual_for`` without a ladder of its own. ``tests/test_architecture.py`` checks both registries name the
same mechanisms."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ktconvert import arch
from ktconvert.families.config import MoeConfig
from ktconvert.model.compressed import CompressedAttention, HashRoutedMoE
from ktconvert.model.hyper import HyperStreams
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
    "dense_mlp": lambda cfg, layer: GatedMLP(cfg.hidden_size, cfg.mlp.intermediate_size,
                                             clamp=cfg.activation.clamp if cfg.activation.dense else None),
    "moe": _moe,
    "hash_routing": lambda cfg, layer: HashRoutedMoE(cfg),
}


class PlainResidual:
    """One residual stream: each block's output added to its input; what :class:`HyperStreams` does for several."""

    def attach(self, layer: nn.Module) -> None:
        pass

    def attach_model(self, model: nn.Module) -> None:
        pass

    def widen(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden

    def around(self, layer: nn.Module, part: str, hidden: torch.Tensor, block) -> torch.Tensor:
        return hidden + block(hidden)

    def collapse(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden

    def final(self, model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return hidden


#: residual-stream mechanisms: ``(cfg) -> residual`` (attach its weights to the layers and the model, widen the
#: embedding, run a block, read one hidden state back: :class:`PlainResidual`'s methods)
RESIDUAL: dict[str, Callable[[MoeConfig], object]] = {
    "hyper_connections": HyperStreams,
}


def residual(cfg: MoeConfig):
    """The residual stream of ``cfg``'s model: ``arch.residual_for``'s mechanism, else the plain one."""
    name = arch.residual_for(cfg)
    return RESIDUAL[name](cfg) if name else PlainResidual()
