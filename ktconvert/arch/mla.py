"""Multi-head latent attention (spec ``attention.kind: mla``): DeepSeek's compressed KV latent, the optional q LoRA,
and the DeepSeek Sparse Attention indexer (``attention.dsa_indexer``; k-pools and shared layers: GLM-5-Next).
Its part of the config is ``MoeConfig.attention.mla`` (:class:`MlaDims`) with ``q_lora_rank``,
``qk_rope_head_dim``, the DSA ``indexer`` with its ``shared_layers``, parsed here (:func:`parse`, :func:`parse_shared`). Torch: ``model/modules.py``
``MLAttention``."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ktconvert.arch.base import Add, AttentionMechanism, Getter, ParseContext, Parsed, ParseStep, layer_prefix, when
from ktconvert.arch.indexer import COUNT_LIMITS as INDEXER_LIMITS, IndexerDims, indexer_dims, indexer_source, indexer_types
from ktconvert.errors import InputError

if TYPE_CHECKING:  # arch sits below families (docs/developing/layout.md): the type only, no import
    from ktconvert.families.config import MoeConfig


@dataclass(frozen=True)
class MlaDims:
    """Multi-head latent attention (DeepSeek): the compressed KV latent and the per-head split of q / k / v. The
    query latent (``q_lora_rank``) and the rotated width (``qk_rope_head_dim``) are fields of
    ``MoeConfig.attention`` beside it: the DSA indexer and DeepSeek-V4's compressed MQA read them too."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True
    latent_norm_eps: float = 1e-6  # the q_a / kv_a layernorms' eps (attention.latent_norm_eps)


def parse(ctx: ParseContext) -> Parsed | None:
    """``MoeConfig``'s MLA part (spec ``attention.kind: mla``): the query latent, the rotated width, :class:`MlaDims`
    and, where the spec's ``attention`` names a DSA indexer, its sizes."""
    g, raw, facts, layers, path = ctx.g, ctx.raw, ctx.attention_spec, ctx.layers, ctx.path
    if facts["kind"] != "mla":
        return None
    heads, kv_heads, rms_norm_eps = ctx.heads, ctx.kv_heads, ctx.rms_norm_eps
    q_lora = g.opt("q_lora_rank")
    interleave_key = facts.get("rope_interleave_key")
    latent_eps = rms_norm_eps if facts.get("latent_norm_eps") == "rms_norm_eps" else 1e-6
    kwargs = dict(
        q_lora_rank=None if q_lora in (None, 0) else int(q_lora),
        qk_rope_head_dim=g.int("qk_rope_head_dim"),
        mla=MlaDims(kv_lora_rank=g.int("kv_lora_rank"), qk_nope_head_dim=g.int("qk_nope_head_dim"),
                    v_head_dim=g.int("v_head_dim"),
                    rope_interleave=bool(g.opt(interleave_key, True)) if interleave_key else True,
                    latent_norm_eps=latent_eps),
    )
    if facts.get("dsa_indexer"):
        kwargs["indexer"] = _dsa_indexer(g, raw, layers, int(kwargs["qk_rope_head_dim"]), path,
                                         kpool=bool(facts.get("dsa_kpool")), shared=bool(facts.get("dsa_shared")))
        if kwargs["q_lora_rank"] is None:
            raise InputError("the DSA indexer reads the q LoRA latent: q_lora_rank must be set", path=path,
                             where="q_lora_rank")
    if kv_heads != heads:
        raise InputError(
            f"MLA expands keys per attention head: num_key_value_heads ({kv_heads}) must equal num_attention_heads ({heads})",
            path=path,
            where="num_key_value_heads",
        )
    return {"attention": kwargs}


def _dsa_indexer(g: Getter, raw: dict, layers: int, rope_dim: int, path: str | None, *, kpool: bool = False,
             shared: bool = False) -> IndexerDims:
    """The DSA indexer's sizes; every layer must run its own indexer (``indexer_types`` all ``full``). With k-pools
    (``attention.dsa_kpool``) ``index_topk`` counts keys and must be a multiple of ``index_kpool`` (as transformers
    checks)."""
    extra = {}
    if kpool:
        extra = dict(kpool=g.int("index_kpool") if "index_kpool" in raw else 16,
                     kpool_tail=bool(g.opt("index_kpool_always_select_tail", True)))
        if extra["kpool"] < 1 or g.int("index_topk") % extra["kpool"]:
            raise InputError(f"index_topk ({raw.get('index_topk')}) must be a positive multiple of index_kpool "
                             f"({extra['kpool']})", path=path, where="index_topk",
                             fix="set index_topk to a multiple of index_kpool")
    types = raw.get("indexer_types")
    if shared or types is not None:  # what the GGUF's indexer.types key is written from
        src, freq, offset = indexer_source(raw)
        extra.update(types=tuple(src) if isinstance(src, list) else src, topk_freq=freq, skip_offset=offset,
                     types_written=types is not None)
    dims = indexer_dims(g, rope_dim, path, **extra)
    if shared:  # checked with the layer kinds (parse_shared)
        return dims
    if types is not None and (not isinstance(types, list) or len(types) != layers or set(types) != {"full"}):
        raise InputError("only indexer_types of all \"full\" layers are supported (a \"shared\" layer reuses another "
                         "layer's selection)", path=path, where="indexer_types")
    return dims


