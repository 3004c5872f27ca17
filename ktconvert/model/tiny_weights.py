"""The tiny checkpoints' configs, tensors and files (every family), for conversion tests, goldens and demos;
:mod:`ktconvert.model.tiny` writes them (and the release and LoRA variants built on this module).

Every byte is a function of this file and the family specs alone: configs are literal data (each spec's
``tiny.config`` in ``rules/families/``) in the spelling transformers 5.23 writes, weights come from the
frozen splitmix64 stream (:mod:`ktconvert.model.rng`), the safetensors bytes from a fixed serialiser (:func:`ktconvert.formats.safetensors_write.to_bytes`) and the tokenizer from a fixed BPE training run
(:mod:`ktconvert.model.tinytok`). numpy is the only dependency; torch is not needed.

Sizes: hidden 256, expert intermediate 256 (every expert row a multiple of 256, so K-quants apply), 8
experts, top-2, vocab 512; DeepSeek with one dense first layer, shared experts, MLA and YaRN rope.

Routing is designed, not left to chance, so bf16 rounding cannot flip an expert choice. Eight hidden
dimensions (``routing_channels``) carry a per-token code: the token's two designated experts' channels hold
+1.5 and +1.0, the others -1.0. No module writes to those dimensions (their rows are zero in every matrix
that outputs into the residual stream), so the code reaches every MoE layer unchanged, scaled only by the
RMSNorm. Each layer's router reads the channels through its own permutation (different experts per layer)
plus small noise, which leaves a logit gap of several units between the chosen and the rejected experts.
DeepSeek-V3's last MoE layer adds a score-correction bias large enough to pull one expert into every
token's selection, so ignoring ``e_score_correction_bias`` changes the routing there.
"""

from __future__ import annotations

import copy
import json

import numpy as np

from ktconvert import arch, families
from ktconvert.errors import UsageProblem
from ktconvert.families.config import FAMILIES, MoeConfig, normalize_config
from ktconvert.arch.tensors import TensorSpec, tensor_specs  # noqa: F401 (the tiny models' tensor list)
from ktconvert.formats.safetensors_write import to_bytes
from ktconvert.model import rng
from ktconvert.model.tinytok import tokenizer_files

SEED = "ktconvert-tiny-v1"
VOCAB = 512
HIDDEN = 256
EXPERTS = 8
BOS_ID, EOS_ID = VOCAB - 2, VOCAB - 1

_COMMON = {
    "architectures": None,
    "bos_token_id": BOS_ID,
    "dtype": "float32",
    "eos_token_id": EOS_ID,
    "hidden_act": "silu",
    "hidden_size": HIDDEN,
    "initializer_range": 0.02,
    "max_position_embeddings": 256,
    "num_attention_heads": 4,
    "num_experts_per_tok": 2,
    "output_router_logits": False,
    "pad_token_id": None,
    "rms_norm_eps": 1e-06,
    "tie_word_embeddings": False,
    "transformers_version": "5.23.0",
    "use_cache": True,
    "vocab_size": VOCAB,
}

# routing design (see the module docstring)
# code levels: (first designated expert, second, every other expert)
# (a spec's tiny.code_levels / tiny.router_gain override these: sigmoid scores saturate, so DeepSeek-V3's levels
# sit further apart to keep a wide gap in score space)
CODE_LEVELS_DEFAULT = (1.5, 1.0, -1.0)
ROUTER_GAIN_DEFAULT = 2.0
ROUTER_NOISE = 0.005
V3_BIAS_BOOST = 0.9
# matrices writing into the residual stream: half the usual scale keeps hidden states small (|h| <= ~5),
# so float32 rounding, which grows with magnitude, stays far below the 1e-5 comparisons
OUT_GAIN = 0.5


