"""32-element block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) and the plain float types: dequantizers bit-identical
to ggml's ``dequantize_row_*`` (numpy, in the C's operation order) and the bf16 rounding. The quantizers are in
``_jit``.
"""

from __future__ import annotations

import numpy as np

from ._fp import F32, fp16_to_f32


# ----------------------------------------------------------------------------------------------------
# dequantization, in the C's operation order (``x0*d``, ``x0*d + m``) so results are bit-identical


def _d16(b: np.ndarray, at: int) -> np.ndarray:
    return fp16_to_f32(np.ascontiguousarray(b[:, at:at + 2]).view(np.uint16)).reshape(-1)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    return np.unpackbits(qh, axis=1, bitorder="little")


def dequantize_q8_0(b: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    # int8 -> float32 is exact, then one float32 product: the C's x * d, written straight into ``out``
    return np.multiply(b[:, 2:].view(np.int8), _d16(b, 0)[:, None], out=out, dtype=F32)


def dequantize_q4_0(b: np.ndarray) -> np.ndarray:
    q = _nibbles(b[:, 2:]).astype(F32) - F32(8)
    return q * _d16(b, 0)[:, None]


def dequantize_q4_1(b: np.ndarray) -> np.ndarray:
    y = _nibbles(b[:, 4:]).astype(F32) * _d16(b, 0)[:, None]
    y += _d16(b, 2)[:, None]
    return y


def dequantize_q5_0(b: np.ndarray) -> np.ndarray:
    q = (_nibbles(b[:, 6:]) | (_high_bits(b[:, 2:6]) << 4)).astype(F32) - F32(16)
    return q * _d16(b, 0)[:, None]


def dequantize_q5_1(b: np.ndarray) -> np.ndarray:
    q = (_nibbles(b[:, 8:]) | (_high_bits(b[:, 4:8]) << 4)).astype(F32)
    y = q * _d16(b, 0)[:, None]
    y += _d16(b, 2)[:, None]
    return y


# ----------------------------------------------------------------------------------------------------
# float types (quantized straight into the output by _api; dequantized through (n, 1) "blocks")


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """ggml_compute_fp32_to_bf16 on finite input: round to nearest even on the bit pattern (uint32)."""
    u = x.view(np.uint32)
    r = u >> np.uint32(16)
    r &= np.uint32(1)
    r += np.uint32(0x7FFF)
    r += u
    r >>= np.uint32(16)
    return r


def dequantize_f32(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(F32).reshape(-1, 1).copy()


def dequantize_f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(F32).reshape(-1, 1)


def dequantize_bf16(b: np.ndarray) -> np.ndarray:
    return (np.ascontiguousarray(b).view(np.uint16).astype(np.uint32) << 16).view(F32).reshape(-1, 1)
