"""Reference causal LMs for every family, with the module tree upstream rule files match. A decoder layer is
assembled from the mechanisms ``ktconvert/arch/`` picks for it and their torch modules in ``ktconvert/model/mechanisms.py``.

Tree (``L`` = layer, ``E`` = expert; ``mlp`` is ``block_sparse_moe`` for Mixtral, as its checkpoints and
ktransformers' Mixtral rules name it)::

    model.embed_tokens                  VocabEmbedding (an nn.Embedding)
    model.layers.L.input_layernorm      RMSNorm
    model.layers.L.self_attn            the layer's attention mechanism (``mechanisms.ATTENTION``), with .rotary_emb
                                        and nn.Linear projections; ``linear_attn`` where the mechanism says so
    model.layers.L.post_attention_layernorm
    model.layers.L.mlp                  the layer's feed-forward mechanism (``mechanisms.FEED_FORWARD``): MoE or dense
    model.layers.L.mlp.gate             TopKRouter (nn.Linear) / MoEGate
    model.layers.L.mlp.experts          RoutedExperts (nn.ModuleList), children E = GatedMLP
    model.layers.L.mlp.shared_expert(s) GatedMLP (+ shared_expert_gate nn.Linear for Qwen2-MoE)
    model.norm                          RMSNorm
    lm_head                             VocabHead (an nn.Linear over vocabulary chunks)

Rotary embeddings sit inside each attention module (``self_attn.rotary_emb``): ktransformers' own modeling
files put them there and its multi-GPU rule files select them per layer (``^model\\.layers\\.N\\.`` with a
RotaryEmbedding class).
"""

from __future__ import annotations

import os
from typing import Callable

import torch
from torch import nn

from ktconvert import arch
from ktconvert.families.config import MoeConfig, load_config
from ktconvert.model import hfnames, mechanisms
from ktconvert.model.executor import ForwardOutput, LayerMajor
from ktconvert.model.modules import (
    KVCache,
    Tagged,
    VocabEmbedding,
    VocabHead,
    rms_norm,
)


