"""The GGUF key/values an output carries: llama.cpp's hyperparameters for an HF input, everything for a GGUF one.

For an HF input the keys and their value types are the ones llama.cpp's loaders read for ``qwen2moe``,
``qwen3moe``, ``deepseek2`` and ``llama`` (Mixtral), written through gguf-py's ``GGUFWriter.add_*`` helpers so
each key has the type llama.cpp expects (``convert_hf_to_gguf`` writes the same ones). DeepSeek is written in
llama.cpp's non-MLA form (``attn_kv_b`` plus ``key_length``/``value_length`` of the decompressed heads), which
llama.cpp still loads and which keeps ``kv_b_proj`` a plain rename. For a GGUF input every pair is copied as
its original bytes, except the few that describe the container or the quantization (``general.file_type``,
``general.quantization_version``, ``split.*``).
"""

from __future__ import annotations

import dataclasses

from pathlib import Path

import numpy as np
from gguf import (
    GGUFType,
    GGUFValueType,
    GGUFWriter,
    Keys,
    LlamaFileType,
    Metadata,
    RopeScalingType,
    size_label,
)

from ktconvert import families
from ktconvert.arch import attention as layer_attention, gguf_keys
from ktconvert.arch.base import when
from ktconvert.convert.tokenizer import GgufVocab, quiet_gguf
from ktconvert.errors import InputError
from ktconvert.io.files import regular_file_size
from ktconvert.families.config import normalize_config
from ktconvert.formats.gguf_write import encode_kv, kv_pairs_from_writer, raw_kv_pairs

#: keys whose values an output recomputes; every other pair of a GGUF input is copied byte for byte
RECOMPUTED = ("general.file_type", "general.quantization_version", "split.no", "split.count", "split.tensors.count")

_TYPE_TO_FTYPE = {"F32": "ALL_F32", "F16": "MOSTLY_F16", "BF16": "MOSTLY_BF16", "Q8_0": "MOSTLY_Q8_0",
                  "Q4_0": "MOSTLY_Q4_0", "Q4_1": "MOSTLY_Q4_1", "Q5_0": "MOSTLY_Q5_0", "Q5_1": "MOSTLY_Q5_1",
                  "Q2_K": "MOSTLY_Q2_K", "Q3_K": "MOSTLY_Q3_K_M", "Q4_K": "MOSTLY_Q4_K_M", "Q5_K": "MOSTLY_Q5_K_M",
                  "Q6_K": "MOSTLY_Q6_K", "IQ4_NL": "MOSTLY_IQ4_NL", "IQ4_XS": "MOSTLY_IQ4_XS",
                  "IQ3_XXS": "MOSTLY_IQ3_XXS", "IQ3_S": "MOSTLY_IQ3_S", "IQ2_XXS": "MOSTLY_IQ2_XXS",
                  "IQ2_XS": "MOSTLY_IQ2_XS", "IQ2_S": "MOSTLY_IQ2_M",
                  "IQ1_S": "MOSTLY_IQ1_S", "IQ1_M": "MOSTLY_IQ1_M"}
QUANTIZATION_VERSION = 2  # ggml's GGML_QNT_VERSION


def file_type(recipe_file_type: str | None, bytes_by_type: dict[str, int]) -> int:
    """``general.file_type``: the recipe's, else derived from the type holding the most bytes."""

    if recipe_file_type:
        key = recipe_file_type if recipe_file_type == "ALL_F32" else f"MOSTLY_{recipe_file_type}"
        return int(LlamaFileType[key])
    top = max(bytes_by_type.items(), key=lambda kv: kv[1])[0] if bytes_by_type else "F32"
    return int(LlamaFileType[_TYPE_TO_FTYPE.get(top, "GUESSED")])