def parse_shared(ctx: ParseContext) -> Parsed | None:
    """The DSA indexer's shared layers (spec ``attention.dsa_shared``), checked with the layer kinds Kimi Delta
    Attention parsed (a step after it)."""
    if not ctx.attention_spec.get("dsa_shared"):
        return None
    kinds = ctx.attention.get("layer_types") or ("indexed_attention",) * ctx.layers
    indexer = ctx.attention["indexer"]
    return {"attention": {"indexer": replace(indexer, shared_layers=_shared_layers(ctx.raw, ctx.layers, kinds,
                                                                                     ctx.path))}}


def _shared_layers(raw: dict, layers: int, kinds, path: str | None) -> tuple[int, ...]:
    """The attention layers that reuse the DSA selection of the layer right before them (``shared``); that layer must
    be an attention layer running its own indexer (transformers passes the selection only between neighbours)."""
    types = indexer_types(raw, layers)
    if not isinstance(types, list) or len(types) != layers or any(t not in ("full", "shared") for t in types):
        raise InputError(f"indexer_types must list {layers} entries of full / shared, got {types!r}", path=path,
                         where="indexer_types")
    shared = tuple(i for i, t in enumerate(types) if t == "shared" and kinds[i] != "linear_attention")
    for i in shared:
        if i == 0 or kinds[i - 1] == "linear_attention" or i - 1 in shared:
            raise InputError(f"layer {i} reuses the DSA selection of layer {i - 1}, which runs no indexer of its own",
                             path=path, where="indexer_types", fix=f"mark layer {i} full")
    return shared


