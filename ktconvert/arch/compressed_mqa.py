"""Compressed sparse MQA (DeepSeek-V4, spec ``attention.kind: compressed_mqa``): q LoRA, one K=V projection, the
grouped output projection and per-head sinks; on a compressed layer the compressor (every closed window, or on the
indexer-ratio layers overlapping windows picked by its lightning indexer). Its part of the config is
``MoeConfig.attention.compressed`` (:class:`CompressedDims`) with the indexer, the q LoRA, the rotated width and the window,
parsed here (:func:`parse`, :func:`parse_rope_dim`, :func:`parse_ropes`). Torch: ``model/compressed.py``
``CompressedAttention``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ktconvert.arch.base import Add, AttentionMechanism, Getter, ParseContext, Parsed, ParseStep, layer_prefix
from ktconvert.arch.indexer import indexer_dims
from ktconvert.arch.rope import RopeSpec, parse_rope
from ktconvert.errors import InputError

if TYPE_CHECKING:  # arch sits below families (docs/developing/layout.md): the type only, no import
    from ktconvert.families.config import MoeConfig


@dataclass(frozen=True)
class CompressedDims:
    """Compressed sparse MQA (spec ``attention.kind: compressed_mqa``): per layer the compress ratio (0: window only;
    ``csa_ratio``: overlapping windows picked by the indexer; any other: every closed window), the rope of compressed
    layers, and the grouped output projection."""

    ratios: tuple[int, ...]
    csa_ratio: int
    compress_rope: RopeSpec
    o_groups: int
    o_lora_rank: int


_CSA, _HCA = "compressed_sparse_attention", "heavily_compressed_attention"
_RATIO_KINDS = {0: "sliding_attention", 4: _CSA, 128: _HCA}


def parse_rope_dim(raw: dict, head_dim: int, path: str | None) -> int:
    """The rotated tail of each head: the release's ``qk_rope_head_dim``, else transformers' ``partial_rotary_factor``
    (top level or in ``rope_parameters.main``)."""
    dim = raw.get("qk_rope_head_dim")
    if dim is None:
        params = raw.get("rope_parameters") if isinstance(raw.get("rope_parameters"), dict) else {}
        main = params.get("main") if isinstance(params.get("main"), dict) else params
        factor = main.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
        if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not 0 < factor <= 1:
            raise InputError("the rotated head size is missing: give qk_rope_head_dim (or partial_rotary_factor in "
                             "(0, 1])", path=path, where="qk_rope_head_dim")
        dim = int(head_dim * factor)
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 2 or dim % 2 or dim > head_dim:
        raise InputError(f"qk_rope_head_dim must be an even integer in 2..head_dim ({head_dim}), got {dim!r}",
                         path=path, where="qk_rope_head_dim")
    return dim


def parse_ropes(raw: dict, default_theta: float, dim: int, max_pos: int, path: str | None) -> tuple[RopeSpec, RopeSpec]:
    """``(main, compress)`` ropes: window-only layers rotate with ``rope_theta``, compressed layers (and their
    compressors and indexers) with ``compress_rope_theta`` and the release's ``rope_scaling`` (YaRN without its
    attention factor, as transformers 5.23 forces). transformers' nested ``rope_parameters`` {main, compress} too."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        main_raw, comp_raw = params["main"], params["compress"]
    else:
        scaling = raw.get("rope_scaling") if isinstance(raw.get("rope_scaling"), dict) else {}
        main_raw = {"rope_type": "default", "rope_theta": raw.get("rope_theta", default_theta)}
        comp_raw = {**scaling, "rope_theta": raw.get("compress_rope_theta", 160000.0)}
    comp_raw = dict(comp_raw)
    if comp_raw.get("rope_type", comp_raw.get("type")) == "yarn":
        comp_raw.setdefault("attention_factor", 1.0)
    main_raw = {k: v for k, v in main_raw.items() if k != "partial_rotary_factor"}
    comp_raw = {k: v for k, v in comp_raw.items() if k != "partial_rotary_factor"}
    main = parse_rope({"rope_parameters": main_raw}, default_theta, dim, max_pos, path)
    if main.kind != "default":
        raise InputError(f"the window-only layers' rope must be the default rope, got {main.kind!r}", path=path,
                         where="rope_parameters.main")
    return main, parse_rope({"rope_parameters": comp_raw}, default_theta, dim, max_pos, path)


