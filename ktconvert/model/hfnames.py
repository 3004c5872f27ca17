"""Which upstream classes each reference module stands for, so rule ``match.class`` works as upstream.

Upstream ktransformers matches ``match.class`` with ``isinstance`` against its own modeling files
(``ktransformers.models.modeling_deepseek_v3.MoEGate``, ...) and, in some rule files, against transformers'
(``transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock``). A reference module carries
``hf_class`` (the short name rule files use) and ``hf_class_paths`` (every dotted name an upstream
``isinstance`` check would accept for the module it replaces, subclasses included). Pure data: no torch.
"""

from __future__ import annotations

from ktconvert import families

ROLES = (
    "causal_lm",
    "model",
    "decoder_layer",
    "attention",
    "linear_attention",  # Gated DeltaNet layers of hybrid families
    "rotary",
    "rmsnorm",
    "gated_rmsnorm",  # Gated DeltaNet's output norm
    "indexer",  # DSA sparse-attention indexer
    "mlp",  # dense MLP, shared experts, and each routed expert
    "moe_block",
    "gate",
    "experts",
)

def classes_module(family: str) -> str | None:
    """ktransformers keeps its own copies of the modeling files (DeepSeek-V2's is named modeling_deepseek);
    ``None`` for a family it has none for."""
    return families.spec(family).classes.ktransformers_module


def _tf_module(family: str) -> str:
    """transformers' modeling module of the family's classes (the spec's ``classes.transformers_module``, else the
    module named after the family)."""
    return (families.spec(family).classes.transformers_module
            or f"transformers.models.{family}.modeling_{family}")


def _names(family: str, role: str, *, yarn: bool, expert: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(upstream ktransformers / remote-code class names, transformers 5 class names) for a role."""
    kt, tf = _all_names(family, role, yarn=yarn, expert=expert)
    return (kt if classes_module(family) else ()), tf


def _all_names(family: str, role: str, *, yarn: bool, expert: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
    sp = families.spec(family)
    classes = sp.classes
    p = sp.prefix
    if role in ("causal_lm", "model", "decoder_layer", "attention", "linear_attention", "rmsnorm", "gated_rmsnorm",
                "indexer", "hyper_connection", "hyper_head", "csa_compressor", "hca_compressor", "hash_gate", "indexer_scorer"):
        suffix = {
            "causal_lm": "ForCausalLM",
            "model": "Model",
            "decoder_layer": "DecoderLayer",
            "attention": "Attention",
            "linear_attention": "GatedDeltaNet",
            "rmsnorm": "RMSNorm",
            "gated_rmsnorm": "RMSNormGated",
            "indexer": "Indexer",
            "hyper_connection": "HyperConnection",
            "hyper_head": "HyperHead",
            "csa_compressor": "CSACompressor",
            "hca_compressor": "HCACompressor",
            "hash_gate": "HashRouter",
            "indexer_scorer": "IndexerScorer",
        }[role]
        # a spec may name a class that does not follow <prefix><Role> (classes.causal_lm / linear_attention)
        name = getattr(classes, role) if role in ("causal_lm", "linear_attention") else None
        return ((name,), (name,)) if name else ((p + suffix,), (p + suffix,))
    if role == "rotary":
        kt = (classes.rotary_yarn, p + "RotaryEmbedding") if (yarn and classes.rotary_yarn) else (p + "RotaryEmbedding",)
        return kt, (p + "RotaryEmbedding",)
    if role == "mlp":
        if expert and classes.expert:
            # a family whose routed experts have their own class (Mixtral); transformers 5 fuses them
            return (classes.expert,), ()
        # transformers 5 fuses routed experts too: only dense and shared MLPs are its <P>MLP
        return (p + "MLP",), (() if expert else (p + "MLP",))
    if role == "moe_block":
        if classes.moe_block:
            return _pair(classes.moe_block)
        return (p + "SparseMoeBlock",), (p + "SparseMoeBlock",)
    if role == "gate":
        if classes.gate:
            return _pair(classes.gate)
        return (), (p + "TopKRouter",)  # upstream: a plain torch.nn.Linear
    if role == "experts":
        return (), (p + "Experts",)  # upstream: a plain torch.nn.ModuleList
    raise ValueError(f"unknown role {role!r}")


def _pair(pair: dict) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return ((pair["ktransformers"],) if "ktransformers" in pair else ()), (pair["transformers"],)


def class_names(family: str, role: str, *, yarn: bool = False, expert: bool = False) -> tuple[str, tuple[str, ...]]:
    """``(hf_class, hf_class_paths)`` for a module of ``role`` in ``family``.

    ``hf_class`` is the short name upstream rule files use for it (transformers 5's where upstream uses a
    plain torch container); ``hf_class_paths`` holds every dotted path an upstream ``isinstance`` accepts.
    ``yarn``: the model uses YaRN rope (DeepSeek's rotary class is then a Yarn subclass); ``expert``: the
    MLP is a routed expert.
    """
    kt, tf = _names(family, role, yarn=yarn, expert=expert)
    paths = tuple(f"{classes_module(family)}.{n}" for n in kt) + tuple(f"{_tf_module(family)}.{n}" for n in tf)
    primary = kt[0] if kt else (tf[0] if tf else None)
    return primary, paths