class Mla(AttentionMechanism):
    name = "mla"
    parsers = (ParseStep(10, parse), ParseStep(40, parse_shared))

    def head_dims(self, g: Getter, facts: dict, hidden: int, heads: int, path: str | None) -> tuple[int, int]:
        """Rope rotates the ``qk_rope_head_dim`` part of each head (the core's head_dim is that width)."""
        rope_dim = g.int("qk_rope_head_dim")
        return rope_dim, rope_dim
    # the query latent and the rotated width are compressed MQA's keys too; the indexer's with them (DSA's, and the
    # lightning and MSA indexers' transformers spelling)
    count_limits = {"q_lora_rank": (0, 1 << 16), "kv_lora_rank": (1, 1 << 16), "qk_nope_head_dim": (0, 1 << 14),
                    "qk_rope_head_dim": (0, 1 << 14), "v_head_dim": (1, 1 << 14), **INDEXER_LIMITS}

    def layer_tensors(self, cfg: MoeConfig, layer: int, add: Add, *, experts: bool = True) -> None:
        a, h, mla = f"{layer_prefix(layer)}.self_attn", cfg.hidden_size, cfg.attention.mla
        qk = mla.qk_nope_head_dim + cfg.attention.qk_rope_head_dim
        nh = cfg.num_attention_heads
        if cfg.attention.q_lora_rank is None:
            add(f"{a}.q_proj.weight", (nh * qk, h), "linear")
        else:
            add(f"{a}.q_a_proj.weight", (cfg.attention.q_lora_rank, h), "linear")
            add(f"{a}.q_a_layernorm.weight", (cfg.attention.q_lora_rank,), "norm")
            add(f"{a}.q_b_proj.weight", (nh * qk, cfg.attention.q_lora_rank), "linear")
        add(f"{a}.kv_a_proj_with_mqa.weight", (mla.kv_lora_rank + cfg.attention.qk_rope_head_dim, h), "linear")
        add(f"{a}.kv_a_layernorm.weight", (mla.kv_lora_rank,), "norm")
        add(f"{a}.kv_b_proj.weight", (nh * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank), "linear")
        add(f"{a}.o_proj.weight", (h, nh * mla.v_head_dim), "out_linear")
        if cfg.attention.indexer is not None and layer not in cfg.attention.indexer.shared_layers:  # a shared layer has no indexer
            d, ix = cfg.attention.indexer, f"{a}.indexer"
            add(f"{ix}.wq_b.weight", (d.n_heads * d.head_dim, cfg.attention.q_lora_rank), "linear")
            add(f"{ix}.wk.weight", (d.head_dim, h), "linear")
            add(f"{ix}.k_norm.weight", (d.head_dim,), "norm")
            add(f"{ix}.k_norm.bias", (d.head_dim,), "bias")
            add(f"{ix}.weights_proj.weight", (d.n_heads, h), "linear")
            if d.kpool:
                add(f"{ix}.index_kpool_compress_ape", (d.kpool, d.head_dim), "sink")
                add(f"{ix}.index_kpool_compress_gate", (d.head_dim, h), "linear")

    def layer_modules(self, node, cfg: MoeConfig) -> None:
        pre = cfg.spec.prefix
        attn = node.add("self_attn", f"{pre}Attention")
        if cfg.attention.q_lora_rank:
            attn.add("q_a_proj", "Linear")
            attn.add("q_a_layernorm", f"{pre}RMSNorm")
            attn.add("q_b_proj", "Linear")
        else:
            attn.add("q_proj", "Linear")
        attn.add("kv_a_proj_with_mqa", "Linear")
        attn.add("kv_a_layernorm", f"{pre}RMSNorm")
        attn.add("kv_b_proj", "Linear")
        attn.add("o_proj", "Linear")
        if cfg.attention.qk_rope_head_dim:  # NoPE MLA (GLM-5-Next) has no rotary module
            attn.add("rotary_emb", cfg.spec.classes.tree_rotary or f"{pre}RotaryEmbedding")
        if cfg.attention.indexer is not None and node.layer not in cfg.attention.indexer.shared_layers:
            ix = attn.add("indexer", f"{pre}Indexer")
            ix.add("wq_b", "Linear")
            ix.add("wk", "Linear")
            ix.add("k_norm", "LayerNorm")
            ix.add("weights_proj", "Linear")

    gguf_keys = {
        # 0: no q LoRA (V2-Lite style q_proj); llama.cpp requires the key
        "q_lora_rank": lambda w, c, n: w.add_q_lora_rank(c.attention.q_lora_rank or 0),
        "kv_lora_rank": lambda w, c, n: w.add_kv_lora_rank(c.attention.mla.kv_lora_rank),
        "mla_key_length": lambda w, c, n: w.add_key_length(c.attention.mla.qk_nope_head_dim + c.attention.qk_rope_head_dim),
        "mla_value_length": lambda w, c, n: w.add_value_length(c.attention.mla.v_head_dim),
        "mla_rope_dimension_count": lambda w, c, n: w.add_rope_dimension_count(c.attention.qk_rope_head_dim),
        # llama.cpp's absorbed MLA (MQA over the latent): K = latent + rope, V = latent; then the decompressed heads
        "mqa_key_length": lambda w, c, n: w.add_key_length(c.attention.mla.kv_lora_rank + c.attention.qk_rope_head_dim),
        "mqa_value_length": lambda w, c, n: w.add_value_length(c.attention.mla.kv_lora_rank),
        "key_length_mla": lambda w, c, n: w.add_key_length_mla(c.attention.mla.qk_nope_head_dim + c.attention.qk_rope_head_dim),
        "value_length_mla": lambda w, c, n: w.add_value_length_mla(c.attention.mla.v_head_dim),
        # DSA indexer (GLM-5); llama.cpp reads indexer.types when written, else every layer runs its own indexer
        "indexer": lambda w, c, n: (
            w.add_indexer_head_count(c.attention.indexer.n_heads), w.add_indexer_key_length(c.attention.indexer.head_dim),
            w.add_indexer_top_k(c.attention.indexer.topk),
            when(c.attention.indexer.kpool, lambda: (
                w.add_uint32(f"{w.arch}.attention.indexer.kpool", c.attention.indexer.kpool),
                w.add_bool(f"{w.arch}.attention.indexer.kpool_select_tail", c.attention.indexer.kpool_tail))),
            when(c.attention.indexer.types_written or c.attention.indexer.shared_layers, lambda: w.add_array(
                f"{w.arch}.attention.indexer.types", c.attention.indexer.full_layers(n)))),
        # the DSA indexer LayerNorm's fixed eps (what llama.cpp's Glm5NextModel converter writes)
        "layer_norm_epsilon": lambda w, c, n: w.add_layer_norm_eps(1e-6),
    }


MECHANISM = Mla()
