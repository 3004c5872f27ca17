"""The tensors a model of a family holds, from its normalised config and its spec: one list, read by the tiny models
(which fill it), the LoRA and release writers, and the completeness check of every checkpoint read
(``ktconvert.formats.completeness``: a checkpoint lacking one of these is refused). Pure Python, no torch."""

from __future__ import annotations

from dataclasses import dataclass

from ktconvert.families.config import MoeConfig


#: the tensors every layer of every family holds, whatever its kind (full, linear, compressed or sparse attention;
#: MoE or dense): the norms before the mixer and before the FFN; and the model-wide tensors every model holds (the
#: head is not one: a tied model has none). ``tensor_specs`` adds them from here, and a GGUF read without its
#: config.json is checked for them (``ktconvert.formats.completeness.missing_everywhere``).
LAYER_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight")
MODEL_WIDE = ("model.embed_tokens.weight", "model.norm.weight")


def everywhere_names(n_layers: int) -> list[str]:
    """The canonical names of what every model of ``n_layers`` layers holds, whatever its family and config."""
    return [MODEL_WIDE[0], *(f"model.layers.{L}.{n}" for L in range(n_layers) for n in LAYER_NORMS), MODEL_WIDE[1]]


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    kind: str  # embed, norm, norm0 (zero-centred), linear, out_linear, bias, out_bias, sink, router, score_bias, head, conv, dt_bias, a_log


