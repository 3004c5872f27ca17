"""K-quant (Q2_K..Q6_K) dequantizers, bit-identical to ggml's ``dequantize_row_q*_K``: numpy, in the C's
operation order (``d * sc`` first, then ``* q``; ``- dmin * m`` last). The quantizers are in ``_jit``.
"""

from __future__ import annotations

import numpy as np

from ._fp import F32, fp16_to_f32

QK_K = 256


def _d16(b: np.ndarray, at: int) -> np.ndarray:
    return fp16_to_f32(np.ascontiguousarray(b[:, at:at + 2]).view(np.uint16)).reshape(-1)


def _unpack_scales_k4(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    sc = np.empty((s.shape[0], 8), dtype=np.uint8)
    m = np.empty((s.shape[0], 8), dtype=np.uint8)
    sc[:, :4] = s[:, 0:4] & 63
    m[:, :4] = s[:, 4:8] & 63
    sc[:, 4:] = (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)
    m[:, 4:] = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return sc, m


def dequantize_q2_k(b: np.ndarray) -> np.ndarray:
    nb = b.shape[0]
    sc = b[:, 0:16]
    qs = b[:, 16:80].reshape(nb, 2, 1, 32)
    d, dmin = _d16(b, 80), _d16(b, 82)
    q = (qs >> (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1)) & 3      # [half, shift, l]
    q = q.reshape(nb, 16, 16).astype(F32)                                         # sub-block = 2*shift + (l>=16)
    dl = d[:, None] * (sc & 0x0F)
    ml = dmin[:, None] * (sc >> 4)
    y = q * dl[:, :, None]
    y -= ml[:, :, None]
    return y.reshape(nb, QK_K)


def dequantize_q3_k(b: np.ndarray) -> np.ndarray:
    nb = b.shape[0]
    hm = b[:, 0:32]
    qs = b[:, 32:96].reshape(nb, 2, 1, 32)
    s = b[:, 96:108]
    d_all = _d16(b, 108)
    lo = s[:, 0:8]
    hi = s[:, 8:12]
    sc = np.empty((nb, 16), dtype=np.int32)
    sc[:, 0:8] = lo & 0x0F
    sc[:, 8:16] = lo >> 4
    for j in range(16):
        sc[:, j] |= ((hi[:, j % 4] >> (2 * (j // 4))) & 3) << 4
    sc -= 32
    q = ((qs >> (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1)) & 3).reshape(nb, 8, 32)
    hbit = (hm[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1   # [bit, l]
    qv = q.astype(np.int32) - np.where(hbit != 0, 0, 4)
    dl = (d_all[:, None] * sc).astype(F32)
    y = qv.reshape(nb, 16, 16).astype(F32) * dl[:, :, None]
    return y.reshape(nb, QK_K)


def dequantize_q4_k(b: np.ndarray) -> np.ndarray:
    nb = b.shape[0]
    d, dmin = _d16(b, 0), _d16(b, 2)
    sc, m = _unpack_scales_k4(b[:, 4:16])
    qs = b[:, 16:144].reshape(nb, 4, 1, 32)
    q = (qs >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    q = q.reshape(nb, 8, 32).astype(F32)
    d1 = d[:, None] * sc
    m1 = dmin[:, None] * m
    y = q * d1[:, :, None]
    y -= m1[:, :, None]
    return y.reshape(nb, QK_K)


def dequantize_q5_k(b: np.ndarray) -> np.ndarray:
    nb = b.shape[0]
    d, dmin = _d16(b, 0), _d16(b, 2)
    sc, m = _unpack_scales_k4(b[:, 4:16])
    qh = b[:, 16:48]
    qs = b[:, 48:176].reshape(nb, 4, 1, 32)
    q = (qs >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    hbit = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1   # sub-block j uses bit j
    q = q.reshape(nb, 8, 32) + (hbit << 4)
    d1 = d[:, None] * sc
    m1 = dmin[:, None] * m
    y = q.astype(F32) * d1[:, :, None]
    y -= m1[:, :, None]
    return y.reshape(nb, QK_K)


def dequantize_q6_k(b: np.ndarray) -> np.ndarray:
    nb = b.shape[0]
    ql = b[:, 0:128].reshape(nb, 2, 2, 32)     # [half, l+0 / l+32, l]
    qh = b[:, 128:192].reshape(nb, 2, 32)
    sc = b[:, 192:208].view(np.int8)
    d = _d16(b, 208)
    q = np.empty((nb, 2, 4, 32), dtype=np.int32)
    q[:, :, 0] = (ql[:, :, 0] & 0x0F) | (((qh >> 0) & 3) << 4)
    q[:, :, 1] = (ql[:, :, 1] & 0x0F) | (((qh >> 2) & 3) << 4)
    q[:, :, 2] = (ql[:, :, 0] >> 4) | (((qh >> 4) & 3) << 4)
    q[:, :, 3] = (ql[:, :, 1] >> 4) | (((qh >> 6) & 3) << 4)
    q -= 32
    dsc = (d[:, None] * sc).astype(F32)         # d * sc[is] first, then * q
    y = q.reshape(nb, 16, 16).astype(F32) * dsc[:, :, None]
    return y.reshape(nb, QK_K)
