"""Checkpoints for the formats/inspect tests, written by tools no one here wrote.

Hugging Face transformers saves the tiny MoE models (default per-expert save and ``save_original_format=False``
fused save); the ``gguf`` package writes GGUF files, with tensor names taken from gguf-py's own tables
(``TENSOR_NAMES`` / ``get_tensor_name_map``), never from ktconvert's naming maps, so that the maps are tested
against an independent source. Everything is built once per test session and cached here.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

H, I, LAYERS = 64, 24, 3
FAMILIES = {
    # model_type: (n_experts, layers with routed experts, llama.cpp arch, extra config)
    "qwen2_moe": (6, (0, 1, 2), "qwen2moe", dict(moe_intermediate_size=I, shared_expert_intermediate_size=40,
                                                  num_experts=6, intermediate_size=80, decoder_sparse_step=1)),
    "qwen3_moe": (8, (0, 1, 2), "qwen3moe", dict(moe_intermediate_size=I, num_experts=8, intermediate_size=80,
                                                  head_dim=16)),
    "mixtral": (4, (0, 1, 2), "llama", dict(intermediate_size=I, num_local_experts=4)),
    "deepseek_v2": (6, (1, 2), "deepseek2", dict(moe_intermediate_size=I, intermediate_size=80, n_routed_experts=6,
                                                  n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16,
                                                  q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                                  v_head_dim=8, n_group=1, topk_group=1)),
    "deepseek_v3": (8, (1, 2), "deepseek2", dict(moe_intermediate_size=I, intermediate_size=80, n_routed_experts=8,
                                                  n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16,
                                                  q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                                  v_head_dim=8, n_group=2, topk_group=1)),
}
_CACHE: dict[tuple, Path] = {}


def hf_checkpoint(root: Path, model_type: str, fmt: str = "split", dtype: str = "float32",
                  max_shard_size: str | None = None) -> Path:
    """A tiny ``model_type`` model saved by transformers (``fmt`` ``split``: default save; ``fused``:
    ``save_original_format=False``), built from a fixed torch seed; cached for the session."""
    key = ("hf", model_type, fmt, dtype, max_shard_size)
    if key in _CACHE:
        return _CACHE[key]
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    n_exp, _, _, extra = FAMILIES[model_type]
    cfg = AutoConfig.for_model(model_type, vocab_size=128, hidden_size=H, num_hidden_layers=LAYERS,
                               num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                               num_experts_per_tok=2, **extra)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).to(getattr(torch, dtype))
    out = root / f"hf-{model_type}-{fmt}-{dtype}-{max_shard_size or 'one'}"
    kwargs = {} if fmt == "split" else {"save_original_format": False}
    if max_shard_size:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(out, **kwargs)
    _CACHE[key] = out
    return out


def _gguf_arch(arch: str):
    import gguf

    return next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)


def gguf_from_hf(root: Path, model_type: str, legacy_split: bool = False, split_max_tensors: int = 0,
                 name: str | None = None) -> Path:
    """Convert the tiny HF checkpoint to GGUF the way convert_hf_to_gguf does: experts stacked into
    ``blk.L.ffn_*_exps`` (or kept per expert as legacy ``blk.L.ffn_*.E``), names from gguf-py, gate/up Q8_0,
    down F16, norms/router/bias F32."""
    key = ("gguf", model_type, legacy_split, split_max_tensors, name)
    if key in _CACHE:
        return _CACHE[key]
    import gguf
    from gguf.constants import MODEL_TENSOR, TENSOR_NAMES
    from safetensors.numpy import load_file

    n_exp, moe_layers, arch, extra = FAMILIES[model_type]
    src = hf_checkpoint(root, model_type, "split")
    tensors = load_file(src / "model.safetensors")
    names = gguf.get_tensor_name_map(_gguf_arch(arch), LAYERS)
    out_dir = root / (name or f"gguf-{model_type}-{'legacy' if legacy_split else 'merged'}-{split_max_tensors}")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "model.gguf"
    w = gguf.GGUFWriter(path, arch, split_max_tensors=split_max_tensors)
    w.add_block_count(LAYERS)
    w.add_embedding_length(H)
    w.add_expert_count(n_exp)
    w.add_expert_used_count(2)
    if arch == "llama":
        w.add_feed_forward_length(I)
    else:
        w.add_expert_feed_forward_length(I)
    if arch == "deepseek2":
        w.add_leading_dense_block_count(1)
    w.add_token_list([f"t{i}" for i in range(2000)])  # long enough to stay a lazy array in our reader

    hf_proj = {"gate": ("gate_proj", "w1"), "up": ("up_proj", "w3"), "down": ("down_proj", "w2")}
    exp_tensor = {"gate": MODEL_TENSOR.FFN_GATE_EXP, "up": MODEL_TENSOR.FFN_UP_EXP, "down": MODEL_TENSOR.FFN_DOWN_EXP}

    def add(gname: str, arr: np.ndarray, proj: str | None = None):
        if arr.ndim == 1 or gname.endswith("_norm.weight") or "ffn_gate_inp" in gname:
            w.add_tensor(gname, arr.astype(np.float32))
        elif proj in ("gate", "up"):
            w.add_tensor(gname, gguf.quants.quantize(arr.astype(np.float32), gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(gname, arr.astype(np.float16))

    for hf_name in sorted(tensors):
        if ".experts." in hf_name and "shared" not in hf_name:
            continue
        key_name = hf_name.replace("e_score_correction_bias", "e_score_correction.bias")  # as convert_hf_to_gguf does
        gname = names.get_name(key_name, try_suffixes=(".weight", ".bias"))
        assert gname is not None, hf_name
        add(gname, tensors[hf_name])
    block = "block_sparse_moe" if model_type == "mixtral" else "mlp"
    for L in moe_layers:
        for proj, (hf_p, hf_w) in hf_proj.items():
            per = [tensors[f"model.layers.{L}.{block}.experts.{e}.{hf_w if model_type == 'mixtral' else hf_p}.weight"]
                   for e in range(n_exp)]
            if legacy_split:
                for e, arr in enumerate(per):
                    add(f"blk.{L}.ffn_{proj}.{e}.weight", arr, proj)
            else:
                add(TENSOR_NAMES[exp_tensor[proj]].format(bid=L) + ".weight", np.stack(per), proj)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _CACHE[key] = out_dir
    return out_dir


def write_gguf(path: Path, arch: str, tensors: dict, kv: dict | None = None) -> Path:
    """A GGUF written by the gguf package; ``tensors`` maps name -> array or (bytes_array, GGMLQuantizationType)."""
    import gguf

    w = gguf.GGUFWriter(path, arch)
    for k, v in (kv or {}).items():
        w.add_uint32(k, v)
    for name, t in tensors.items():
        if isinstance(t, tuple):
            w.add_tensor(name, t[0], raw_dtype=t[1])
        else:
            w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def kt_amx_checkpoint(root: Path, E: int = 4, inter: int = 256, hidden: int = 128, numa: int = 2,
                      bits: int = 4) -> Path:
    """What kt-kernel's convert_cpu_weights.py writes (per its documented key and size scheme): per layer, expert
    and NUMA part an int8 blob of ``rows*k*bits/8`` bytes and ``rows`` float32 scales, non-expert tensors renamed
    ``model.layers.`` -> ``blk.`` and ``model.`` -> ``''``, an index and config.json. The blobs are random bytes:
    the AMX tile packing is opaque to ktconvert."""
    from safetensors.numpy import save_file

    out = root / f"kt-amx-{E}-{inter}-{hidden}-{numa}-{bits}"
    if out.exists():
        return out
    out.mkdir(parents=True)
    rng = np.random.default_rng(0)
    weight_map = {}
    shards = []
    for L in (1, 2):
        t = {}
        for proj in ("gate", "up", "down"):
            rows, k = (inter // numa, hidden) if proj != "down" else (hidden, inter // numa)
            for e in range(E):
                for n in range(numa):
                    t[f"blk.{L}.ffn_{proj}_exps.{e}.numa.{n}.weight"] = rng.integers(
                        -128, 127, rows * k * bits // 8, dtype=np.int8)
                    t[f"blk.{L}.ffn_{proj}_exps.{e}.numa.{n}.scale"] = rng.random(rows, dtype=np.float32)
        shards.append(t)
    rest = {
        "embed_tokens.weight": rng.random((32, hidden), dtype=np.float32),
        "norm.weight": np.ones(hidden, np.float32),
        "lm_head.weight": rng.random((32, hidden), dtype=np.float32),
    }
    for L in range(3):
        rest[f"blk.{L}.input_layernorm.weight"] = np.ones(hidden, np.float32)
        rest[f"blk.{L}.self_attn.o_proj.weight"] = rng.random((hidden, hidden), dtype=np.float32)
        if L:
            rest[f"blk.{L}.mlp.gate.weight"] = rng.random((E, hidden), dtype=np.float32)
    shards.append(rest)
    for i, t in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(t, out / fname)
        weight_map.update({k: fname for k in t})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 0},
                                                                  "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps({
        "model_type": "deepseek_v3", "hidden_size": hidden, "moe_intermediate_size": inter, "n_routed_experts": E,
        "num_hidden_layers": 3, "first_k_dense_replace": 1, "num_experts_per_tok": 2}))
    return out


# --- hand-made bytes for hostile-input tests ------------------------------------------------------------------------


def st_bytes(header: dict | bytes, data: bytes = b"", length: int | None = None) -> bytes:
    """A safetensors file from a header (dict or raw JSON bytes), with an optionally lying length field."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def gguf_bytes(version: int = 3, n_tensors: int = 0, n_kv: int = 0, body: bytes = b"", magic: bytes = b"GGUF") -> bytes:
    return magic + struct.pack("<IQQ", version, n_tensors, n_kv) + body


def gguf_str(s: str | bytes, length: int | None = None) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b) if length is None else length) + b


def gguf_kv_u32(key: str, value: int) -> bytes:
    return gguf_str(key) + struct.pack("<II", 4, value)


def gguf_tensor_info(name: str, ne: tuple, ggml_type: int, offset: int) -> bytes:
    return gguf_str(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<Q", d) for d in ne) + struct.pack(
        "<IQ", ggml_type, offset)
