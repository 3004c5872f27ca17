"""Multi-head latent attention (spec ``attention.kind: mla``): DeepSeek's compressed KV latent, the optional q LoRA,
and the DeepSeek Sparse Attention indexer (``attention.dsa_indexer``; k-pools and shared layers: GLM-5-Next).
Torch: ``model/modules.py`` ``MLAttention``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ktconvert.arch.base import Add, AttentionMechanism, layer_prefix, when

if TYPE_CHECKING:  # arch sits below families (docs/developing/layout.md): the type only, no import
    from ktconvert.families.config import MoeConfig


class Mla(AttentionMechanism):
    name = "mla"

    def layer_tensors(self, cfg: MoeConfig, layer: int, add: Add, *, experts: bool = True) -> None:
        a, h, mla = f"{layer_prefix(layer)}.self_attn", cfg.hidden_size, cfg.mla
        qk = mla.qk_nope_head_dim + cfg.qk_rope_head_dim
        nh = cfg.num_attention_heads
        if cfg.q_lora_rank is None:
            add(f"{a}.q_proj.weight", (nh * qk, h), "linear")
        else:
            add(f"{a}.q_a_proj.weight", (cfg.q_lora_rank, h), "linear")
            add(f"{a}.q_a_layernorm.weight", (cfg.q_lora_rank,), "norm")
            add(f"{a}.q_b_proj.weight", (nh * qk, cfg.q_lora_rank), "linear")
        add(f"{a}.kv_a_proj_with_mqa.weight", (mla.kv_lora_rank + cfg.qk_rope_head_dim, h), "linear")
        add(f"{a}.kv_a_layernorm.weight", (mla.kv_lora_rank,), "norm")
        add(f"{a}.kv_b_proj.weight", (nh * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank), "linear")
        add(f"{a}.o_proj.weight", (h, nh * mla.v_head_dim), "out_linear")
        if cfg.indexer is not None and layer not in cfg.dsa_shared_layers:  # a shared layer has no indexer
            d, ix = cfg.indexer, f"{a}.indexer"
            add(f"{ix}.wq_b.weight", (d.n_heads * d.head_dim, cfg.q_lora_rank), "linear")
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
        if cfg.q_lora_rank:
            attn.add("q_a_proj", "Linear")
            attn.add("q_a_layernorm", f"{pre}RMSNorm")
            attn.add("q_b_proj", "Linear")
        else:
            attn.add("q_proj", "Linear")
        attn.add("kv_a_proj_with_mqa", "Linear")
        attn.add("kv_a_layernorm", f"{pre}RMSNorm")
        attn.add("kv_b_proj", "Linear")
        attn.add("o_proj", "Linear")
        if cfg.qk_rope_head_dim:  # NoPE MLA (GLM-5-Next) has no rotary module
            attn.add("rotary_emb", cfg.spec.classes.tree_rotary or f"{pre}RotaryEmbedding")
        if cfg.indexer is not None and node.layer not in cfg.dsa_shared_layers:
            ix = attn.add("indexer", f"{pre}Indexer")
            ix.add("wq_b", "Linear")
            ix.add("wk", "Linear")
            ix.add("k_norm", "LayerNorm")
            ix.add("weights_proj", "Linear")

    gguf_keys = {
        # 0: no q LoRA (V2-Lite style q_proj); llama.cpp requires the key
        "q_lora_rank": lambda w, c, n: w.add_q_lora_rank(c.q_lora_rank or 0),
        "kv_lora_rank": lambda w, c, n: w.add_kv_lora_rank(c.mla.kv_lora_rank),
        "mla_key_length": lambda w, c, n: w.add_key_length(c.mla.qk_nope_head_dim + c.qk_rope_head_dim),
        "mla_value_length": lambda w, c, n: w.add_value_length(c.mla.v_head_dim),
        "mla_rope_dimension_count": lambda w, c, n: w.add_rope_dimension_count(c.qk_rope_head_dim),
        # llama.cpp's absorbed MLA (MQA over the latent): K = latent + rope, V = latent; then the decompressed heads
        "mqa_key_length": lambda w, c, n: w.add_key_length(c.mla.kv_lora_rank + c.qk_rope_head_dim),
        "mqa_value_length": lambda w, c, n: w.add_value_length(c.mla.kv_lora_rank),
        "key_length_mla": lambda w, c, n: w.add_key_length_mla(c.mla.qk_nope_head_dim + c.qk_rope_head_dim),
        "value_length_mla": lambda w, c, n: w.add_value_length_mla(c.mla.v_head_dim),
        # DSA indexer (GLM-5); llama.cpp reads indexer.types when written, else every layer runs its own indexer
        "indexer": lambda w, c, n: (
            w.add_indexer_head_count(c.indexer.n_heads), w.add_indexer_key_length(c.indexer.head_dim),
            w.add_indexer_top_k(c.indexer.topk),
            when(c.indexer.kpool, lambda: (
                w.add_uint32(f"{w.arch}.attention.indexer.kpool", c.indexer.kpool),
                w.add_bool(f"{w.arch}.attention.indexer.kpool_select_tail", c.indexer.kpool_tail))),
            when(c.indexer.types_written or c.dsa_shared_layers, lambda: w.add_array(
                f"{w.arch}.attention.indexer.types", c.indexer.full_layers(n)))),
        # the DSA indexer LayerNorm's fixed eps (what llama.cpp's Glm5NextModel converter writes)
        "layer_norm_epsilon": lambda w, c, n: w.add_layer_norm_eps(1e-6),
    }


MECHANISM = Mla()
