"""Which upstream classes each reference module stands for, so rule ``match.class`` works as upstream.

Upstream ktransformers matches ``match.class`` with ``isinstance`` against its own modeling files
(``ktransformers.models.modeling_deepseek_v3.MoEGate``, ...) and, in some rule files, against transformers'
(``transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock``). A reference module carries
``hf_class`` (the short name rule files use) and ``hf_class_paths`` (every dotted name an upstream
``isinstance`` check would accept for the module it replaces, subclasses included). Pure data: no torch.
"""

from __future__ import annotations

ROLES = (
    "causal_lm",
    "model",
    "decoder_layer",
    "attention",
    "rotary",
    "rmsnorm",
    "mlp",  # dense MLP, shared experts, and each routed expert
    "moe_block",
    "gate",
    "experts",
)

_PREFIX = {
    "qwen2_moe": "Qwen2Moe",
    "qwen3_moe": "Qwen3Moe",
    "mixtral": "Mixtral",
    "deepseek_v2": "DeepseekV2",
    "deepseek_v3": "DeepseekV3",
}

# ktransformers keeps its own copies of the modeling files; DeepSeek-V2's is named modeling_deepseek.
_KT_MODULE = {
    "qwen2_moe": "ktransformers.models.modeling_qwen2_moe",
    "qwen3_moe": "ktransformers.models.modeling_qwen3_moe",
    "mixtral": "ktransformers.models.modeling_mixtral",
    "deepseek_v2": "ktransformers.models.modeling_deepseek",
    "deepseek_v3": "ktransformers.models.modeling_deepseek_v3",
}


def _tf_module(family: str) -> str:
    return f"transformers.models.{family}.modeling_{family}"


def _names(family: str, role: str, *, yarn: bool, expert: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(upstream ktransformers / remote-code class names, transformers 5 class names) for a role."""
    p = _PREFIX[family]
    ds = family.startswith("deepseek")
    if role in ("causal_lm", "model", "decoder_layer", "attention", "rmsnorm"):
        suffix = {
            "causal_lm": "ForCausalLM",
            "model": "Model",
            "decoder_layer": "DecoderLayer",
            "attention": "Attention",
            "rmsnorm": "RMSNorm",
        }[role]
        return (p + suffix,), (p + suffix,)
    if role == "rotary":
        kt = (p + "YarnRotaryEmbedding", p + "RotaryEmbedding") if (ds and yarn) else (p + "RotaryEmbedding",)
        return kt, (p + "RotaryEmbedding",)
    if role == "mlp":
        if family == "mixtral":
            # routed experts of Mixtral; transformers 5 fuses them and has no per-expert class
            return ("MixtralBlockSparseTop2MLP",), ()
        # transformers 5 fuses routed experts too: only dense and shared MLPs are its <P>MLP
        return (p + "MLP",), (() if expert else (p + "MLP",))
    if role == "moe_block":
        if ds:
            return (p + "MoE",), (("DeepseekV2Moe",) if family == "deepseek_v2" else ("DeepseekV3MoE",))
        return (p + "SparseMoeBlock",), (p + "SparseMoeBlock",)
    if role == "gate":
        if ds:
            return ("MoEGate",), (p + "TopkRouter",)
        return (), (p + "TopKRouter",)  # upstream: a plain torch.nn.Linear
    if role == "experts":
        return (), (p + "Experts",)  # upstream: a plain torch.nn.ModuleList
    raise ValueError(f"unknown role {role!r}")


def class_names(family: str, role: str, *, yarn: bool = False, expert: bool = False) -> tuple[str, tuple[str, ...]]:
    """``(hf_class, hf_class_paths)`` for a module of ``role`` in ``family``.

    ``hf_class`` is the short name upstream rule files use for it (transformers 5's where upstream uses a
    plain torch container); ``hf_class_paths`` holds every dotted path an upstream ``isinstance`` accepts.
    ``yarn``: the model uses YaRN rope (DeepSeek's rotary class is then a Yarn subclass); ``expert``: the
    MLP is a routed expert.
    """
    kt, tf = _names(family, role, yarn=yarn, expert=expert)
    paths = tuple(f"{_KT_MODULE[family]}.{n}" for n in kt) + tuple(f"{_tf_module(family)}.{n}" for n in tf)
    primary = kt[0] if kt else tf[0]
    return primary, paths
