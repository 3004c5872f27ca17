"""Full softmax attention with grouped KV heads (spec ``attention.kind: gqa``, and the full-attention layers of a
Gated DeltaNet hybrid): optional output gate, biases, sinks, q/k norms (per head or over the projection), sliding
window, and MiniMax Sparse Attention's indexer on the layers that run it. Torch: ``model/modules.py`` ``Attention``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ktconvert.arch.base import Add, AttentionMechanism, layer_prefix, norm_role, when

if TYPE_CHECKING:  # arch sits below families (docs/developing/layout.md): the type only, no import
    from ktconvert.families.config import MoeConfig


class Gqa(AttentionMechanism):
    name = "gqa"

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
        if cfg.qk_norm:
            whole = cfg.spec.attention.qk_norm_whole
            add(f"{a}.q_norm.weight", (nh * hd if whole else hd,), norm)
            add(f"{a}.k_norm.weight", (nkv * hd if whole else hd,), norm)
        if layer in cfg.msa_layers:  # MiniMax Sparse Attention's indexer, flat in self_attn as released
            d = cfg.indexer
            add(f"{a}.index_q_proj.weight", (d.n_heads * d.head_dim, h), "linear")
            add(f"{a}.index_k_proj.weight", (d.head_dim, h), "linear")
            add(f"{a}.index_q_norm.weight", (d.head_dim,), norm)
            add(f"{a}.index_k_norm.weight", (d.head_dim,), norm)

    def layer_modules(self, node, cfg: MoeConfig) -> None:
        pre = cfg.spec.prefix
        attn = node.add("self_attn", f"{pre}Attention")
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            attn.add(name, "Linear")
        if cfg.qk_norm:
            attn.add("q_norm", f"{pre}RMSNorm")
            attn.add("k_norm", f"{pre}RMSNorm")
        attn.add("rotary_emb", f"{pre}RotaryEmbedding")
        if node.layer in cfg.msa_layers:
            attn.add("index_q_proj", "Linear")
            attn.add("index_k_proj", "Linear")
            attn.add("index_q_norm", f"{pre}RMSNorm")
            attn.add("index_k_norm", f"{pre}RMSNorm")

    gguf_keys = {
        # the window and which layers use it (llama.cpp reads the per-layer pattern before its architecture default)
        "sliding_window": lambda w, c, n: when(c.sliding_window, lambda: (
            w.add_sliding_window(c.sliding_window),
            w.add_sliding_window_pattern([i in c.sliding_layers for i in range(n)]))),
        # MiniMax Sparse Attention: the indexer and its block selection (llama.cpp reads all five)
        "msa_indexer": lambda w, c, n: (
            w.add_indexer_head_count(c.indexer.n_heads), w.add_indexer_key_length(c.indexer.head_dim),
            w.add_indexer_top_k(c.indexer.topk),
            w.add_uint32(f"{w.arch}.attention.indexer.block_size", c.indexer.block_size),
            w.add_uint32(f"{w.arch}.attention.indexer.local_blocks", c.indexer.local_blocks)),
    }


MECHANISM = Gqa()
