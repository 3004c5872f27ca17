"""The few model dimensions layout detection needs, read from ``config.json`` or from GGUF metadata.

Hub configs and transformers-5 configs spell the same number differently (Qwen3-MoE: ``num_experts`` on the hub,
``num_local_experts`` when transformers 5 saves it; Mixtral's expert width is ``intermediate_size``), and
multimodal configs nest the text model under ``text_config``; this module is the one place that knows.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ktconvert import families
from ktconvert.arch.dense_mlp import moe_layers_of
from ktconvert.families.limits import check_counts, check_gguf_counts
from ktconvert.io.datafile import read_json

# HF model_type -> llama.cpp architecture name (general.architecture), from each family's spec.
HF_TO_GGUF_ARCH = {f: families.spec(f).gguf_arch for f in families.FAMILIES}


@dataclass(frozen=True)
class ModelDims:
    """Expected sizes; any field may be ``None`` when the source does not say."""

    source: str
    model_type: str | None = None
    arch: str | None = None
    hidden_size: int | None = None
    moe_intermediate_size: int | None = None
    n_experts: int | None = None
    n_experts_used: int | None = None
    n_shared_experts: int | None = None
    shared_expert_width: int | None = None  # a GGUF's expert_shared_feed_forward_length (the Qwen shared expert's)
    n_layers: int | None = None
    moe_layers: frozenset[int] | None = None  # layers that should hold routed experts
    n_mtp_layers: int = 0  # of n_layers, the multi-token-prediction layers at the end (a GGUF's nextn_predict_layers)
    fused_orientation: str | None = None  # the family's published packed-expert orientation (standard / transposed)

    def is_moe_layer(self, layer: int) -> bool | None:
        return None if self.moe_layers is None else layer in self.moe_layers


def _int(v) -> int | None:
    return v if type(v) is int else None


def _int_keys(cfg: dict) -> dict:
    """The layer-placement keys as this module reads them: a non-integer value counts as absent."""
    keys = ("first_k_dense_replace", "moe_layer_freq", "decoder_sparse_step")
    lists = ("mlp_only_layers", "mlp_layer_types", "moe_layer_freq")  # per-layer lists (moe_layer_freq: MiniMax-M3's)
    return {**{k: _int(cfg.get(k)) for k in keys}, **{k: cfg[k] for k in lists if isinstance(cfg.get(k), list)}}


def load_config(path: str | Path) -> dict:
    """``config.json`` as written; its counts are checked on reading (:mod:`ktconvert.families.limits`)."""
    return checked_config(read_json(path, "config.json", fix=CONFIG_FIX), str(path))


CONFIG_FIX = "fix or re-download it, or check the --config path"


def checked_config(cfg, path: str):
    """``config.json`` as parsed (by :func:`load_config`, or from bytes a caller also hashes), its counts checked."""
    if isinstance(cfg, dict):
        check_counts(families.text_view(cfg), path)
    return cfg


def dims_from_hf_config(cfg: dict, source: str = "config.json") -> ModelDims:
    cfg = families.text_view(cfg)
    check_counts(cfg, source)
    model_type = cfg.get("model_type") if isinstance(cfg.get("model_type"), str) else None
    n_layers = _int(cfg.get("num_hidden_layers"))
    n_experts = next(
        (_int(cfg[k]) for k in ("n_routed_experts", "num_experts", "num_local_experts") if _int(cfg.get(k))), None
    )
    sp = families.find(model_type)
    inter = _int(cfg.get("moe_intermediate_size"))
    if inter is None and (sp is None or sp.expert_width_key == "intermediate_size"):
        inter = _int(cfg.get("intermediate_size"))  # e.g. Mixtral's experts are intermediate_size wide
    moe_layers = None
    if n_layers is not None and n_experts:
        # a family's own rule; another model type: DeepSeek's keys if present, else every layer is MoE
        if "first_k_dense_replace" in cfg:
            policy = "first_k_dense"
        else:
            policy = sp.dense_layers if sp is not None else "none"
        moe_layers = frozenset(moe_layers_of(policy, _int_keys(cfg), n_layers, n_experts, source))
    return ModelDims(
        source=source,
        model_type=model_type,
        arch=HF_TO_GGUF_ARCH.get(model_type or ""),
        hidden_size=_int(cfg.get("hidden_size")),
        moe_intermediate_size=inter,
        n_experts=n_experts,
        n_experts_used=_int(cfg.get("num_experts_per_tok")),
        n_shared_experts=_int(cfg.get("n_shared_experts")),
        n_layers=n_layers,
        moe_layers=moe_layers,
        fused_orientation=sp.fused_orientation if sp is not None else None,
    )


def dims_from_gguf(kv: dict, source: str = "GGUF metadata", path: str | None = None) -> ModelDims:
    arch = kv.get("general.architecture")
    if not isinstance(arch, str):
        return ModelDims(source=source)
    check_gguf_counts(kv, arch, path or source)

    def get(key: str) -> int | None:
        return _int(kv.get(f"{arch}.{key}"))

    n_layers = get("block_count")
    n_experts = get("expert_count")
    inter = get("expert_feed_forward_length")
    if inter is None and families.ffn_is_expert_width(arch):  # e.g. Mixtral GGUFs give it as the plain FFN length
        inter = get("feed_forward_length")
    moe_layers = None
    if n_layers is not None and n_experts:
        k = get("leading_dense_block_count") or 0
        moe_layers = frozenset(range(k, n_layers))
    return ModelDims(
        source=source,
        arch=arch,
        hidden_size=get("embedding_length"),
        moe_intermediate_size=inter,
        n_experts=n_experts,
        n_experts_used=get("expert_used_count"),
        n_shared_experts=get("expert_shared_count"),
        shared_expert_width=get("expert_shared_feed_forward_length"),
        n_layers=n_layers,
        moe_layers=moe_layers,
        n_mtp_layers=min(get("nextn_predict_layers") or 0, n_layers or 0),
    )
