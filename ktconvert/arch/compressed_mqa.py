"""Compressed sparse MQA (DeepSeek-V4, spec ``attention.kind: compressed_mqa``): q LoRA, one K=V projection, the
grouped output projection and per-head sinks; on a compressed layer the compressor (every closed window, or on the
indexer-ratio layers overlapping windows picked by its lightning indexer). Torch: ``model/compressed.py``
``CompressedAttention``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ktconvert.arch.base import Add, AttentionMechanism, layer_prefix

if TYPE_CHECKING:  # arch sits below families (docs/developing/layout.md): the type only, no import
    from ktconvert.families.config import MoeConfig


class CompressedMqa(AttentionMechanism):
    name = "compressed_mqa"

    def layer_tensors(self, cfg: MoeConfig, layer: int, add: Add, *, experts: bool = True) -> None:
        """Reference names; the spec's layer_renames publish them."""
        a = f"{layer_prefix(layer)}.self_attn"
        h, hd, nh, c = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.compressed
        add(f"{a}.q_a_proj.weight", (cfg.q_lora_rank, h), "linear")
        add(f"{a}.q_a_norm.weight", (cfg.q_lora_rank,), "norm")
        add(f"{a}.q_b_proj.weight", (nh * hd, cfg.q_lora_rank), "linear")
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
            parts.append((f"{a}.compressor.indexer", cfg.indexer.head_dim))
        for prefix, width in parts:
            coff = 2 if csa else 1
            add(f"{prefix}.kv_proj.weight", (coff * width, h), "linear")
            add(f"{prefix}.gate_proj.weight", (coff * width, h), "linear")
            add(f"{prefix}.position_bias", (ratio, coff * width), "bias")
            add(f"{prefix}.kv_norm.weight", (width,), "norm")
        if csa:
            d = cfg.indexer
            add(f"{a}.compressor.indexer.q_b_proj.weight", (d.n_heads * d.head_dim, cfg.q_lora_rank), "linear")
            add(f"{a}.compressor.indexer.scorer.weights_proj.weight", (d.n_heads, h), "linear")

    def layer_modules(self, node, cfg: MoeConfig) -> None:
        pre = cfg.spec.prefix
        attn = node.add("self_attn", f"{pre}Attention")
        for name, type_ in (("q_a_proj", "Linear"), ("q_a_norm", f"{pre}RMSNorm"), ("q_b_proj", "Linear"),
                            ("kv_proj", "Linear"), ("kv_norm", f"{pre}RMSNorm"), ("o_a_proj", "Linear"),
                            ("o_b_proj", "Linear"), ("rotary_emb", f"{pre}RotaryEmbedding")):
            attn.add(name, type_)
        ratio = cfg.compressed.ratios[node.layer]
        if not ratio:
            return
        csa = ratio == cfg.compressed.csa_ratio
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

    d = c.compressed
    w.add_sliding_window(c.sliding_window)
    w.add_indexer_head_count(c.indexer.n_heads)
    w.add_indexer_key_length(c.indexer.head_dim)
    w.add_indexer_top_k(c.indexer.topk)
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