def tensor_specs(cfg: MoeConfig, *, experts: bool = True) -> list[TensorSpec]:
    """Every tensor of the checkpoint in the per-expert Hugging Face layout, with how to fill it.

    ``out_linear`` marks matrices whose output is added to the residual stream (their routing-channel rows
    are zeroed); the names are those transformers 5 writes and the reference model's state dict uses.
    ``experts=False`` leaves out the routed experts (the list a completeness check needs: the experts are counted
    by the layout detection, and their names are most of a large model's).
    """
    h, specs = cfg.hidden_size, []

    def add(name: str, shape: tuple[int, ...], kind: str) -> None:
        specs.append(TensorSpec(name, tuple(shape), kind))

    def mlp(prefix: str, inter: int, names=("gate_proj", "up_proj", "down_proj"), bias: bool = False) -> None:
        add(f"{prefix}.{names[0]}.weight", (inter, h), "linear")
        add(f"{prefix}.{names[1]}.weight", (inter, h), "linear")
        add(f"{prefix}.{names[2]}.weight", (h, inter), "out_linear")
        if bias:
            add(f"{prefix}.{names[0]}.bias", (inter,), "bias")
            add(f"{prefix}.{names[1]}.bias", (inter,), "bias")
            add(f"{prefix}.{names[2]}.bias", (h,), "out_bias")

    norm = "norm0" if cfg.spec.zero_centered_norm else "norm"
    gated_q = 2 if cfg.spec.attention.output_gate else 1
    add(MODEL_WIDE[0], (cfg.vocab_size, h), "embed")
    hc = cfg.hyper_connections
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}"
        for n in LAYER_NORMS:
            add(f"{p}.{n}", (h,), norm)
        a = f"{p}.self_attn"
        if hc is not None and not cfg.hc_modules:  # the releases' names (transformers renames them attn_hc.fn, ...)
            for part in ("attn", "ffn"):
                add(f"{p}.hc_{part}_fn", ((2 + hc.mult) * hc.mult, hc.mult * h), "linear")
                add(f"{p}.hc_{part}_base", ((2 + hc.mult) * hc.mult,), "bias")
                add(f"{p}.hc_{part}_scale", (3,), "norm")
        if cfg.kda is not None and cfg.layer_types[layer] == "linear_attention":
            d = cfg.kda
            dim = d.num_heads * d.head_dim
            for proj in ("q", "k", "v"):
                add(f"{a}.{proj}_proj.weight", (dim, h), "linear")
            for proj in ("q", "k", "v"):  # per projection, as released (transformers concatenates them)
                add(f"{a}.{proj}_conv1d.weight", (dim, 1, d.conv_kernel), "conv")
            add(f"{a}.f_a_proj.weight", (d.head_dim, h), "linear")
            add(f"{a}.f_b_proj.weight", (dim, d.head_dim), "linear")
            add(f"{a}.dt_bias", (dim,), "dt_bias")
            add(f"{a}.A_log", (d.num_heads,), "a_log")
            add(f"{a}.b_proj.weight", (d.num_heads, h), "linear")
            add(f"{a}.g_a_proj.weight", (d.head_dim, h), "linear")
            add(f"{a}.g_b_proj.weight", (dim, d.head_dim), "linear")
            add(f"{a}.o_norm.weight", (d.head_dim,), "norm")
            add(f"{a}.o_proj.weight", (h, dim), "out_linear")
        elif cfg.layer_types and cfg.layer_types[layer] == "linear_attention":
            d, la = cfg.linear, f"{p}.linear_attn"
            conv = 2 * d.num_key_heads * d.key_head_dim + d.num_value_heads * d.value_head_dim
            value = d.num_value_heads * d.value_head_dim
            if cfg.spec.linear_packing == "grouped":  # per key head [q, k, v, z] rows and [b, a] rows
                add(f"{la}.in_proj_qkvz.weight", (conv + value, h), "linear")
                add(f"{la}.in_proj_ba.weight", (2 * d.num_value_heads, h), "linear")
            else:
                add(f"{la}.in_proj_qkv.weight", (conv, h), "linear")
                add(f"{la}.in_proj_z.weight", (value, h), "linear")
                add(f"{la}.in_proj_b.weight", (d.num_value_heads, h), "linear")
                add(f"{la}.in_proj_a.weight", (d.num_value_heads, h), "linear")
            add(f"{la}.conv1d.weight", (conv, 1, d.conv_kernel), "conv")
            add(f"{la}.dt_bias", (d.num_value_heads,), "dt_bias")
            add(f"{la}.A_log", (d.num_value_heads,), "a_log")
            add(f"{la}.norm.weight", (d.value_head_dim,), "norm")
            add(f"{la}.out_proj.weight", (h, d.num_value_heads * d.value_head_dim), "out_linear")
        elif cfg.compressed is not None:
            _compressed_specs(cfg, a, layer, add)
        elif cfg.is_mla:
            mla = cfg.mla
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
        else:
            hd, nh, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
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
        if cfg.hc_modules:
            size = (2 + hc.mult) * hc.mult
            for module in ("attn_hc", "ffn_hc"):
                add(f"{p}.{module}.fn", (size, hc.mult * h), "linear")
                add(f"{p}.{module}.base", (size,), "bias")
                add(f"{p}.{module}.scale", (3,), "norm")
        m = f"{p}.{cfg.ffn_name(layer)}"
        if layer not in cfg.moe_layers:
            mlp(m, cfg.intermediate_size)
            continue
        moe = cfg.spec.experts
        router = moe.router_attr
        add(f"{m}.{router}.weight", (cfg.num_experts, h), "router")
        if moe.router_bias:
            add(f"{m}.{router}.bias", (cfg.num_experts,), "bias")
        if layer in cfg.hash_layers:  # routed by token id: the table instead of a score bias
            add(f"{m}.gate.tid2eid", (cfg.vocab_size, cfg.num_experts_per_tok), "tid2eid")
        elif cfg.routing.topk_method == "noaux_tc":
            on_block = cfg.spec.experts.bias_on_block
            add(f"{m}.{'' if on_block else 'gate.'}e_score_correction_bias", (cfg.num_experts,), "score_bias")
        for e in range(cfg.num_experts if experts else 0):
            mlp(f"{m}.experts.{e}", cfg.moe_intermediate_size, cfg.expert_proj_names, moe.expert_bias)
        if cfg.shared_expert_intermediate_size:
            mlp(f"{m}.shared_expert", cfg.shared_expert_intermediate_size)
            add(f"{m}.shared_expert_gate.weight", (1, h), "linear")
        if cfg.n_shared_experts:
            mlp(f"{m}.shared_experts", cfg.shared_experts_inter)
    add(MODEL_WIDE[1], (h,), norm)
    if cfg.hc_modules:
        add("model.hc_head.hc_fn", (hc.mult, hc.mult * h), "linear")
        add("model.hc_head.hc_base", (hc.mult,), "bias")
        add("model.hc_head.hc_scale", (1,), "norm")
    add("lm_head.weight", (cfg.vocab_size, h), "head")
    return specs


def _compressed_specs(cfg: MoeConfig, a: str, layer: int, add) -> None:
    """A compressed sparse MQA layer's tensors (reference names; the spec's layer_renames publish them)."""
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
