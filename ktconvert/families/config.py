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

from ktconvert.arch import compressed_mqa, gated_deltanet, gqa, hash_routing, hyper_connections, kda, moe
from ktconvert.arch import mla as mla_mechanism
from ktconvert.arch.attention_part import AttentionPart
from ktconvert.arch.base import Getter
from ktconvert.arch.hyper_connections import HyperConnectionDims
from ktconvert.arch.moe import Activation, MlpPart, Routing
from ktconvert.arch.rope import RopeSpec, parse_rope
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
    def is_mla(self) -> bool:
        return self.spec.is_mla

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

    mla = sp.is_mla
    attn_facts = sp.section("attention")
    head_dim = g.opt("head_dim")
    compressed = attn_facts["kind"] == "compressed_mqa"
    if compressed:
        head_dim = g.int("head_dim")
        rope_dim = compressed_mqa.parse_rope_dim(raw, head_dim, path)
    elif mla:
        rope_dim = g.int("qk_rope_head_dim")
        head_dim = rope_dim
    else:
        head_dim = int(head_dim) if head_dim else hidden // heads
        seen = raw if not attn_facts.get("rotary_dim_ignored") else {k: v for k, v in raw.items() if k != "rotary_dim"}
        rope_dim = _rotary_dim(seen, head_dim, attn_facts.get("partial_rotary_factor", 1.0), path)
    if heads % kv_heads:
        raise InputError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}", path=path)

    max_pos = int(g.opt("max_position_embeddings", defaults["max_position_embeddings"]))
    compress_rope = None
    if compressed:
        rope, compress_rope = compressed_mqa.parse_ropes(raw, defaults["rope_theta"], rope_dim, max_pos, path)
    else:
        rope = parse_rope(raw, defaults["rope_theta"], rope_dim, max_pos, path)

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
    attention, kwargs = _parts(g, raw, sp, layers, heads, kv_heads, head_dim, rope_dim, compress_rope, mlp.moe_layers,
                               float(g.opt("rms_norm_eps", defaults["rms_norm_eps"])), path)
    # compressed MQA's window covers every layer (its parser gives it)
    attention = AttentionPart(**{"qk_norm": qk_norm, "sliding_window": window, "sliding_layers": sliding, **attention})
    if "hash_layers" in kwargs:
        routing_part = replace(routing_part, hash_layers=kwargs.pop("hash_layers"))

    return MoeConfig(
        family=family,
        vocab_size=g.int("vocab_size"),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(g.opt("rms_norm_eps", defaults["rms_norm_eps"])),
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



def _parts(g: Getter, raw: dict, sp: registry.FamilySpec, layers: int, heads: int, kv_heads: int, head_dim: int,
           rope_dim: int, compress_rope: RopeSpec | None, moe_layers: tuple[int, ...], rms_norm_eps: float,
           path: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The parts its mechanisms own, each parsed by the mechanism the spec names (``ktconvert/arch/``), in the order
    their refusals are checked: ``(attention, other)``, the fields of :class:`AttentionPart` and the rest (the
    residual, the hash-routed layers)."""
    attn, cfg_facts, routing = sp.section("attention"), sp.section("config"), sp.section("routing")
    attention: dict[str, Any] = {}
    other: dict[str, Any] = {}
    if sp.is_mla:
        attention = mla_mechanism.parse(g, raw, attn, layers, heads, kv_heads, rms_norm_eps, path)
    if attn["kind"] == "gated_deltanet_hybrid":
        attention.update(gated_deltanet.parse(g, raw, layers, path))
    if attn.get("linear_attention") == "kda":
        attention.update(kda.parse(g, raw, layers, heads, path))
    if attn.get("dsa_shared"):
        attention["indexer"] = replace(attention["indexer"], shared_layers=mla_mechanism.parse_shared(
            raw, layers, attention.get("layer_types") or ("indexed_attention",) * layers, path))
    if cfg_facts.get("hyper_connections"):
        other["residual"] = hyper_connections.parse(g, cfg_facts["hyper_connections"], path)
    if attn.get("msa_indexer"):
        attention.update(gqa.parse_msa(g, raw, layers, kv_heads, rope_dim, moe_layers, path))
    if attn["kind"] == "compressed_mqa":
        attention.update(compressed_mqa.parse(g, raw, layers, heads, kv_heads, head_dim, compress_rope, path))
    if "hash_layers" in routing:
        other["hash_layers"] = hash_routing.parse(g, raw, routing["hash_layers"], layers, path)
    return attention, other


def _gguf_facts(raw: dict) -> GgufFacts:
    """What only the model's own GGUF keys read of config.json."""
    vision = raw.get("vision_config")
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    sections = params.get("mrope_section") if isinstance(params, dict) else None
    rotary_dim = raw.get("rotary_dim")
    return GgufFacts(deepstack_layers=len((vision.get("deepstack_visual_indexes") or ()) if isinstance(vision, dict) else ()),
                     rotary_dim=rotary_dim if isinstance(rotary_dim, int) else None,
                     mrope_section=tuple(sections) if sections else None)


def _rotary_dim(raw: dict, head_dim: int, default: float, path: str | None) -> int:
    """How many leading dims of each head are rotated: ``partial_rotary_factor`` as transformers 5 writes it
    (inside ``rope_parameters``) or as the hub configs do (top level), a hub ``rotary_dim`` (MiniMax-M2), else
    the family's default."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling")
    params = params if isinstance(params, dict) else {}
    factor = params.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    rotary_dim = raw.get("rotary_dim")
    if factor is None and rotary_dim is not None:
        if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int) or not 0 < rotary_dim <= head_dim:
            raise InputError(f"rotary_dim must be an integer in 1..head_dim ({head_dim}), got {rotary_dim!r}",
                             path=path, where="rotary_dim")
        factor = rotary_dim / head_dim
    factor = default if factor is None else factor
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise InputError(f"partial_rotary_factor must be a number in (0, 1], got {factor!r}", path=path,
                         where="partial_rotary_factor")
    dim = int(head_dim * factor)
    if dim < 2 or dim % 2:
        raise InputError(f"partial_rotary_factor={factor} rotates {dim} of {head_dim} head dims; rope needs an even "
                         "count of at least 2", path=path, where="partial_rotary_factor")
    return dim