# The keys a family spec's gguf.metadata lists, each computed from the normalised config (w: the writer, c: MoeConfig,
# n: block count); the spec fixes which and in what order. Each mechanism's own keys are its arch module's
# (``ktconvert/arch/``, e.g. ``mla.py``'s kv_lora_rank); these are the model's sizes and rope, whatever its mechanisms.
_MODEL_KEYS = {
    "key_length": lambda w, c, n: w.add_key_length(c.head_dim),
    "value_length": lambda w, c, n: w.add_value_length(c.head_dim),
    "rope_dimension_count": lambda w, c, n: w.add_rope_dimension_count(c.rope.dim),  # partial rotary: < head_dim
    # Qwen3.5's multimodal rope sections (what llama.cpp's Qwen3.5 converter writes)
    "rope_dimension_sections": lambda w, c, n: w.add_rope_dimension_sections(_mrope_sections(c)),
    "partial_rope_dimension_count": lambda w, c, n: w.add_rope_dimension_count(c.rope.dim),
    # Qwen3-VL: vision layers whose features join the text model (0 for text only; the key is read by llama.cpp)
    "n_deepstack_layers": lambda w, c, n: w.add_num_deepstack_layers(c.gguf.deepstack_layers),
    # MiniMax-M3: rotary_dim as the hub config says (llama.cpp's converter writes it and llama.cpp rotates that many
    # dims; transformers 5.23 ignores it), else the rotated share the reference uses
    "rotary_dim": lambda w, c, n: w.add_rope_dimension_count(
        c.gguf.rotary_dim if c.gguf.rotary_dim is not None else c.rope.dim),
    # llama.cpp divides by 0.1 again
    "rope_scaling_yarn_log_mul": lambda w, c, n: when(
        c.rope.kind == "yarn" and c.rope.mscale_all_dim, lambda: w.add_rope_scaling_yarn_log_mul(0.1 * c.rope.mscale_all_dim)),
}
_ARCH_KEYS = gguf_keys(_MODEL_KEYS)


def _mrope_sections(c) -> list[int]:
    """rope_parameters' mrope_section padded to four (llama.cpp requires the key); Qwen3.5's default when absent."""
    sections = list(c.gguf.mrope_section or [11, 11, 10])
    return (sections + [0] * 4)[:4]


def _writer(arch: str):

    return GGUFWriter(None, arch)


#: the files gguf-py's Metadata.load reads beside the weights (model card, config, generation config)
CARD_FILES = ("README.md", "config.json", "generation_config.json")


def model_card(model_dir: Path, tensors: list[tuple[str, tuple[int, ...]]]) -> Metadata:
    """``general.*`` as convert_hf_to_gguf derives them, with gguf-py's own code: ``Metadata.load`` (model card
    front matter, config.json's ``_name_or_path``, the directory name, generation_config.json's sampling
    settings: name, basename, finetune, version, size label, license, ...), the directory name when nothing
    names the model, and the size label from the output tensors (``GGUFWriter.get_total_parameter_count``:
    ``8x1.2M`` style for MoE models). ``tensors`` are ``(gguf name, numpy shape)``."""
    w = GGUFWriter(None, "none")
    for name, shape in tensors:
        w.add_tensor_info(name, shape, np.dtype(np.float32), 4 * int(np.prod(shape, dtype=np.int64)))
    total, shared, expert, count = w.get_total_parameter_count()
    for f in CARD_FILES:
        p = model_dir / f
        if p.exists() or p.is_symlink():
            regular_file_size(p, f, limit=64 * 1024**2, fix=f"remove or replace {f}")
    try:
        with quiet_gguf():
            meta = Metadata.load(None, model_dir, None, total)
    except Exception as exc:  # a model card whose front matter gguf-py cannot read
        raise InputError(f"cannot derive general.* metadata from the model card: {type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else ''}", path=str(model_dir / "README.md"),
                         fix="fix the YAML front matter of README.md (between the --- lines) or remove it") from None
    if meta.name is None:
        meta.name = model_dir.name
    if meta.size_label is None and total > 0:
        meta.size_label = size_label(total, shared, expert, count)
    return meta


def utf8_card(meta: Metadata) -> list[str]:
    """Make every text of ``meta`` valid UTF-8 in place (a GGUF string is UTF-8; a directory name need not be:
    its undecodable bytes reach Python as surrogates), each undecodable byte written as U+FFFD; the notes saying
    which ``general.*`` values were changed, for the plan."""
    notes = []

    def clean(value, key: str):
        if isinstance(value, str):
            fixed = value.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
            if fixed != value:
                notes.append(f"general.{key} {fixed!r}: the model directory's name (or the model card) is not valid "
                             "UTF-8; each undecodable byte is written as U+FFFD")
            return fixed
        if isinstance(value, list):
            return [clean(v, key) for v in value]
        if isinstance(value, dict):
            return {k: clean(v, f"{key}.{k}") for k, v in value.items()}
        return value

    for f in dataclasses.fields(meta):
        setattr(meta, f.name, clean(getattr(meta, f.name), f.name))
    return notes