class DecoderLayer(Tagged, nn.Module):
    def __init__(self, cfg: MoeConfig, layer_idx: int, residual):
        super().__init__()
        self.layer_idx = layer_idx
        self.input_layernorm = rms_norm(cfg, cfg.hidden_size)
        self.attention_kind = arch.attention_for(cfg, layer_idx)
        self.attn_attr = arch.mechanism(self.attention_kind).attr  # self_attn / linear_attn
        setattr(self, self.attn_attr, mechanisms.ATTENTION[self.attention_kind](cfg, layer_idx))
        self.post_attention_layernorm = rms_norm(cfg, cfg.hidden_size)
        self.ffn_kind = arch.feed_forward_for(cfg, layer_idx)
        self.moe_attr = cfg.ffn_name(layer_idx)
        setattr(self, self.moe_attr, mechanisms.FEED_FORWARD[self.ffn_kind](cfg, layer_idx))
        self.residual = residual  # the model's residual stream (one, or hyper-connections' several)
        residual.attach(self)

    @property
    def mixer(self) -> nn.Module:
        """The attention block, whatever its attribute name (``self_attn`` / ``linear_attn``)."""
        return getattr(self, self.attn_attr)

    @property
    def feed_forward(self) -> nn.Module:
        """The MLP or MoE block, whatever its attribute name (``mlp`` / ``block_sparse_moe``)."""
        return getattr(self, self.moe_attr)

    def forward(self, hidden: torch.Tensor, position_ids: torch.Tensor, cache: KVCache | None = None,
                input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``hidden [B, T, H]``, or ``[B, T, N, H]`` residual streams with hyper-connections."""
        hidden = self.residual.around(self, "attn", hidden,
                                      lambda x: self.mixer(self.input_layernorm(x), position_ids, cache))
        return self.residual.around(self, "ffn", hidden,
                                    lambda x: self._feed(self.post_attention_layernorm(x), input_ids))

    def _feed(self, hidden: torch.Tensor, input_ids: torch.Tensor | None) -> torch.Tensor:
        """The MLP / MoE block; a hash-routed one also reads the token ids."""
        if getattr(self.feed_forward, "takes_input_ids", False):
            return self.feed_forward(hidden, input_ids)
        return self.feed_forward(hidden)


class DecoderModel(Tagged, nn.Module):
    def __init__(self, cfg: MoeConfig, residual):
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, residual) for i in range(cfg.num_hidden_layers))
        for i, layer in enumerate(self.layers):  # what a layer's attention reads of another's (DSA's shared layers)
            if hasattr(layer.mixer, "link"):
                layer.mixer.link(self.layers, i)
        self.norm = rms_norm(cfg, cfg.hidden_size)
        residual.attach_model(self)


class ReferenceCausalLM(Tagged, nn.Module):
    """A reference MoE causal LM. ``forward(input_ids, cache)`` runs prefill or decode steps alike."""

    def __init__(self, cfg: MoeConfig):
        super().__init__()
        self.config = cfg
        self.residual = mechanisms.residual(cfg)  # ktconvert/model/executor.py widens and reads the streams with it
        self.model = DecoderModel(cfg, self.residual)
        self.lm_head = VocabHead(cfg.hidden_size, cfg.vocab_size, bias=False)

    def new_cache(self) -> KVCache:
        return KVCache()

    def forward(self, input_ids: torch.Tensor, cache: KVCache | None = None) -> ForwardOutput:
        """Run ``input_ids [B, T]`` at positions ``cache.seq_len ..``; appends to ``cache`` when given. The layer-major
        executor (:mod:`ktconvert.model.executor`) with every weight resident: one call of each layer over all T."""
        return LayerMajor(self).run(input_ids, cache)


def _tag(module: nn.Module, family: str, role: str, **kw) -> None:
    module.hf_class, module.hf_class_paths = hfnames.class_names(family, role, **kw)


def _tag_tree(model: ReferenceCausalLM) -> None:
    cfg = model.config
    fam = cfg.family
    yarn = cfg.rope.kind == "yarn"
    _tag(model, fam, "causal_lm")
    _tag(model.model, fam, "model")
    _tag(model.model.norm, fam, "rmsnorm")
    if hasattr(model.model, "hc_head"):
        _tag(model.model.hc_head, fam, "hyper_head")
    for layer in model.model.layers:
        _tag(layer, fam, "decoder_layer")
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            _tag(norm, fam, "rmsnorm")
        attn = layer.mixer
        if arch.mechanism(layer.attention_kind).recurrent:
            _tag(attn, fam, "linear_attention")
        else:
            _tag(attn, fam, "attention")
            if attn.rotary_emb is not None:
                _tag(attn.rotary_emb, fam, "rotary", yarn=yarn)
        for sub in attn.modules():  # the mechanism's own parts (norms, indexers, compressors) name their role
            role = getattr(sub, "hf_role", None)
            if role is not None:
                _tag(sub, fam, role)
        for hc in (getattr(layer, "attn_hc", None), getattr(layer, "ffn_hc", None)):
            if hc is not None:
                _tag(hc, fam, "hyper_connection")
        block = layer.feed_forward
        if layer.ffn_kind == "dense_mlp":
            _tag(block, fam, "mlp")
            continue
        _tag(block, fam, "moe_block")
        gate = getattr(block, "router_module", None) or block.gate
        _tag(gate, fam, "hash_gate" if layer.ffn_kind == "hash_routing" else "gate")
        _tag(block.experts, fam, "experts")
        for expert in block.experts:
            _tag(expert, fam, "mlp", expert=True)
        shared = getattr(block, "shared_experts", None) or getattr(block, "shared_expert", None)
        if shared is not None:
            _tag(shared, fam, "mlp")


def build_model(config: MoeConfig | dict | str | os.PathLike, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> ReferenceCausalLM:
    """Construct the module tree for ``config`` (parsed, a dict, ``config.json`` or its directory).

    Weights hold torch's default random initialisation until :func:`ktconvert.model.load_weights` fills them. ``device="meta"`` builds
    the tree without allocating anything (enough to match rules against module names and classes).
    """
    cfg = config if isinstance(config, MoeConfig) else load_config(config)
    with torch.device(device):
        model = ReferenceCausalLM(cfg)
    _tag_tree(model)
    if torch.device(device).type != "meta" and dtype != torch.float32:
        # parameters only: rotary tables and the V3 score bias stay float32, as upstream keeps them
        for param in model.parameters():
            param.data = param.data.to(dtype)
    return model.eval()


def build_skeleton(config: MoeConfig | dict | str | os.PathLike, *, dtype: torch.dtype = torch.float32) -> ReferenceCausalLM:
    """The float32 module tree for ``config`` without its weights: every tensor created with ``torch.empty`` (every
    ``nn.Linear`` / ``nn.Embedding`` weight: the experts, projections, embedding, head) lives on the meta device and
    costs nothing; small tensors filled at construction (norms, rotary tables) are real. A streaming weight provider
    (:class:`ktconvert.model.executor.CheckpointWeights`) puts each part's weights in just before it runs.
    ``dtype``: the parameters' dtype, as :func:`build_model` casts them (buffers stay float32)."""
    from torch.overrides import TorchFunctionMode

    class EmptyOnMeta(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if func is torch.empty:
                kwargs["device"] = "meta"
            return func(*args, **kwargs)

    cfg = config if isinstance(config, MoeConfig) else load_config(config)
    with torch.device("cpu"), EmptyOnMeta():
        model = ReferenceCausalLM(cfg)
    _tag_tree(model)
    if dtype != torch.float32:
        for param in model.parameters():
            param.data = param.data.to(dtype)
    return model.eval()


def module_type_resolver(catalog) -> Callable[[nn.Module], str]:
    """``type_of(module)``: the operator catalog's module type of a reference module (``Module`` when the catalog
    knows none of its class paths), for :func:`ktconvert.rules.apply.injection_plan`."""

    def type_of(module: nn.Module) -> str:
        for p in module_class_paths(module):
            t = catalog.type_of_class(p)
            if t:
                return t
        return "Module"

    return type_of


def module_class_paths(module: nn.Module) -> tuple[str, ...]:
    """Every dotted class path an upstream ``isinstance`` test would accept for ``module``.

    The reference class's ``hf_class_paths`` plus the torch classes in its MRO under both their public and
    defining-module names (``torch.nn.Linear`` and ``torch.nn.modules.linear.Linear``).
    """
    paths = list(getattr(module, "hf_class_paths", ()) or ())
    for cls in type(module).__mro__:
        mod = getattr(cls, "__module__", "")
        if mod.startswith("torch.nn"):
            full = f"{mod}.{cls.__qualname__}"
            if full not in paths:
                paths.append(full)
            if getattr(nn, cls.__name__, None) is cls and f"torch.nn.{cls.__name__}" not in paths:
                paths.append(f"torch.nn.{cls.__name__}")
    return tuple(paths)
