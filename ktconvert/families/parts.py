"""The typed parts of a family spec: what the mechanisms ask of its ``attention``, ``routing``, ``moe``, ``gguf``
and ``config`` sections, parsed once per spec with the schema's defaults resolved.

Code outside :mod:`ktconvert.families` reads these parts (``cfg.spec.attention.output_gate``), never the spec's raw
sections: a key's default and meaning live here, once (``tests/test_architecture.py`` checks that no other package
calls ``FamilySpec.section``). Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

@dataclass(frozen=True)
class AttentionPart:
    """The spec's ``attention`` section as the attention modules use it."""

    kind: str  # gqa | mla | gated_deltanet_hybrid | compressed_mqa: picks the mechanism (``ktconvert/arch/registry.py``)
    linear_attention: str | None  # the mechanism of config.json's linear_attention layers where the spec names one (kda)
    output_gate: bool  # q_proj also emits a per-head sigmoid gate
    qk_norm_whole: bool  # qk_norm_scope: projection (one RMSNorm over the whole q / k projection)
    sinks: bool  # a learned logit per head joins each softmax (gpt-oss)
    complex_rope: bool  # MLA rope as complex rotation whatever rope_interleave says
    indexer_rope_halves: bool  # dsa_indexer_rope: rotate_half (else interleaved pairs)

    @classmethod
    def of(cls, section: dict) -> AttentionPart:
        return cls(kind=section["kind"], linear_attention=section.get("linear_attention"),
                   output_gate=bool(section.get("output_gate")),
                   qk_norm_whole=section.get("qk_norm_scope", "head") == "projection",
                   sinks=bool(section.get("sinks")), complex_rope=bool(section.get("complex_rope")),
                   indexer_rope_halves=section.get("dsa_indexer_rope", "interleaved") == "rotate_half")


@dataclass(frozen=True)
class ExpertsPart:
    """The spec's ``moe`` section (with ``classes.ktransformers_module``): the MoE block's router and experts."""

    router_attr: str  # the block's attribute holding the router (default ``gate``)
    router_bias: bool
    expert_bias: bool  # the experts' projections have biases (gpt-oss)
    bias_on_block: bool  # score_bias: block (the correction bias is the block's own buffer, MiniMax-M2)
    interleaved_gate_up: bool  # gate_up: interleaved (gate even, up odd; gpt-oss), else gate rows first
    linear_router: bool  # ktransformers routes with an nn.Linear (families it has a modeling file for)

    @classmethod
    def of(cls, moe: dict, classes: dict) -> ExpertsPart:
        return cls(router_attr=moe.get("router", "gate"), router_bias=bool(moe.get("router_bias")),
                   expert_bias=bool(moe.get("expert_bias")),
                   bias_on_block=moe.get("score_bias", "gate") == "block",
                   interleaved_gate_up=moe.get("gate_up", "concatenated") == "interleaved",
                   linear_router=bool(classes.get("ktransformers_module")))


@dataclass(frozen=True)
class GgufPart:
    """The spec's ``gguf`` section: llama.cpp's architecture and the keys written for it."""

    arch: str
    naming: str
    feed_forward_length: str  # the MLP part's width {arch}.feed_forward_length holds (MoeConfig.mlp, arch/moe.py)
    mla_mqa: bool  # MLA written absorbed: one KV head
    permute_qk: bool
    metadata: tuple[str, ...]  # the architecture's own keys, in written order

    @classmethod
    def of(cls, section: dict) -> GgufPart:
        return cls(arch=section["arch"], naming=section["naming"], feed_forward_length=section["feed_forward_length"],
                   mla_mqa=bool(section.get("mla_mqa")), permute_qk=bool(section.get("permute_qk")),
                   metadata=tuple(section["metadata"]))


@dataclass(frozen=True)
class ClassesPart:
    """The spec's ``classes`` section: the upstream class names the module tree and the rule checks use. A name
    left out of the spec is ``None`` here and the caller's ``<prefix>...`` default applies."""

    prefix: str
    transformers_type: str | None
    transformers_module: str | None
    ktransformers_module: str | None  # ktransformers' own modeling file (None: it has none for this family)
    expert: str | None
    moe_block: dict  # {transformers, ktransformers} class pair, possibly empty
    gate: dict
    rotary_yarn: str | None
    tree_rotary: str | None
    linear_attention: str | None
    causal_lm: str | None

    @classmethod
    def of(cls, section: dict) -> ClassesPart:
        get = section.get
        return cls(prefix=section["prefix"], transformers_type=get("transformers_type"),
                   transformers_module=get("transformers_module"), ktransformers_module=get("ktransformers_module"),
                   expert=get("expert"), moe_block=dict(get("moe_block") or {}), gate=dict(get("gate") or {}),
                   rotary_yarn=get("rotary_yarn"), tree_rotary=get("tree_rotary"),
                   linear_attention=get("linear_attention"), causal_lm=get("causal_lm"))


@dataclass(frozen=True)
class ActivationPart:
    """The spec's ``moe.activation``: the experts' clamped SwiGLU when it is not down(silu(gate) * up)."""

    kind: str  # swiglu_clamped | silu_clamped
    alpha: dict | None  # a choice: {key, default} read from config.json, or {fixed}
    limit: dict
    hidden_act: str  # config.json's hidden_act spelling accepted besides silu
    shared: bool  # the shared experts use it too
    dense: bool  # the dense MLP layers use it too
    kt_methods: tuple[str, ...]  # kt-kernel methods that compute it when sglang-kt launches the family

    @classmethod
    def of(cls, section: dict | None) -> ActivationPart | None:
        if not section:
            return None
        return cls(kind=section["kind"], alpha=section.get("alpha"), limit=section["limit"],
                   hidden_act=section.get("hidden_act", "silu"), shared=bool(section.get("shared")),
                   dense=bool(section.get("dense")), kt_methods=tuple(section.get("kt_methods", ())))

    def limit_in(self, config: dict, default=None):
        """The clamp limit a (text-view) config.json gives: the fixed value, else its key, else ``default`` (the
        spec's own default when ``default`` is None)."""
        if "fixed" in self.limit:
            return self.limit["fixed"]
        return config.get(self.limit["key"], self.limit["default"] if default is None else default)