def hf_kv(arch: str, config: dict, card: Metadata, n_layers: int, n_vocab: int, vocab: GgufVocab | None,
          ftype: int, quantized: bool, config_path: str | None = None) -> list[tuple[str, bytes]]:
    """Encoded KV pairs for a GGUF made from an HF checkpoint of ``arch`` with ``config`` (read from
    ``config_path``, which its errors name); ``card`` is :func:`model_card`'s ``general.*``."""
    c = normalize_config(config, path=config_path)
    spec = families.spec_for_arch(c.family, arch)
    w = _writer(arch)
    w.add_type(GGUFType.MODEL)
    card.set_gguf_meta_model(w)
    w.add_block_count(n_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(getattr(c.mlp, spec.gguf.feed_forward_length))
    w.add_head_count(c.num_attention_heads)
    if "recurrent_head_count_kv" in spec.gguf.metadata:  # 0 marks a layer holding a recurrent state, not a KV cache
        w.add_head_count_kv([0 if layer_attention(c, i).recurrent else 1 for i in range(c.num_hidden_layers)])
    else:
        w.add_head_count_kv(1 if spec.gguf.mla_mqa else c.num_key_value_heads)
    w.add_rope_freq_base(c.rope.theta)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_expert_count(c.num_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_vocab_size(n_vocab)
    w.add_file_type(ftype)
    if quantized:
        w.add_quantization_version(QUANTIZATION_VERSION)
    if c.rope.kind == "linear":
        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(c.rope.factor)
    elif c.rope.kind == "yarn":
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(c.rope.factor)
        w.add_rope_scaling_orig_ctx_len(c.rope.original_max_position_embeddings)
        w.add_rope_scaling_yarn_beta_fast(c.rope.beta_fast)
        w.add_rope_scaling_yarn_beta_slow(c.rope.beta_slow)
    for key in spec.gguf.metadata:
        _ARCH_KEYS[key](w, c, n_layers)
    if vocab is None:
        w.add_tokenizer_model("none")
    else:
        w.add_tokenizer_model(vocab.model)
        if vocab.pre:
            w.add_tokenizer_pre(vocab.pre)
        w.add_token_list(list(vocab.tokens))
        w.add_token_types(list(vocab.token_types))
        with quiet_gguf():
            vocab.special.add_to_gguf(w, quiet=True)  # merges, special ids, add_bos/eos/sep, chat template
    return kv_pairs_from_writer(w)


def carried_kv(path, arch: str, ftype: int | None, quantized: bool) -> list[tuple[str, bytes]]:
    """The KV pairs of an input GGUF (its first shard), byte for byte, less the split keys, with the recomputed keys
    moved to the end: general.quantization_version, then general.file_type, as llama-quantize sets them
    (``gguf_set_val_*`` on a key the context has removes it and appends it: src/llama-quant.cpp,
    ggml/src/gguf.cpp of the pinned llama.cpp). ``ftype`` ``None`` (nothing requantized) keeps the input's
    ``general.file_type`` and every key in its place."""
    pairs = raw_kv_pairs(path)
    w = _writer(arch)
    if quantized:
        w.add_quantization_version(QUANTIZATION_VERSION)
    if ftype is not None:
        w.add_file_type(ftype)
    fresh = {k: b for k, b in kv_pairs_from_writer(w) if k != "general.architecture"}
    if ftype is None:  # nothing requantized (--type keep): the keys stay where they are, the file a copy
        out = [(key, fresh.pop(key, raw)) for key, raw in pairs if not key.startswith("split.")]
    else:
        out = [(key, raw) for key, raw in pairs if not key.startswith("split.") and key not in fresh]
    out.extend(fresh.items())
    return out


def split_kv(shard: int, count: int, n_tensors: int) -> list[tuple[str, bytes]]:
    """``split.no``, ``split.count`` and ``split.tensors.count`` for one shard of a split GGUF (gguf-py's types)."""


    return [
        (Keys.Split.LLM_KV_SPLIT_NO, encode_kv(Keys.Split.LLM_KV_SPLIT_NO, GGUFValueType.UINT16, shard)),
        (Keys.Split.LLM_KV_SPLIT_COUNT, encode_kv(Keys.Split.LLM_KV_SPLIT_COUNT, GGUFValueType.UINT16, count)),
        (Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT,
         encode_kv(Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT, GGUFValueType.INT32, n_tensors)),
    ]
