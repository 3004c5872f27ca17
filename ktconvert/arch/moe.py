"""The MoE block (``moe``: router, routed experts of the dense MLP's shape, shared expert(s)), whose router scores
the hidden state; ``hash_routing.py`` is the MoE block routed by token id. Torch: ``model/modules.py``
``SparseMoeBlock`` / ``DeepseekMoE`` (picked by the spec's routing maths). Its part of the config is
``MoeConfig.routing`` (:class:`Routing`), ``MoeConfig.activation`` (:class:`Activation`) and ``MoeConfig.mlp``
(:class:`MlpPart`: which layers hold the block, its experts' and shared experts' widths, and the dense layers'
width), parsed here by :func:`parse_routing`, :func:`parse_activation`, :func:`parse_mlp` and
:func:`parse_shared_experts` (the dense layers by ``dense_mlp.py``)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ktconvert.arch import dense_mlp
from ktconvert.arch.base import Add, Getter, MechanismBase, layer_prefix, when
from ktconvert.errors import InputError
from ktconvert.arch.dense_mlp import mlp_modules, mlp_tensors

if TYPE_CHECKING:  # arch sits below families (docs/developing/layout.md): the type only, no import
    from ktconvert.families.config import MoeConfig


#: routing.weights values whose reference is a softmax over the router logits then top-k (or top-k then softmax):
#: the SparseMoeBlock family of Qwen / Mixtral; every other value is DeepSeek's gate with its own maths
LOGITS_ROUTERS = ("softmax_topk", "topk_softmax")

_TOPK_METHODS = {"greedy", "group_limited_greedy", "noaux_tc"}


@dataclass(frozen=True)
class Routing:
    """How a token picks and weighs its experts: the spec's ``routing`` maths with the config's numbers
    (``MoeConfig.routing``, parsed by :func:`parse_routing`; its hash-routed layers by ``hash_routing.parse``)."""

    weights: str  # softmax_topk | topk_softmax | renorm_or_scale | renorm_then_scale | ...
    float32_weights: bool  # the weights stay float32 instead of returning to the activations' dtype
    scoring_func: str  # softmax | sigmoid | sqrtsoftplus
    topk_method: str  # greedy | group_limited_greedy | noaux_tc
    norm_topk_prob: bool
    n_group: int | None  # expert groups (None for greedy)
    topk_group: int | None  # groups a token may pick from
    routed_scaling_factor: float
    # the layers routing by tid2eid[input_id] instead (spec routing.hash_layers, parsed by hash_routing.parse)
    hash_layers: tuple[int, ...] = ()

    @property
    def logits_router(self) -> bool:
        """Softmax-and-top-k routing (Qwen / Mixtral's SparseMoeBlock), whatever the attention kind."""
        return self.weights in LOGITS_ROUTERS

    @property
    def renorm_then_scale(self) -> bool:
        return self.weights == "renorm_then_scale"

    @property
    def groups(self) -> int:
        """Expert groups, 1 when the method has none."""
        return self.n_group or 1


def parse_routing(g: Getter, routing: dict, family: str, num_experts: int, path: str | None) -> Routing:
    """The spec's routing section with the config's numbers, or the one-line refusal of a routing it cannot run."""
    norm_topk = bool(g.choice(routing["norm_topk_prob"]))
    scoring = g.choice(routing["scoring_func"])
    method = g.choice(routing["topk_method"])
    if method == "gready":  # the DeepSeek-V2 remote-code config's default spelling
        method = "greedy"
    if method not in _TOPK_METHODS:
        raise InputError(f"topk_method {method!r} is not supported ({', '.join(sorted(_TOPK_METHODS))})", path=path, where="topk_method")
    if scoring not in ("softmax", "sigmoid", "sqrtsoftplus"):
        raise InputError(f"scoring_func {scoring!r} is not supported (softmax, sigmoid, sqrtsoftplus)", path=path,
                         where="scoring_func")
    allowed = routing.get("allowed") or {}
    if (scoring not in allowed.get("scoring_func", (scoring,))
            or method not in allowed.get("topk_method", (method,))):
        raise InputError(
            f"{family} routing must use scoring_func {'/'.join(allowed.get('scoring_func', ('any',)))} with topk_method "
            f"{'/'.join(allowed.get('topk_method', ('any',)))}, got {method}/{scoring}",
            path=path,
            where="topk_method",
        )
    n_group = g.choice(routing["n_group"]) if "n_group" in routing else g.opt("n_group")
    topk_group = g.choice(routing["topk_group"]) if "topk_group" in routing else g.opt("topk_group")
    if method in ("group_limited_greedy", "noaux_tc"):
        if not n_group or not topk_group:
            raise InputError(f"topk_method {method} needs n_group and topk_group", path=path, where="n_group")
        n_group, topk_group = int(n_group), int(topk_group)
        if num_experts % n_group or not 0 < topk_group <= n_group:
            raise InputError(
                f"n_group={n_group} must divide num_experts={num_experts} and topk_group={topk_group} must be in 1..{n_group}",
                path=path,
                where="n_group",
            )
        if method == "noaux_tc" and num_experts // n_group < 2:
            raise InputError("noaux_tc scores groups by their top-2 experts: groups need at least 2 experts", path=path, where="n_group")

    scaling = float(g.opt("routed_scaling_factor", 1.0) or 1.0) if routing.get("routed_scaling") else 1.0
    return Routing(weights=routing["weights"], float32_weights=bool(routing["float32_weights"]), scoring_func=scoring,
                   topk_method=method, norm_topk_prob=norm_topk, n_group=n_group if method != "greedy" else None,
                   topk_group=topk_group if method != "greedy" else None, routed_scaling_factor=scaling)


@dataclass(frozen=True)
class Activation:
    """The experts' activation: ``clamp``, the ``(alpha, limit)`` of a clamped SwiGLU (a spec's ``moe.activation``;
    alpha None with a limit: silu_clamped, GLM-5-Next), None for plain silu(gate) * up; whether the dense MLP layers
    (``dense``) and the shared experts (``shared``) use it too."""

    clamp: tuple[float | None, float] | None = None
    dense: bool = False
    shared: bool = False


def parse_activation(g: Getter, act: dict | None, shared_experts: bool, path: str | None) -> Activation:
    """The spec's ``moe.activation`` with the config's numbers (``shared_experts``: the family has DeepSeek's
    ``shared_experts`` MLP, which ``moe.activation.shared`` may clamp too)."""
    if not act:
        return Activation()
    alpha = float(g.choice(act["alpha"])) if act["kind"] == "swiglu_clamped" else None
    limit = float(g.choice(act["limit"]))
    if limit <= 0:
        raise InputError(f"swiglu_limit must be positive, got {limit}", path=path,
                         where=act["limit"].get("key", "swiglu_limit"))
    return Activation(clamp=(alpha, limit), dense=bool(act.get("dense")), shared=shared_experts and bool(act.get("shared")))


@dataclass(frozen=True)
class MlpPart:
    """Each layer's feed-forward block as config.json sizes it (``MoeConfig.mlp``): the layers that hold the MoE
    block (the rest run the dense MLP), the routed experts' width, the dense layers' width and the shared
    expert(s). Parsed by :func:`parse_mlp` (the layers and widths) and :func:`parse_shared_experts`."""

    moe_layers: tuple[int, ...]  # the layers holding routed experts (spec config.dense_layers; the rest are dense)
    moe_intermediate_size: int  # a routed expert's width (the config key the spec's config.expert_width names)
    intermediate_size: int  # the dense MLP layers' width (DeepSeek's first layers, Qwen's mlp_only_layers)
    shared_expert_intermediate_size: int | None = None  # Qwen2-MoE's gated shared expert (spec moe.shared_expert gated)
    n_shared_experts: int = 0  # DeepSeek's shared experts (spec moe.shared_expert shared_experts)
    shared_experts_width: int | None = None  # the shared_experts MLP's width when a spec names its key

    @property
    def shared_experts_inter(self) -> int:
        """The ``shared_experts`` MLP's width: the spec's width key where it names one, else ``n_shared_experts``
        expert widths."""
        return self.shared_experts_width or self.moe_intermediate_size * self.n_shared_experts


def parse_mlp(g: Getter, config: dict, family: str, raw: dict, layers: int, num_experts: int,
              path: str | None) -> MlpPart:
    """The MoE layers and the widths (the spec's ``config`` section: ``dense_layers``, ``expert_width``,
    ``dense_width``), the shared experts left to :func:`parse_shared_experts`."""
    moe_layers = dense_mlp.parse_layers(config["dense_layers"], family, raw, layers, num_experts, path)
    moe_inter, inter = dense_mlp.parse_widths(g, config["expert_width"], config.get("dense_width"), raw, layers,
                                              moe_layers, path)
    return MlpPart(moe_layers=moe_layers, moe_intermediate_size=moe_inter, intermediate_size=inter)


def parse_shared_experts(g: Getter, moe: dict, mlp: MlpPart, path: str | None) -> MlpPart:
    """``mlp`` with the shared expert(s) the spec's ``moe`` section names: ``shared_expert: gated`` (Qwen's one
    gated shared expert, ``shared_expert_intermediate_size`` wide) or ``shared_experts`` (DeepSeek's
    ``n_shared_experts``, each an expert wide unless ``moe.shared_experts_width`` names the MLP's width key)."""
    shared, width_key = moe["shared_expert"], moe.get("shared_experts_width")
    if shared == "gated":
        return replace(mlp, shared_expert_intermediate_size=g.int("shared_expert_intermediate_size"))
    if shared == "shared_experts":
        width = g.int(width_key) if width_key else None
        return replace(mlp, shared_experts_width=width,
                       n_shared_experts=int(g.opt("n_shared_experts", 1 if width_key else 0) or 0))
    return mlp


class Moe(MechanismBase):
    """No parse step of its own (its routing, activation and MLP part are parsed with the core: every family has
    them) and no tensor role of its own (its router's designed fill is the tiny models', for every family)."""

    name = "moe"
    count_limits = {"n_group": (1, 8192), "topk_group": (1, 8192)}

    def router_tensors(self, cfg: MoeConfig, m: str, add: Add) -> None:
        """What the router holds besides its weight and bias: DeepSeek-V3's score-correction bias."""
        if cfg.routing.topk_method == "noaux_tc":
            on_block = cfg.spec.experts.bias_on_block
            add(f"{m}.{'' if on_block else 'gate.'}e_score_correction_bias", (cfg.num_experts,), "score_bias")

    def router_type(self, cfg: MoeConfig) -> str:
        """The router's class in transformers' tree (a family without a ktransformers modeling file)."""
        return cfg.spec.classes.gate.get("transformers", "Linear")

    def layer_tensors(self, cfg: MoeConfig, layer: int, add: Add, *, experts: bool = True) -> None:
        h, m, moe = cfg.hidden_size, f"{layer_prefix(layer)}.{cfg.ffn_name(layer)}", cfg.spec.experts
        router = moe.router_attr
        add(f"{m}.{router}.weight", (cfg.num_experts, h), "router")
        if moe.router_bias:
            add(f"{m}.{router}.bias", (cfg.num_experts,), "bias")
        self.router_tensors(cfg, m, add)
        mlp = cfg.mlp
        for e in range(cfg.num_experts if experts else 0):
            mlp_tensors(add, h, f"{m}.experts.{e}", mlp.moe_intermediate_size, cfg.expert_proj_names, moe.expert_bias)
        if mlp.shared_expert_intermediate_size:
            mlp_tensors(add, h, f"{m}.shared_expert", mlp.shared_expert_intermediate_size)
            add(f"{m}.shared_expert_gate.weight", (1, h), "linear")
        if mlp.n_shared_experts:
            mlp_tensors(add, h, f"{m}.shared_experts", mlp.shared_experts_inter)

    def layer_modules(self, node, cfg: MoeConfig) -> None:
        """Upstream ktransformers classes: DeepSeek's block is <P>MoE with a <P>MoEGate, others a <P>SparseMoeBlock
        with a plain Linear router. Without a ktransformers modeling file: transformers' own block and router
        classes; its routed experts are fused into one module there, so each expert here is a plain Module."""
        sp = cfg.spec
        pre, classes, router = sp.prefix, sp.classes, sp.experts.router_attr
        if not classes.ktransformers_module:
            moe = node.add(sp.moe_block_name, classes.moe_block.get("transformers", f"{pre}SparseMoeBlock"))
            moe.add(router, self.router_type(cfg))
            expert_type = "Module"
        else:
            kt_gate = bool(classes.gate)
            moe = node.add(sp.moe_block_name, f"{pre}MoE" if kt_gate else f"{pre}SparseMoeBlock")
            moe.add(router, f"{pre}MoEGate" if kt_gate else "Linear")
            expert_type = classes.expert or f"{pre}MLP"
        experts = moe.add("experts", f"{pre}Experts")
        for e in range(cfg.num_experts):
            mlp_modules(experts, str(e), expert_type, sp.expert_proj_names)
        if sp.shared_expert == "shared_experts" and cfg.mlp.n_shared_experts:
            mlp_modules(moe, "shared_experts", f"{pre}MLP")
        if sp.shared_expert == "gated" and cfg.mlp.shared_expert_intermediate_size:
            mlp_modules(moe, "shared_expert", f"{pre}MLP")
            moe.add("shared_expert_gate", "Linear")

    gguf_keys = {
        "expert_feed_forward_length": lambda w, c, n: w.add_expert_feed_forward_length(c.mlp.moe_intermediate_size),
        "expert_shared_feed_forward_length": lambda w, c, n: when(
            c.mlp.shared_expert_intermediate_size,
            lambda: w.add_expert_shared_feed_forward_length(c.mlp.shared_expert_intermediate_size)),
        "leading_dense_block_count": lambda w, c, n: w.add_leading_dense_block_count(
            min(c.mlp.moe_layers) if c.mlp.moe_layers else n),
        "expert_shared_count": lambda w, c, n: w.add_expert_shared_count(c.mlp.n_shared_experts),
        "expert_weights_scale": lambda w, c, n: w.add_expert_weights_scale(c.routing.routed_scaling_factor),
        "expert_weights_norm": lambda w, c, n: when(c.routing.norm_topk_prob, lambda: w.add_expert_weights_norm(True)),
        "expert_gating_func": lambda w, c, n: _gating_func(w, c),
        "expert_group_count": lambda w, c, n: when(c.routing.n_group, lambda: w.add_expert_group_count(c.routing.n_group)),
        "expert_group_used_count": lambda w, c, n: when(
            c.routing.topk_group, lambda: w.add_expert_group_used_count(c.routing.topk_group)),
        # the clamped SwiGLU's limit per layer, for the routed and (where they clamp too: GLM-5-Next, DeepSeek-V4)
        # the shared experts
        "swiglu_clamp": lambda w, c, n: (
            w.add_swiglu_clamp_exp([float(c.activation.clamp[1])] * n),
            when(c.activation.shared, lambda: w.add_swiglu_clamp_shexp([float(c.activation.clamp[1])] * n))),
    }


#: llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SQRTSOFTPLUS (gguf-py 0.19.0's enum predates it)
SQRTSOFTPLUS = 4


def _gating_func(w, c: MoeConfig) -> None:
    from gguf import ExpertGatingFuncType  # here, not at import: check-rules reads this package without numpy

    if c.routing.scoring_func == "sqrtsoftplus":
        w.add_uint32(f"{w.arch}.expert_gating_func", SQRTSOFTPLUS)
    else:
        w.add_expert_gating_func(ExpertGatingFuncType.SIGMOID if c.routing.scoring_func == "sigmoid"
                                 else ExpertGatingFuncType.SOFTMAX)


MECHANISM = Moe()
