"""One normalised view of a MoE ``config.json``, whatever spelling wrote it.

Hub checkpoints (the authors' remote-code configs) and transformers 5 (``save_pretrained``) name the same
fields differently: ``num_experts`` / ``num_local_experts`` / ``n_routed_experts``, ``rope_theta`` +
``rope_scaling`` / ``rope_parameters``, ``qkv_bias`` present or implied. Everything downstream (reference
models, weight loading, rule checks) reads :class:`MoeConfig` and never the raw dict, so a spelling is handled
in exactly one place. This module parses the core (sizes, layers, experts, rope, norms); each mechanism's part
(``routing`` with its hash layers, ``activation``, ``mlp`` with the dense layers and the shared experts,
``residual``, and ``attention``'s ``mla``, ``indexer``, ``linear``, ``kda``, ``compressed``, ...) is defined and
parsed in its ``ktconvert/arch/`` module. Pure Python: importing this never imports torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ktconvert import arch
from ktconvert.arch import gqa, moe
from ktconvert.arch.attention_part import AttentionPart
from ktconvert.arch.base import Getter, ParseContext
from ktconvert.arch.hyper_connections import HyperConnectionDims
from ktconvert.arch.moe import Activation, MlpPart, Routing
from ktconvert.arch.rope import RopeSpec
from ktconvert.errors import InputError
from ktconvert.families import registry
from ktconvert.families.limits import check_counts
from ktconvert.io.datafile import read_json

FAMILIES = registry.families()


@dataclass(frozen=True)
class GgufFacts:
    """config.json's facts that only the model's own GGUF keys read (``convert/metadata.py``), not the reference:
    the vision layers whose features join the text model (Qwen3-VL's ``vision_config.deepstack_visual_indexes``),
    the hub's ``rotary_dim`` as written (MiniMax-M3; transformers ignores it, llama.cpp rotates that many dims) and
    the multimodal rope sections (Qwen3.5's ``mrope_section``). A mechanism's own GGUF facts are on its part."""

    deepstack_layers: int = 0
    rotary_dim: int | None = None
    mrope_section: tuple[int, ...] | None = None


@dataclass(frozen=True)
class MoeConfig:
    """The fields the reference models need, with defaults resolved per family."""

    family: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeSpec
    tie_word_embeddings: bool
    # attention projections with a bias: names of the projections (family-specific)
    attention_bias_on: tuple[str, ...]
    # MoE
    num_experts: int
    num_experts_per_tok: int
    mlp: MlpPart  # the MoE and dense layers, the experts', dense MLP's and shared experts' widths (arch/moe.py)
    routing: Routing  # how a token picks and weighs its experts (and the hash-routed layers)
    activation: Activation  # the experts' activation (a clamped SwiGLU where the spec's moe.activation says)
    attention: AttentionPart = AttentionPart()  # every attention mechanism's part (ktconvert/arch/attention_part.py)
    residual: HyperConnectionDims | None = None  # the residual streams where not one (spec config.hyper_connections)
    bos_token_id: int | None = None
    eos_token_id: Any = None
    # config.json's first ``architectures`` entry, else the family's name (what a golden's manifest records)
    architecture: str = ""
    gguf: GgufFacts = GgufFacts()  # what only the model's own GGUF keys read (convert/metadata.py)

    @property
    def spec(self) -> registry.FamilySpec:
        """The family's spec (``rules/families/<family>.yaml``): ask it instead of comparing family names."""
        return registry.spec(self.family)

    @property
    def moe_block_name(self) -> str:
        """The attribute a decoder layer keeps its MoE block under (upstream rule files match this name)."""
        return self.spec.moe_block_name

    @property
    def dense_block_name(self) -> str:
        """The attribute a dense layer keeps its MLP under (``mlp`` beside MiniMax-M3's ``block_sparse_moe``)."""
        return self.spec.dense_block_name

    def ffn_name(self, layer: int) -> str:
        """The attribute layer ``layer`` keeps its MLP or MoE block under."""
        return self.moe_block_name if layer in self.mlp.moe_layers else self.dense_block_name

    @property
    def expert_proj_names(self) -> tuple[str, str, str]:
        """Per-expert projection names (gate, up, down) as the hub checkpoints spell them."""
        return self.spec.expert_proj_names


def load_config(source: str | os.PathLike | dict) -> MoeConfig:
    """Read ``config.json`` (a path to it, to its directory, or an already parsed dict) into a :class:`MoeConfig`."""
    if isinstance(source, dict):
        return normalize_config(source)
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    raw = read_json(path, "config.json", fix="pass a model directory that holds config.json")
    return normalize_config(raw, path=str(path))


def family_of(raw: dict) -> str | None:
    return registry.family_of(raw)


def text_view(raw: dict) -> dict:
    """A multimodal wrapper's config (``text_config`` nested in it) seen as its language model's: the nested keys
    over the top level, keeping the top-level ``model_type`` and ``architectures`` when they name the family
    (Qwen3.5's text model_type ``qwen3_5_moe_text`` names none)."""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        return raw
    merged = {**{k: v for k, v in raw.items() if k != "text_config"}, **text}
    if family_of(raw) is not None:  # the wrapper's model_type or architectures name the family
        merged.update({k: raw[k] for k in ("model_type", "architectures") if k in raw})
    if "tie_word_embeddings" in raw:  # the wrapper owns lm_head (Qwen3-VL's text_config says true, its top level false)
        merged["tie_word_embeddings"] = raw["tie_word_embeddings"]
    return merged


def require_family(raw: dict, path: str | None = None) -> str:
    """The family of a ``config.json`` dict (its model_type, else its architectures), or the one refusal every
    command gives for another model: ``config.json:model_type``, the supported families and what still works."""
    family = family_of(raw)
    if family is None:
        raise InputError(
            f"model_type {text_view(raw).get('model_type')!r} is not one of the supported families ({', '.join(FAMILIES)})",
            path=path,
            where="model_type",
            fix="ktconvert converts and models only these families; check-rules without --model still runs the "
                "model-independent checks",
        )
    return family


def normalize_config(raw: dict, *, path: str | None = None) -> MoeConfig:
    """Resolve both spellings and every per-family default into a :class:`MoeConfig`."""
    family = require_family(raw, path)
    raw = text_view(raw)
    check_counts(raw, path)
    g = Getter(raw, path)
    sp = registry.spec(family)
    cfg_facts, routing = sp.section("config"), sp.section("routing")
    defaults = cfg_facts["defaults"]

    hidden = g.int("hidden_size")
    heads = g.int("num_attention_heads")
    layers = g.int("num_hidden_layers")
    kv_heads = g.opt("num_key_value_heads")
    kv_heads = heads if kv_heads is None else int(kv_heads)
    act = sp.section("moe").get("activation")
    if g.opt("hidden_act", "silu") not in ("silu", (act or {}).get("hidden_act", "silu")):
        raise InputError(f"hidden_act {raw.get('hidden_act')!r} is not supported (only silu)", path=path, where="hidden_act")

    num_experts = g.first_int("num_experts", "num_local_experts", "n_routed_experts")
    top_k = g.int("num_experts_per_tok")
    if not 0 < top_k <= num_experts:
        raise InputError(f"num_experts_per_tok={top_k} must be in 1..{num_experts}", path=path, where="num_experts_per_tok")

    attn_facts = sp.section("attention")
    kind = arch.kind_mechanism(attn_facts["kind"])  # the spec's attention kind sizes the heads and the rope
    head_dim, rope_dim = kind.head_dims(g, attn_facts, hidden, heads, path)
    if heads % kv_heads:
        raise InputError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}", path=path)

    max_pos = int(g.opt("max_position_embeddings", defaults["max_position_embeddings"]))
    rope, compress_rope = kind.ropes(raw, defaults["rope_theta"], rope_dim, max_pos, path)

    mlp = moe.parse_mlp(g, cfg_facts, family, raw, layers, num_experts, path)
    routing_part = moe.parse_routing(g, routing, family, num_experts, path)

    # biases
    bias = cfg_facts.get("attention_bias")
    bias_on = tuple(bias["projections"]) if bias and g.opt(bias["key"], bias["default"]) else ()
    if cfg_facts.get("refuse_mlp_bias") and g.opt("mlp_bias", False):
        raise InputError("mlp_bias=true is not supported", path=path, where="mlp_bias")

    window, sliding = gqa.parse_window(raw, cfg_facts["sliding_window"], layers, path)
    activation = moe.parse_activation(g, act, sp.shared_expert == "shared_experts", path)

    qk_key = attn_facts.get("qk_norm_key")
    qk_norm = bool(g.opt(qk_key, sp.qk_norm)) if qk_key else sp.qk_norm
    eps = float(g.opt("rms_norm_eps", defaults["rms_norm_eps"]))
    kwargs = _parts(ParseContext(
        g=g, raw=raw, attention_spec=attn_facts, config_spec=cfg_facts, routing_spec=routing, layers=layers,
        heads=heads, kv_heads=kv_heads, head_dim=head_dim, rope_dim=rope_dim, compress_rope=compress_rope,
        moe_layers=mlp.moe_layers, rms_norm_eps=eps, path=path))
    # compressed MQA's window covers every layer (its parser gives it)
    attention = AttentionPart(**{"qk_norm": qk_norm, "sliding_window": window, "sliding_layers": sliding,
                                 **kwargs.pop("attention")})
    routing_part = replace(routing_part, **kwargs.pop("routing"))

    return MoeConfig(
        family=family,
        vocab_size=g.int("vocab_size"),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=eps,
        max_position_embeddings=max_pos,
        rope=rope,
        tie_word_embeddings=bool(g.opt("tie_word_embeddings", False)),
        attention_bias_on=bias_on,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        mlp=moe.parse_shared_experts(g, sp.section("moe"), mlp, path),
        routing=routing_part,
        activation=activation,
        attention=attention,
        bos_token_id=g.opt("bos_token_id"),
        eos_token_id=g.opt("eos_token_id"),
        architecture=(raw.get("architectures") or [family])[0],
        gguf=_gguf_facts(raw),
        **kwargs,
    )



def _parts(ctx: ParseContext) -> dict[str, Any]:
    """The parts its mechanisms own: every registered mechanism's parse steps (``ktconvert/arch/``), in their order
    (the order their refusals are checked in), each giving its part's fields where the spec uses it. ``MoeConfig``
    field -> value; ``attention`` and ``routing`` gather their parts' fields (the attention ones in ``ctx.attention``,
    where a later step reads them)."""
    out: dict[str, Any] = {"attention": ctx.attention, "routing": {}}
    for step in arch.parse_steps():
        for key, value in (step.parse(ctx) or {}).items():
            if key in ("attention", "routing"):
                out[key].update(value)
            else:
                out[key] = value
    return out


def _gguf_facts(raw: dict) -> GgufFacts:
    """What only the model's own GGUF keys read of config.json."""
    vision = raw.get("vision_config")
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    sections = params.get("mrope_section") if isinstance(params, dict) else None
    rotary_dim = raw.get("rotary_dim")
    return GgufFacts(deepstack_layers=len((vision.get("deepstack_visual_indexes") or ()) if isinstance(vision, dict) else ()),
                     rotary_dim=rotary_dim if isinstance(rotary_dim, int) else None,
                     mrope_section=tuple(sections) if sections else None)
