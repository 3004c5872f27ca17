"""Tiny quantized releases in the layouts the real ones ship: the tiny model's weights stored as MXFP4, MXFP8,
RAWINT4, NVFP4, FP8 per-channel or GPTQ INT4, with the companions, dtypes, scale shapes and config keys of those
releases (DeepSeek-V4-Flash, MiniMax-M3, Kimi-K2-Thinking, Qwen3.5 NVFP4 (ModelOpt), GLM-4.7-FP8, GPTQModel).

Family-independent: any family's tiny model, its routed-expert matrices quantized (all linear layers for FP8
per-channel, as GLM-4.7-FP8 does); every other tensor stays as the plain tiny model has it. The tensor *names* are
the family's own HF names as its releases spell them (a multimodal wrapper's prefix); a family whose releases rename
the experts (DeepSeek-V4's ``ffn.experts.N.w1``) gets them from its own naming rules when it joins. A family whose
releases store the experts another way says so in its spec (``checkpoint.releases``): ``fused_mxfp4`` is gpt-oss'
stacked ``*_blocks``/``*_scales`` per layer (:mod:`ktconvert.formats.mxfp4_fused`), with that release's
``quantization_config``.
"""

from __future__ import annotations

import json

import numpy as np

from ktconvert.errors import UsageProblem
from ktconvert import families
from ktconvert.families.config import normalize_config
from ktconvert.formats import fp8, gptq, mxfp4, mxfp4_fused, nvfp4, rawint4
from ktconvert.formats.safetensors_write import to_bytes
from ktconvert.model.tiny_weights import VOCAB, _fill, _is_fp8_weight, tensor_specs, tiny_config, tiny_tensors
from ktconvert.model.tinytok import tokenizer_files

GROUP = 32  # RAWINT4 (Kimi) and the tiny GPTQ release

_CT_INT4 = {"config_groups": {"group_0": {"input_activations": None, "output_activations": None, "targets": ["Linear"],
                                          "weights": {"actorder": None, "block_structure": None, "dynamic": False,
                                                      "group_size": GROUP, "num_bits": 4, "observer": "minmax",
                                                      "observer_kwargs": {}, "strategy": "group", "symmetric": True,
                                                      "type": "int"}}},
            "format": "pack-quantized", "ignore": ["lm_head"], "kv_cache_scheme": None,
            "quant_method": "compressed-tensors", "quantization_status": "compressed"}
_CT_FP8_CHANNEL = {"config_groups": {"group_0": {"input_activations": {"dynamic": True, "num_bits": 8,
                                                                       "strategy": "token", "symmetric": True,
                                                                       "type": "float"},
                                                 "output_activations": None, "targets": ["Linear"],
                                                 "weights": {"dynamic": False, "num_bits": 8, "observer": "minmax",
                                                             "strategy": "channel", "symmetric": True,
                                                             "type": "float"}}},
                   "format": "float-quantized", "ignore": ["lm_head"], "kv_cache_scheme": None,
                   "quant_method": "compressed-tensors", "quantization_status": "compressed"}

