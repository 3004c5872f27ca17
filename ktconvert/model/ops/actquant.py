"""Activation rounding of ggml's CPU dot products, as a float round trip (quantize, then dequantize).

ggml multiplies a weight row of type W with an activation row converted to W's ``vec_dot_type`` (Q8_0 for
Q8_0/Q4_0/Q5_0, Q8_1 for Q4_1/Q5_1, Q8_K for the K-quants, F16/BF16/F32 for themselves). The product of the
dequantized weights with the round-tripped activations equals the kernel's integer dot product up to float
summation order, so emulating the rounding is enough to reproduce the kernel's error.

Rounding follows the x86 SIMD ``from_float`` the kernel calls: Q8_0/Q8_1 scale by ``127/amax`` and round half
to even, with the block scale stored as fp16; Q8_K (``quantize_row_q8_K_ref``, which x86 uses) scales by
``-127/max`` (``max`` the signed value of largest magnitude), rounds half to even, clamps at 127 and keeps the
scale in float32. Q8_1's extra fp16 block sum (used for the min term of Q4_1/Q5_1) is not rounded here.
"""

from __future__ import annotations

import torch

# weight type -> the type ggml converts activations to before the dot product (ggml-cpu type traits)
VEC_DOT_TYPE: dict[str, str] = {
    "F32": "F32",
    "F16": "F16",
    "BF16": "BF16",
    "Q4_0": "Q8_0",
    "Q5_0": "Q8_0",
    "Q8_0": "Q8_0",
    "Q4_1": "Q8_1",
    "Q5_1": "Q8_1",
    "IQ4_NL": "Q8_0",
    "Q2_K": "Q8_K",
    "Q3_K": "Q8_K",
    "Q4_K": "Q8_K",
    "Q5_K": "Q8_K",
    "Q6_K": "Q8_K",
    "IQ4_XS": "Q8_K",
    "IQ3_S": "Q8_K",
    "IQ3_XXS": "Q8_K",
    "IQ2_XXS": "Q8_K",
    "IQ2_XS": "Q8_K",
    "IQ2_S": "Q8_K",
    "IQ1_S": "Q8_K",
    "IQ1_M": "Q8_K",
}

BLOCK = {"Q8_0": 32, "Q8_1": 32, "Q8_K": 256}


def vec_dot_type(weight_type: str) -> str | None:
    """The activation type ggml's CPU kernels use with ``weight_type``; None when this table does not know it."""
    return VEC_DOT_TYPE.get(weight_type)


def _div(num: float, den: torch.Tensor) -> torch.Tensor:
    """``num / den`` rounded once, as C's float division (torch's ``scalar / tensor`` multiplies by a
    reciprocal, which can land one ulp away)."""
    return torch.div(torch.full_like(den, num), den)


def _q8_0(x: torch.Tensor) -> torch.Tensor:
    blocks = x.reshape(-1, 32)
    amax = blocks.abs().amax(dim=1, keepdim=True)
    d = (amax / 127.0).to(torch.float16).to(torch.float32)
    inv = torch.where(amax > 0, _div(127.0, torch.where(amax > 0, amax, torch.ones_like(amax))), torch.zeros_like(amax))
    q = torch.round(blocks * inv).clamp_(-127, 127)  # torch.round: half to even, as _mm256_round_ps
    return (q * d).reshape(x.shape)


def _q8_k(x: torch.Tensor) -> torch.Tensor:
    blocks = x.reshape(-1, 256)
    idx = blocks.abs().argmax(dim=1, keepdim=True)  # first index of the largest magnitude, as the C loop
    vmax = blocks.gather(1, idx)
    nonzero = vmax != 0
    iscale = torch.where(nonzero, _div(-127.0, torch.where(nonzero, vmax, torch.ones_like(vmax))), torch.zeros_like(vmax))
    q = torch.round(blocks * iscale).clamp_(max=127)  # nearest_int() is round half to even
    d = torch.where(nonzero, _div(1.0, torch.where(nonzero, iscale, torch.ones_like(iscale))), torch.zeros_like(iscale))
    return (q * d).reshape(x.shape)


def round_trip(x: torch.Tensor, act_type: str) -> torch.Tensor:
    """``x`` (float32, rows along the last axis) as the kernel sees it after conversion to ``act_type``."""
    if act_type == "F32":
        return x
    if act_type == "F16":
        return x.to(torch.float16).to(torch.float32)
    if act_type == "BF16":
        return x.to(torch.bfloat16).to(torch.float32)
    if act_type in ("Q8_0", "Q8_1"):
        fn = _q8_0
    elif act_type == "Q8_K":
        fn = _q8_k
    else:
        raise ValueError(f"no activation rounding for {act_type}")
    if x.shape[-1] % BLOCK[act_type]:
        raise ValueError(f"{act_type} activations need rows that are a multiple of {BLOCK[act_type]}, got {x.shape[-1]}")
    return fn(x.to(torch.float32))