def routing_channels(hidden: int = HIDDEN, experts: int = EXPERTS) -> list[int]:
    """The hidden dimensions that carry each token's routing code, spread evenly over the width."""
    return [j * (hidden // experts) for j in range(experts)]


# common keys a multimodal wrapper's config.json keeps at its top level; the others go under its text_config
_WRAPPER_KEYS = ("architectures", "dtype", "tie_word_embeddings", "transformers_version")


def tiny_config(family: str, variant: str | None = None) -> dict:
    """The ``config.json`` dict of a tiny model (a fresh copy): the common keys, then the spec's ``tiny.config``
    (exactly the keys and values transformers 5.23's save_pretrained writes), then a ``variant``'s keys (a released
    configuration of the family in its own spelling: its ``remove`` list dropped, its ``config`` written as given,
    ``null`` included: Moonlight's ``q_lora_rank: null`` differs from an absent key, which transformers reads as 1536).
    A spec whose tiny config nests a ``text_config`` (multimodal wrappers) gets the common text-model keys there."""
    if family not in FAMILIES:
        raise UsageProblem(f"unknown family {family!r}", fix=f"choose one of {', '.join(FAMILIES)}")
    own = families.spec(family).tiny["config"]
    if "text_config" in own:
        top = {k: _COMMON[k] for k in _WRAPPER_KEYS}
        text = {k: v for k, v in _COMMON.items() if k not in _WRAPPER_KEYS or k == "tie_word_embeddings"}
        cfg = {**top, **own, "text_config": {**text, **own["text_config"]}}
    else:
        cfg = {**_COMMON, **own}
    if variant is not None:
        known = families.spec(family).tiny.get("variants") or {}
        if variant not in known:
            raise UsageProblem(f"no tiny variant {variant!r} of {family}",
                               fix=f"choose one of {', '.join(known) or '(none: this family has no variants)'}")
        for key in known[variant].get("remove", ()):
            cfg.pop(key, None)
        cfg.update(known[variant]["config"])
        if "text_config" in known[variant]:  # keys over a multimodal wrapper's text_config
            cfg["text_config"] = {**cfg["text_config"], **known[variant]["text_config"]}
    return copy.deepcopy(cfg)
def tiny_name(family: str, variant: str | None = None) -> str:
    """How golden/tiny-models.yaml and the goldens name a tiny model: ``FAMILY`` or ``FAMILY-VARIANT``."""
    return family if variant is None else f"{family}-{variant}"


#: every (family, variant) pair the specs declare
TINY_VARIANTS: tuple[tuple[str, str], ...] = tuple(
    (f, v) for f in FAMILIES for v in (families.spec(f).tiny.get("variants") or {}))


def _code_levels(family: str) -> tuple[float, float, float]:
    return tuple(families.spec(family).tiny.get("code_levels", CODE_LEVELS_DEFAULT))


def _expert_gain(family: str) -> float:
    """A spec's tiny.expert_gain widens the experts' gate/up outputs (so a clamped activation clamps)."""
    return families.spec(family).tiny.get("expert_gain", 1.0)


def _router_gain(family: str) -> float:
    return families.spec(family).tiny.get("router_gain", ROUTER_GAIN_DEFAULT)


def _fp8_variant(family: str) -> tuple[tuple[int, int], str] | None:
    fp8 = families.spec(family).tiny.get("fp8") if family in FAMILIES else None
    return None if fp8 is None else (tuple(fp8["weight_block_size"]), fp8["scale_dtype"])


def token_codes(vocab: int = VOCAB, experts: int = EXPERTS, groups: int = 1) -> np.ndarray:
    """``[vocab, 2]``: each token's two designated code channels (distinct). With ``groups`` > 1 (group-limited
    routing) the channels form that many consecutive groups and the two lie in different ones: a second channel
    drawn in the first's group moves to the same place in the next group."""
    first = rng.randint(rng.stream_key(SEED, "code", "first"), vocab, experts)
    offset = rng.randint(rng.stream_key(SEED, "code", "second"), vocab, experts - 1)
    second = (first + 1 + offset) % experts
    if groups > 1:
        size = experts // groups
        second = np.where(second // size == first // size, (second + size) % experts, second)
    return np.stack([first, second], axis=1)


def router_permutation(family: str, layer: int | str, experts: int = EXPERTS, groups: int = 1) -> list[int]:
    """Which expert each routing channel drives in one MoE layer (``perm[channel]``). With ``groups`` > 1 a channel
    group goes to one expert group as a whole (groups in a drawn order, the experts in a drawn order within), so a
    token's two channels, in different groups (:func:`token_codes`), pick experts of two different groups: the
    group selection then compares a designated expert's score with rejected ones, never two rejected groups."""
    if groups <= 1:
        return rng.permutation(rng.stream_key(SEED, family, "router-perm", layer), experts)
    size = experts // groups
    order = rng.permutation(rng.stream_key(SEED, family, "router-perm", layer), groups)
    within = [rng.permutation(rng.stream_key(SEED, family, "router-perm", layer, g), size) for g in range(groups)]
    return [order[j // size] * size + within[j // size][j % size] for j in range(experts)]


class _Draws:
    """What a mechanism's own role filler (``fills`` of its ``ktconvert/arch/`` module) draws from: this module's
    seeded streams and the tokens' routing codes."""

    def __init__(self, family: str, cfg: MoeConfig):
        self.family, self.cfg = family, cfg

    def permutation(self, *key, n: int) -> list[int]:
        return rng.permutation(rng.stream_key(SEED, self.family, *key), n)

    def token_codes(self) -> np.ndarray:
        return token_codes(self.cfg.vocab_size, self.cfg.num_experts)


_ROLE_FILLS = arch.role_fills()


def _fill(family: str, cfg: MoeConfig, spec: TensorSpec) -> np.ndarray:
    n = int(np.prod(spec.shape))
    u = rng.uniform_pm1(rng.stream_key(SEED, family, spec.name), n).reshape(spec.shape)
    chans = routing_channels(cfg.hidden_size, cfg.num_experts)
    if spec.kind == "norm":
        out = 1.0 + 0.1 * u
    elif spec.kind == "norm0":  # zero-centred: the model scales by 1 + weight
        out = 0.1 * u
    elif spec.kind == "conv":  # depthwise: fan-in is the kernel width
        out = u * (3.0 ** 0.5 / spec.shape[-1] ** 0.5)
    elif spec.kind == "dt_bias":
        out = 1.0 + 0.1 * u
    elif spec.kind == "a_log":  # decay rates exp(A_log) in [0.5, 2]
        out = 0.7 * u
    elif spec.kind == "bias":
        out = 0.1 * u
    elif spec.kind == "out_bias":
        out = 0.1 * u
        out[chans] = 0.0
    elif spec.kind == "sink":
        out = u.copy()
    elif spec.kind in ("linear", "head"):
        out = u * (3.0 ** 0.5 / spec.shape[1] ** 0.5)  # std 1/sqrt(fan_in)
        if ".experts." in spec.name:
            out = out * _expert_gain(family)
    elif spec.kind == "out_linear":
        out = u * (OUT_GAIN * 3.0 ** 0.5 / spec.shape[1] ** 0.5)
        out[chans, :] = 0.0
    elif spec.kind == "embed":
        out = u.copy()
        codes = token_codes(cfg.vocab_size, cfg.num_experts, cfg.routing.groups)
        first, second, rest = _code_levels(family)
        levels = np.full((cfg.vocab_size, cfg.num_experts), rest)
        levels[np.arange(cfg.vocab_size), codes[:, 0]] = first
        levels[np.arange(cfg.vocab_size), codes[:, 1]] = second
        out[:, chans] = levels
    elif spec.kind == "router":
        layer = spec.name.split(".")[2]
        perm = router_permutation(family, layer, cfg.num_experts, cfg.routing.groups)
        out = ROUTER_NOISE * u
        gain = _router_gain(family)
        for j, ch in enumerate(chans):
            out[perm[j], ch] += gain
    elif spec.kind in _ROLE_FILLS:  # a role of one mechanism's own (hash routing's tid2eid table)
        return _ROLE_FILLS[spec.kind](cfg, spec.name, spec.shape, _Draws(family, cfg))
    elif spec.kind == "score_bias":
        out = 0.02 * np.abs(u)  # non-negative: upstream masks with 0.0 or -inf, which then agree
        layer = int(spec.name.split(".")[2])
        if layer == max(cfg.mlp.moe_layers):
            boosted = rng.randint(rng.stream_key(SEED, family, "boost", layer), 1, cfg.num_experts)[0]
            out[boosted] += families.spec(family).tiny.get("bias_boost", V3_BIAS_BOOST)
    else:
        raise ValueError(f"unknown tensor kind {spec.kind!r}")
    return out.astype(np.float32)


def tiny_tensors(family: str, variant: str | None = None) -> dict[str, np.ndarray]:
    """All weights of the tiny ``family`` model (or its ``variant``) as float32 numpy arrays, by checkpoint name as
    the published checkpoints spell it (a multimodal wrapper's prefix: the spec's ``checkpoint.prefix_aliases``)."""
    raw = tiny_config(family, variant)
    cfg = normalize_config(raw)
    sp = families.spec(family)
    tensors = {spec.name: _fill(family, cfg, spec) for spec in tensor_specs(cfg)}
    if cfg.spec.experts.interleaved_gate_up:
        tensors = fuse_interleaved(cfg, tensors)
    if sp.fused_orientation:
        tensors = _packed(cfg, tensors, sp.fused_orientation)
    return {sp.published_name(name): arr for name, arr in tensors.items()}


def _packed(cfg: MoeConfig, tensors: dict[str, np.ndarray], orientation: str) -> dict[str, np.ndarray]:
    """Per-expert tensors packed per layer as the spec's releases store them: ``gate_up_proj`` ``[E, 2I, H]`` (gate rows
    first) and ``down_proj`` ``[E, H, I]``, or both transposed (``[E, H, 2I]``, ``[E, I, H]``); no ``.weight``."""
    gate_n, up_n, down_n = cfg.expert_proj_names
    out: dict[str, np.ndarray] = {}
    for name, arr in tensors.items():
        if ".experts." not in name:
            out[name] = arr
            continue
        prefix = name.split(".experts.")[0] + ".experts"
        if f"{prefix}.gate_up_proj" in out:
            continue
        per = range(cfg.num_experts)
        gu = np.stack([np.concatenate([tensors[f"{prefix}.{e}.{gate_n}.weight"], tensors[f"{prefix}.{e}.{up_n}.weight"]])
                       for e in per])
        down = np.stack([tensors[f"{prefix}.{e}.{down_n}.weight"] for e in per])
        if orientation == "transposed":
            gu, down = gu.transpose(0, 2, 1), down.transpose(0, 2, 1)
        out[f"{prefix}.gate_up_proj"] = np.ascontiguousarray(gu)
        out[f"{prefix}.down_proj"] = np.ascontiguousarray(down)
    return out



def fuse_interleaved(cfg: MoeConfig, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per-expert tensors in the layout transformers 5 saves a family with interleaved fused experts (gpt-oss,
    which it cannot load per expert): ``experts.gate_up_proj [E, H, 2I]`` with gate at even and up at odd
    columns, ``experts.down_proj [E, I, H]``, and the biases ``gate_up_proj_bias [E, 2I]`` / ``down_proj_bias
    [E, H]``. The layer's other tensors keep their place; the fused ones follow them."""
    g, u, d = cfg.expert_proj_names
    out: dict[str, np.ndarray] = {}
    done: set[str] = set()
    for name, arr in tensors.items():
        head, sep, rest = name.partition(".experts.")
        if not sep:
            out[name] = arr
            continue
        prefix = f"{head}.experts"
        if prefix in done:
            continue
        done.add(prefix)
        n = cfg.num_experts

        def stack(proj: str, kind: str) -> np.ndarray:
            return np.stack([tensors[f"{prefix}.{e}.{proj}.{kind}"] for e in range(n)])

        gate, up = stack(g, "weight"), stack(u, "weight")  # [E, I, H]
        gu = np.empty((n, cfg.hidden_size, 2 * cfg.mlp.moe_intermediate_size), dtype=np.float32)
        gu[:, :, 0::2], gu[:, :, 1::2] = gate.transpose(0, 2, 1), up.transpose(0, 2, 1)
        out[f"{prefix}.gate_up_proj"] = gu
        if f"{prefix}.0.{g}.bias" in tensors:
            gb = np.empty((n, 2 * cfg.mlp.moe_intermediate_size), dtype=np.float32)
            gb[:, 0::2], gb[:, 1::2] = stack(g, "bias"), stack(u, "bias")
            out[f"{prefix}.gate_up_proj_bias"] = gb
        out[f"{prefix}.down_proj"] = np.ascontiguousarray(stack(d, "weight").transpose(0, 2, 1))
        if f"{prefix}.0.{d}.bias" in tensors:
            out[f"{prefix}.down_proj_bias"] = stack(d, "bias")
    return out


def tiny_files(family: str, variant: str | None = None) -> dict[str, bytes]:
    """The files of the tiny checkpoint: ``config.json``, ``model.safetensors`` and the tokenizer."""
    files = {"config.json": (json.dumps(tiny_config(family, variant), indent=2, sort_keys=True) + "\n").encode("utf-8")}
    files["model.safetensors"] = to_bytes(tiny_tensors(family, variant), {"format": "pt"})
    for name, text in tokenizer_files(VOCAB).items():
        files[name] = text.encode("utf-8")
    return files


# FP8 block-scaled variants, as the releases of these families ship: each spec's tiny.fp8 (weight_block_size, scale
# dtype). The blocks are smaller than the releases' 128x128 and do not divide every tiny dimension, so edge blocks
# are exercised (DeepSeek-V3: 80-row kv_a_proj, 256/128/64-column matrices against 48-column blocks; Qwen3-MoE:
# every dim).
FP8_VARIANTS: dict[str, tuple[tuple[int, int], str]] = {f: _fp8_variant(f) for f in FAMILIES if _fp8_variant(f)}


def _is_fp8_weight(spec: TensorSpec) -> bool:
    """The linear layers FP8 releases store in FP8: attention, dense and expert MLPs (Linear ``.weight`` matrices);
    not the router, the shared expert's scalar gate, embeddings, head, norms, nor bare parameters (GLM-5-Next's
    hyper-connection and k-pool matrices)."""
    return (spec.kind in ("linear", "out_linear") and len(spec.shape) == 2 and spec.name.endswith(".weight")
            and not spec.name.endswith("_gate.weight"))


def tiny_fp8_config(family: str) -> dict:
    if family not in FP8_VARIANTS:
        raise UsageProblem(f"no FP8 variant of the tiny {family} model",
                           fix=f"choose one of {', '.join(FP8_VARIANTS)}")
    cfg = tiny_config(family)
    cfg["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                  "weight_block_size": list(FP8_VARIANTS[family][0])}
    return cfg


def tiny_fp8_files(family: str) -> dict[str, bytes]:
    """The tiny model quantized to FP8 block-scaled weights with ``_scale_inv`` companions (amax/448 per block,
    round-to-nearest-even codes); every other tensor stays F32."""
    from ktconvert.formats import fp8

    cfg_json = tiny_fp8_config(family)
    block, scale_dtype = FP8_VARIANTS[family]
    cfg = normalize_config(tiny_config(family))
    sp = families.spec(family)
    tensors, dtypes = {}, {}
    for spec in tensor_specs(cfg):
        x = _fill(family, cfg, spec)
        name = sp.published_name(spec.name)  # a multimodal wrapper's release prefix (GLM-5-Next)
        if not _is_fp8_weight(spec):
            tensors[name] = x
            continue
        codes, scale = fp8.quantize(x, block, scale_dtype)
        tensors[name], dtypes[name] = codes, fp8.FP8_DTYPE
        sname = name + fp8.SCALE_SUFFIX
        tensors[sname] = fp8.to_bits(scale, scale_dtype)
        dtypes[sname] = scale_dtype
    files = {"config.json": (json.dumps(cfg_json, indent=2, sort_keys=True) + "\n").encode("utf-8")}
    files["model.safetensors"] = to_bytes(tensors, {"format": "pt"}, dtypes)
    for name, text in tokenizer_files(VOCAB).items():
        files[name] = text.encode("utf-8")
    return files
