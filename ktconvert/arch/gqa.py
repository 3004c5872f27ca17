"""Full softmax attention with grouped KV heads (spec ``attention.kind: gqa``, and the full-attention layers of a
Gated DeltaNet hybrid): optional output gate, biases, sinks, q/k norms (per head or over the projection), sliding
window (``MoeConfig.attention.sliding_window`` / ``sliding_layers``, parsed here by :func:`parse_window`), and
MiniMax Sparse Attention's indexer on the layers that run it (``MoeConfig.attention.indexer`` with its
``sparse_layers``, parsed here by :func:`parse_msa`). Torch: ``model/modules.py`` ``Attention``."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from ktconvert.arch.base import Add, AttentionMechanism, ParseContext, Parsed, ParseStep, layer_prefix, norm_role, when
from ktconvert.arch.indexer import IndexerDims
from ktconvert.errors import InputError

if TYPE_CHECKING:  # arch sits below families (docs/developing/layout.md): the type only, no import
    from ktconvert.families.config import MoeConfig


_KEYS = {"index_n_heads": "sparse_num_index_heads", "index_head_dim": "sparse_index_dim",
             "index_block_size": "sparse_block_size", "index_topk_blocks": "sparse_topk_blocks",
             "index_local_blocks": "sparse_local_block"}
_LAYER = "minimax_m3_sparse"


def parse_msa(ctx: ParseContext) -> Parsed | None:
    """MiniMax Sparse Attention's indexer sizes and layers (spec ``attention.msa_indexer``), from transformers'
    ``index_*`` / ``layer_types`` or the hub's ``sparse_attention_config`` (``sparse_*``, ``sparse_attention_freq``),
    whichever the config holds."""
    if not ctx.attention_spec.get("msa_indexer"):
        return None
    raw, layers, kv_heads, rope_dim, moe_layers, path = (ctx.raw, ctx.layers, ctx.kv_heads, ctx.rope_dim,
                                                         ctx.moe_layers, ctx.path)
    hub = raw.get("sparse_attention_config")
    hub = hub if isinstance(hub, dict) else {}
    vals = {}
    for key, legacy in _KEYS.items():
        v = hub.get(legacy, raw.get(key))
        if isinstance(v, bool) or not isinstance(v, int) or v < (0 if key == "index_local_blocks" else 1):
            raise InputError(f"{key} (sparse_attention_config.{legacy}) must be a "
                             f"{'non-negative' if key == 'index_local_blocks' else 'positive'} integer, got {v!r}",
                             path=path, where=key)
        vals[key] = v
    dims = IndexerDims(n_heads=vals["index_n_heads"], head_dim=vals["index_head_dim"], topk=vals["index_topk_blocks"],
                       block_size=vals["index_block_size"], local_blocks=vals["index_local_blocks"])
    if dims.n_heads != kv_heads:
        raise InputError(f"index_n_heads={dims.n_heads} must equal num_key_value_heads={kv_heads} (one indexer head "
                         "per KV group)", path=path, where="index_n_heads")
    if dims.head_dim < rope_dim:
        raise InputError(f"index_head_dim={dims.head_dim} must hold the {rope_dim} rotated dims", path=path,
                         where="index_head_dim")
    freq = hub.get("sparse_attention_freq")
    types = raw.get("layer_types")
    if freq is not None:
        ok = isinstance(freq, list) and len(freq) == layers
        sparse = tuple(i for i, f in enumerate(freq) if f) if ok else ()
    elif types is not None:
        ok = isinstance(types, list) and len(types) == layers and set(types) <= {_LAYER, "full_attention"}
        sparse = tuple(i for i, t in enumerate(types) if t == _LAYER) if ok else ()
    else:
        ok, sparse = True, ()
    if not ok:
        raise InputError(f"layer_types (sparse_attention_config.sparse_attention_freq) must list {layers} entries of "
                         f"{_LAYER} / full_attention", path=path, where="layer_types")
    sparse_dense = [i for i in sparse if i not in moe_layers]
    if sparse_dense:
        raise InputError(f"dense MLP layers {sparse_dense} run MiniMax Sparse Attention: llama.cpp's minimax-m3 "
                         "attends fully on its leading dense layers and holds no indexer there", path=path,
                         where="layer_types", fix="mark the dense layers full_attention (sparse_attention_freq 0)")
    return {"attention": {"indexer": replace(dims, sparse_layers=sparse)}}


def parse_window(raw: dict, rule: str, layers: int, path: str | None) -> tuple[int | None, tuple[int, ...]]:
    """``(window, sliding layers)`` where the spec's ``config.sliding_window`` (``rule``) models the window per layer
    (``layer_types``); elsewhere the window is not modelled and a config where it would change results is refused."""
    if rule != "layer_types":
        _refuse_window(raw, rule, path)
        return None, ()
    window, types = raw.get("sliding_window"), raw.get("layer_types")
    if not window:
        return None, ()
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise InputError(f"sliding_window must be a positive integer, got {window!r}", path=path, where="sliding_window")
    kinds = ("sliding_attention", "full_attention")
    if not isinstance(types, list) or len(types) != layers or any(t not in kinds for t in types):
        raise InputError(f"layer_types must list {layers} entries of {' / '.join(kinds)}, got {types!r}", path=path,
                         where="layer_types", fix="write the layer_types transformers saves for this model")
    return int(window), tuple(i for i, t in enumerate(types) if t == "sliding_attention")


def _refuse_window(raw: dict, rule: str, path: str | None) -> None:
    """Sliding-window attention is not modelled; refuse configs where it would change results."""
    window = raw.get("sliding_window")
    if rule == "use_flag":
        active = bool(raw.get("use_sliding_window", False)) and bool(window)
    elif rule == "window":
        active = bool(window)
    else:
        active = False
    if active:
        raise InputError(
            f"sliding-window attention (sliding_window={window}) is not supported by the reference models",
            path=path,
            where="sliding_window",
            fix="set use_sliding_window=false / sliding_window=null if the window exceeds your prompts",
        )


class Gqa(AttentionMechanism):
    name = "gqa"
    parsers = (ParseStep(60, parse_msa),)  # its window is the core's (parse_window: every family's spec rules on it)

    def layer_tensors(self, cfg: MoeConfig, layer: int, add: Add, *, experts: bool = True) -> None:
        a, h, norm = f"{layer_prefix(layer)}.self_attn", cfg.hidden_size, norm_role(cfg)
        hd, nh, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        gated_q = 2 if cfg.spec.attention.output_gate else 1
        for proj, rows in (("q_proj", nh * hd * gated_q), ("k_proj", nkv * hd), ("v_proj", nkv * hd)):
            add(f"{a}.{proj}.weight", (rows, h), "linear")
            if proj in cfg.attention_bias_on:
                add(f"{a}.{proj}.bias", (rows,), "bias")
        add(f"{a}.o_proj.weight", (h, nh * hd), "out_linear")
        if "o_proj" in cfg.attention_bias_on:
            add(f"{a}.o_proj.bias", (h,), "out_bias")
        if cfg.spec.attention.sinks:
            add(f"{a}.sinks", (nh,), "sink")
        if cfg.attention.qk_norm:
            whole = cfg.spec.attention.qk_norm_whole
            add(f"{a}.q_norm.weight", (nh * hd if whole else hd,), norm)
            add(f"{a}.k_norm.weight", (nkv * hd if whole else hd,), norm)
        if cfg.attention.indexer is not None and layer in cfg.attention.indexer.sparse_layers:  # MiniMax Sparse Attention's indexer, flat in self_attn as released
            d = cfg.attention.indexer
            add(f"{a}.index_q_proj.weight", (d.n_heads * d.head_dim, h), "linear")
            add(f"{a}.index_k_proj.weight", (d.head_dim, h), "linear")
            add(f"{a}.index_q_norm.weight", (d.head_dim,), norm)
            add(f"{a}.index_k_norm.weight", (d.head_dim,), norm)

    def layer_modules(self, node, cfg: MoeConfig) -> None:
        pre = cfg.spec.prefix
        attn = node.add("self_attn", f"{pre}Attention")
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            attn.add(name, "Linear")
        if cfg.attention.qk_norm:
            attn.add("q_norm", f"{pre}RMSNorm")
            attn.add("k_norm", f"{pre}RMSNorm")
        attn.add("rotary_emb", f"{pre}RotaryEmbedding")
        if cfg.attention.indexer is not None and node.layer in cfg.attention.indexer.sparse_layers:
            attn.add("index_q_proj", "Linear")
            attn.add("index_k_proj", "Linear")
            attn.add("index_q_norm", f"{pre}RMSNorm")
            attn.add("index_k_norm", f"{pre}RMSNorm")

    gguf_keys = {
        # the window and which layers use it (llama.cpp reads the per-layer pattern before its architecture default)
        "sliding_window": lambda w, c, n: when(c.attention.sliding_window, lambda: (
            w.add_sliding_window(c.attention.sliding_window),
            w.add_sliding_window_pattern([i in c.attention.sliding_layers for i in range(n)]))),
        # MiniMax Sparse Attention: the indexer and its block selection (llama.cpp reads all five)
        "msa_indexer": lambda w, c, n: (
            w.add_indexer_head_count(c.attention.indexer.n_heads), w.add_indexer_key_length(c.attention.indexer.head_dim),
            w.add_indexer_top_k(c.attention.indexer.topk),
            w.add_uint32(f"{w.arch}.attention.indexer.block_size", c.attention.indexer.block_size),
            w.add_uint32(f"{w.arch}.attention.indexer.local_blocks", c.attention.indexer.local_blocks)),
    }


MECHANISM = Gqa()