#: format -> (config.json additions, which matrices are quantized: "experts" or "linear")
RELEASES: dict[str, tuple[dict, str]] = {
    "mxfp4": ({"expert_dtype": "fp4", "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
                                                              "quant_method": "fp8", "scale_fmt": "ue8m0",
                                                              "weight_block_size": [128, 128]}}, "experts"),
    "mxfp8": ({"quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                       "scale_fmt": "ue8m0", "weight_block_size": [1, 32]}}, "experts"),
    "rawint4": ({"quantization_config": _CT_INT4}, "experts"),
    "nvfp4": ({"quantization_config": {"exclude_modules": ["lm_head"], "group_size": nvfp4.GROUP,
                                       "kv_cache_quant_algo": None, "quant_algo": "NVFP4",
                                       "quant_method": "modelopt"}}, "experts"),
    "fp8-perchannel": ({"quantization_config": _CT_FP8_CHANNEL}, "linear"),
    "gptq-int4": ({"quantization_config": {"bits": 4, "checkpoint_format": "gptq", "damp_percent": 0.01,
                                           "desc_act": False, "group_size": GROUP, "quant_method": "gptq",
                                           "static_groups": False, "sym": True, "true_sequential": True}},
                  "experts"),
}
FORMATS = tuple(RELEASES)


#: ModelOpt's NVFP4 activation scale of the tiny releases' ``activation_scales``: amax/(6*448) for an activation
#: amax of 1 (the real one is calibrated; converting weights never reads it)
INPUT_SCALE = np.float32(1.0 / (6.0 * 448.0))


def _quantize(fmt: str, base: str, x: np.ndarray, activation_scales: bool = False
              ) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The stored tensors of one matrix ``base + '.weight'`` in ``fmt``: {name: array}, {name: dtype}."""
    stem = base[: -len(".weight")]
    if fmt == "mxfp8":
        amax = np.abs(x).reshape(x.shape[0], -1, 32).max(axis=2)
        # the smallest power of two >= amax/448 (no code saturates); an all-zero group gets 2**0
        e = np.where(amax > 0, np.ceil(np.log2(np.where(amax > 0, amax, 1) / 448.0)), 0).astype(np.int64)
        scale = np.exp2(e).astype(np.float32)
        codes = fp8.encode_e4m3(x / np.repeat(scale, 32, axis=1))
        parts = {"weight": (codes, fp8.FP8_DTYPE), "weight_scale_inv": ((e + 127).astype(np.uint8), "F8_E8M0")}
    elif fmt == "fp8-perchannel":
        codes, scale = fp8.quantize(x, (1, x.shape[1]), "BF16")
        parts = {"weight": (codes, fp8.FP8_DTYPE), "weight_scale": (fp8.to_bits(scale, "BF16"), "BF16")}
    elif fmt == "mxfp4":
        parts = mxfp4.encode(x)
    elif fmt == "nvfp4":
        parts = nvfp4.encode(x)
        if activation_scales:  # ModelOpt's W4A4 NVFP4 (quant_algo NVFP4) writes one beside every quantized weight
            parts["input_scale"] = (np.array(INPUT_SCALE, dtype=np.float32), "F32")
    elif fmt == "rawint4":
        parts = rawint4.encode(x, GROUP)
    else:
        parts = gptq.encode(x, GROUP)
    tensors, dtypes = {}, {}
    for suffix, (arr, dt) in parts.items():
        name = f"{stem}.{suffix}"
        tensors[name], dtypes[name] = arr, dt
    return tensors, dtypes


def tiny_release_config(family: str, fmt: str, variant: str | None = None) -> dict:
    if fmt not in RELEASES:
        raise UsageProblem(f"no tiny release format {fmt!r}", fix=f"choose one of {', '.join(FORMATS)}")
    cfg = tiny_config(family, variant)
    own = families.spec(family).release(fmt)
    cfg.update(json.loads(json.dumps({"quantization_config": own["quantization_config"]} if own else RELEASES[fmt][0])))
    return cfg


def _fused_mxfp4(family: str, variant: str | None = None) -> dict[str, tuple[np.ndarray, str]]:
    """The tiny model with each layer's fused experts (``experts.gate_up_proj [E, H, 2I]``, ``down_proj [E, I, H]``,
    as :func:`ktconvert.model.tiny.tiny_tensors` writes them) stored as ``*_blocks``/``*_scales``."""
    if not families.spec(family).experts.interleaved_gate_up:
        # only that tiny model is written [E, in, out] (transformers 5's saved form); others are per expert or [E, 2I, H]
        raise UsageProblem(f"{family}'s spec asks for fused MXFP4 experts, but its tiny model has no [E, in, out] "
                           "fused experts to store that way", fix="drop checkpoint.releases from its spec")
    out: dict[str, tuple[np.ndarray, str]] = {}
    for name, x in tiny_tensors(family, variant).items():
        if not name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            out[name] = (x, "F32")
            continue
        for suffix, (arr, dt) in mxfp4_fused.encode(x).items():
            out[f"{name}_{suffix}"] = (arr, dt)
    return out


def tiny_release_files(family: str, fmt: str, *, activation_scales: bool = False,
                       variant: str | None = None) -> dict[str, bytes]:
    """config.json, model.safetensors and the tokenizer of the tiny ``family`` model (or its ``variant``) released
    as ``fmt``.

    ``activation_scales`` (NVFP4 only): an F32 ``X.input_scale`` beside each quantized weight, as ModelOpt writes
    its NVFP4 releases; off by default, which keeps the recorded release byte-stable."""
    if activation_scales and fmt != "nvfp4":
        raise UsageProblem(f"activation scales are written for the nvfp4 release only, not {fmt}",
                           fix="drop activation_scales, or ask for nvfp4")
    cfg_json = tiny_release_config(family, fmt, variant)
    which = RELEASES[fmt][1]
    cfg = normalize_config(tiny_config(family, variant))
    tensors, dtypes = {}, {}
    own = families.spec(family).release(fmt)
    if own is not None:  # the spec's layout (the schema allows only fused_mxfp4)
        for name, (arr, dt) in _fused_mxfp4(family, variant).items():
            tensors[name] = arr
            if dt != "F32":
                dtypes[name] = dt
    for spec in tensor_specs(cfg) if own is None else ():
        x = _fill(family, cfg, spec)
        expert = ".experts." in spec.name and spec.kind in ("linear", "out_linear") and len(spec.shape) == 2
        if not (expert if which == "experts" else _is_fp8_weight(spec)):
            tensors[spec.name] = x
            continue
        t, d = _quantize(fmt, spec.name, x, activation_scales)
        tensors.update(t)
        dtypes.update(d)
    # the names the family's releases use (a multimodal wrapper's prefix: the spec's checkpoint.prefix_aliases)
    sp = cfg.spec
    tensors = {sp.published_name(k): v for k, v in tensors.items()}
    dtypes = {sp.published_name(k): v for k, v in dtypes.items()}
    files = {"config.json": (json.dumps(cfg_json, indent=2, sort_keys=True) + "\n").encode("utf-8")}
    files["model.safetensors"] = to_bytes(tensors, {"format": "pt"}, dtypes)
    for name, text in tokenizer_files(VOCAB).items():
        files[name] = text.encode("utf-8")
    return files