def parse(ctx: ParseContext) -> Parsed | None:
    """Compressed sparse MQA (spec ``attention.kind: compressed_mqa``): per-layer compress ratios (the release's
    ``compress_ratios``, or transformers' ``layer_types`` + ``compress_rates``), the indexer, the window and the
    grouped output projection."""
    if ctx.attention_spec["kind"] != "compressed_mqa":
        return None
    g, raw, layers, heads, kv_heads, compress_rope, path = (ctx.g, ctx.raw, ctx.layers, ctx.heads, ctx.kv_heads,
                                                            ctx.compress_rope, ctx.path)
    if kv_heads != 1:
        raise InputError(f"compressed MQA has one shared K=V head: num_key_value_heads must be 1, got {kv_heads}",
                         path=path, where="num_key_value_heads")
    rates = raw.get("compress_rates") if isinstance(raw.get("compress_rates"), dict) else {}
    csa = rates.get(_CSA, raw.get("compress_rate_csa", 4))
    hca = rates.get(_HCA, raw.get("compress_rate_hca", 128))
    ratios, types = raw.get("compress_ratios"), raw.get("layer_types")
    if ratios is not None:
        ok = (isinstance(ratios, list) and len(ratios) >= layers
              and all(not isinstance(r, bool) and r in _RATIO_KINDS for r in ratios))
        if not ok:
            raise InputError(f"compress_ratios must list {layers} entries of 0 / 4 / 128, got {ratios!r}", path=path,
                             where="compress_ratios")
        ratios = tuple({0: 0, 4: csa, 128: hca}[r] for r in ratios[:layers])
    elif types is not None:
        kinds = {"sliding_attention": 0, _CSA: csa, _HCA: hca}
        if not isinstance(types, list) or len(types) < layers or any(t not in kinds for t in types[:layers]):
            raise InputError(f"layer_types must list {layers} entries of {' / '.join(kinds)}, got {types!r}",
                             path=path, where="layer_types")
        ratios = tuple(kinds[t] for t in types[:layers])
    else:
        raise InputError("compressed MQA needs each layer's compress ratio: give compress_ratios (or layer_types)",
                         path=path, where="compress_ratios")
    for name, v in (("compress_rates.compressed_sparse_attention", csa),
                    ("compress_rates.heavily_compressed_attention", hca)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InputError(f"{name} must be a positive integer, got {v!r}", path=path, where=name)
    if csa == hca:
        raise InputError(f"the two compress rates must differ (both {csa})", path=path, where="compress_rates")
    o_groups, o_lora = g.int("o_groups"), g.int("o_lora_rank")
    if o_groups < 1 or heads % o_groups:
        raise InputError(f"o_groups={o_groups} must divide num_attention_heads={heads}", path=path, where="o_groups")
    window = raw.get("sliding_window")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise InputError(f"sliding_window must be a positive integer, got {window!r}", path=path,
                         where="sliding_window")
    q_lora = g.int("q_lora_rank")
    rope_dim = compress_rope.dim
    indexer = indexer_dims(g, rope_dim, path)
    dims = CompressedDims(ratios=ratios, csa_ratio=csa, compress_rope=compress_rope, o_groups=o_groups,
                          o_lora_rank=o_lora)
    return {"attention": {"compressed": dims, "indexer": indexer, "q_lora_rank": q_lora, "qk_rope_head_dim": rope_dim,
                          "sliding_window": int(window), "sliding_layers": tuple(range(layers))}}


class CompressedMqa(AttentionMechanism):
    name = "compressed_mqa"
    parsers = (ParseStep(70, parse),)
    count_limits = {"o_groups": (1, 4096), "o_lora_rank": (1, 1 << 16)}

    def head_dims(self, g: Getter, facts: dict, hidden: int, heads: int, path: str | None) -> tuple[int, int]:
        head_dim = g.int("head_dim")
        return head_dim, parse_rope_dim(g.raw, head_dim, path)

    def ropes(self, raw: dict, default_theta: float, rope_dim: int, max_pos: int,
              path: str | None) -> tuple[RopeSpec, RopeSpec | None]:
        """The window-only layers' rope and the compressed layers' (:func:`parse_ropes`)."""
        return parse_ropes(raw, default_theta, rope_dim, max_pos, path)

    def layer_tensors(self, cfg: MoeConfig, layer: int, add: Add, *, experts: bool = True) -> None:
        """Reference names; the spec's layer_renames publish them."""
        a = f"{layer_prefix(layer)}.self_attn"
        h, hd, nh, c = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.attention.compressed
        add(f"{a}.q_a_proj.weight", (cfg.attention.q_lora_rank, h), "linear")
        add(f"{a}.q_a_norm.weight", (cfg.attention.q_lora_rank,), "norm")
        add(f"{a}.q_b_proj.weight", (nh * hd, cfg.attention.q_lora_rank), "linear")
        add(f"{a}.kv_proj.weight", (hd, h), "linear")
        add(f"{a}.kv_norm.weight", (hd,), "norm")
        add(f"{a}.o_a_proj.weight", (c.o_groups * c.o_lora_rank, nh * hd // c.o_groups), "linear")
        add(f"{a}.o_b_proj.weight", (h, c.o_groups * c.o_lora_rank), "out_linear")
        add(f"{a}.sinks", (nh,), "sink")
        ratio = c.ratios[layer]
        if not ratio:
            return
        csa = ratio == c.csa_ratio
        parts = [(f"{a}.compressor", hd)]
        if csa:
            parts.append((f"{a}.compressor.indexer", cfg.attention.indexer.head_dim))
        for prefix, width in parts:
            coff = 2 if csa else 1
            add(f"{prefix}.kv_proj.weight", (coff * width, h), "linear")
            add(f"{prefix}.gate_proj.weight", (coff * width, h), "linear")
            add(f"{prefix}.position_bias", (ratio, coff * width), "bias")
            add(f"{prefix}.kv_norm.weight", (width,), "norm")
        if csa:
            d = cfg.attention.indexer
            add(f"{a}.compressor.indexer.q_b_proj.weight", (d.n_heads * d.head_dim, cfg.attention.q_lora_rank), "linear")
            add(f"{a}.compressor.indexer.scorer.weights_proj.weight", (d.n_heads, h), "linear")

    def layer_modules(self, node, cfg: MoeConfig) -> None:
        pre = cfg.spec.prefix
        attn = node.add("self_attn", f"{pre}Attention")
        for name, type_ in (("q_a_proj", "Linear"), ("q_a_norm", f"{pre}RMSNorm"), ("q_b_proj", "Linear"),
                            ("kv_proj", "Linear"), ("kv_norm", f"{pre}RMSNorm"), ("o_a_proj", "Linear"),
                            ("o_b_proj", "Linear"), ("rotary_emb", f"{pre}RotaryEmbedding")):
            attn.add(name, type_)
        ratio = cfg.attention.compressed.ratios[node.layer]
        if not ratio:
            return
        csa = ratio == cfg.attention.compressed.csa_ratio
        comp = attn.add("compressor", f"{pre}CSACompressor" if csa else f"{pre}HCACompressor")
        parts = [comp]
        if csa:
            parts.append(comp.add("indexer", f"{pre}Indexer"))
        for part in parts:
            part.add("kv_proj", "Linear")
            part.add("gate_proj", "Linear")
            part.add("kv_norm", f"{pre}RMSNorm")
        if csa:
            parts[1].add("q_b_proj", "Linear")
            parts[1].add("scorer", f"{pre}IndexerScorer").add("weights_proj", "Linear")

    gguf_keys = {
        # llama.cpp deepseek4, whose converter reads these from the release's config.json: the window, the lightning
        # indexer, the grouped output projection, per-layer compress ratios (0 / 4 / 128) and the compressed layers'
        # rope (its base, and YaRN where the release scales it: llama.cpp applies it to those layers only)
        "compressed_mqa": lambda w, c, n: _compressed_mqa_keys(w, c),
    }


def _compressed_mqa_keys(w, c: MoeConfig) -> None:
    from gguf import RopeScalingType  # here, not at import: check-rules reads this package without numpy

    d = c.attention.compressed
    w.add_sliding_window(c.attention.sliding_window)
    w.add_indexer_head_count(c.attention.indexer.n_heads)
    w.add_indexer_key_length(c.attention.indexer.head_dim)
    w.add_indexer_top_k(c.attention.indexer.topk)
    w.add_uint32(f"{w.arch}.attention.output_group_count", d.o_groups)
    w.add_uint32(f"{w.arch}.attention.output_lora_rank", d.o_lora_rank)
    w.add_array(f"{w.arch}.attention.compress_ratios", [int(r) for r in d.ratios])
    w.add_float32(f"{w.arch}.attention.compress_rope_freq_base", d.compress_rope.theta)
    r = d.compress_rope
    if r.kind == "yarn":
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(r.factor)
        w.add_rope_scaling_orig_ctx_len(r.original_max_position_embeddings)
        w.add_rope_scaling_yarn_beta_fast(r.beta_fast)
        w.add_rope_scaling_yarn_beta_slow(r.beta_slow)


MECHANISM = CompressedMqa()
