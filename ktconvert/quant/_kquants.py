"""K-quant (Q2_K..Q6_K) dequantizers, bit-identical to ggml's ``dequantize_row_q*_K``: compiled loops (numba,
:mod:`ktconvert.quant._jit`'s exactness rules) in the C's operation order (``d * sc`` first, then ``* q``;
``- dmin * m`` last), each writing a block's 256 floats straight into the caller's output. The quantizers are in
``_jit``.

Why compiled and in place: a streamed verify decodes every expert a token picks, one at a time, within its
memory budget. The numpy formulation made five to six full-size temporaries per chunk (codes, their float32
copy, the products), freshly mapped under the streamed run's heap policy (:mod:`ktconvert.io.heap`) and outside
the budget's count; these loops make none and run several times faster (docs/measurements.md).

Each kernel takes ``b``, uint8 blocks ``(n_blocks, type_size)``, and ``out``, float32 ``(n_blocks, 256)``.
"""

from __future__ import annotations

import numpy as np

from ._jit import _OPTS, F32, _fp16_f32, _njit

QK_K = 256


@_njit(inline="always", **_OPTS)
def _h(b, i, at):
    """The fp16 at byte ``at`` of block ``i`` as float32."""
    return _fp16_f32(np.int64(b[i, at]) | (np.int64(b[i, at + 1]) << 8))


@_njit(inline="always", **_OPTS)
def _scale_min_k4(s, i, j):
    """Q4_K/Q5_K's 6-bit scale and min of sub-block ``j`` from the 12 bytes at ``s`` (ggml's get_scale_min_k4)."""
    if j < 4:
        return np.int64(s[i, 4 + j] & 63), np.int64(s[i, 8 + j] & 63)
    sc = (s[i, 8 + j] & 0x0F) | ((s[i, j] >> 6) << 4)
    m = (s[i, 8 + j] >> 4) | ((s[i, 4 + j] >> 6) << 4)
    return np.int64(sc), np.int64(m)


@_njit(**_OPTS)
def _q2_k(b, out):
    for i in range(b.shape[0]):
        d, dmin = _h(b, i, 80), _h(b, i, 82)
        for sub in range(16):  # element sub * 16 + t: half h, shift, l = (sub % 2) * 16 + t
            h, shift, half = sub // 8, (sub // 2) % 4, (sub % 2) * 16
            sc = b[i, sub]
            dl = d * F32(sc & 0x0F)
            ml = dmin * F32(sc >> 4)
            for t in range(16):
                q = F32((b[i, 16 + h * 32 + half + t] >> (2 * shift)) & 3)
                out[i, sub * 16 + t] = q * dl - ml


@_njit(**_OPTS)
def _q3_k(b, out):
    sc = np.empty(16, np.int64)
    for i in range(b.shape[0]):
        d = _h(b, i, 108)
        for j in range(16):
            lo = b[i, 96 + j] & 0x0F if j < 8 else b[i, 96 + j - 8] >> 4
            sc[j] = (np.int64(lo) | (np.int64((b[i, 104 + j % 4] >> (2 * (j // 4))) & 3) << 4)) - 32
        for h in range(2):
            for shift in range(4):
                k = h * 4 + shift
                for l in range(32):
                    q = np.int64((b[i, 32 + h * 32 + l] >> (2 * shift)) & 3)
                    if (b[i, l] >> k) & 1 == 0:
                        q -= 4
                    flat = k * 32 + l
                    out[i, flat] = F32(q) * (d * F32(sc[flat // 16]))


@_njit(**_OPTS)
def _q4_k(b, out):
    for i in range(b.shape[0]):
        d, dmin = _h(b, i, 0), _h(b, i, 2)
        for j in range(8):
            sc, m = _scale_min_k4(b, i, j)
            d1 = d * F32(sc)
            m1 = dmin * F32(m)
            c, s = j // 2, 4 * (j % 2)
            for l in range(32):
                out[i, j * 32 + l] = F32((b[i, 16 + c * 32 + l] >> s) & 0x0F) * d1 - m1


@_njit(**_OPTS)
def _q5_k(b, out):
    for i in range(b.shape[0]):
        d, dmin = _h(b, i, 0), _h(b, i, 2)
        for j in range(8):
            sc, m = _scale_min_k4(b, i, j)
            d1 = d * F32(sc)
            m1 = dmin * F32(m)
            c, s = j // 2, 4 * (j % 2)
            for l in range(32):
                q = ((b[i, 48 + c * 32 + l] >> s) & 0x0F) + (((b[i, 16 + l] >> j) & 1) << 4)
                out[i, j * 32 + l] = F32(q) * d1 - m1


@_njit(**_OPTS)
def _q6_k(b, out):
    for i in range(b.shape[0]):
        d = _h(b, i, 208)
        for sub in range(16):  # element sub * 16 + t: half h, group g, l = (sub % 2) * 16 + t
            h, g, half = sub // 8, (sub // 2) % 4, (sub % 2) * 16
            a, s = g % 2, 4 * (g // 2)
            sc = np.int64(b[i, 192 + sub])
            dsc = d * F32(sc - 256 if sc > 127 else sc)
            for t in range(16):
                l = half + t
                ql = (b[i, h * 64 + a * 32 + l] >> s) & 0x0F
                qh = (b[i, 128 + h * 32 + l] >> (2 * g)) & 3
                out[i, sub * 16 + t] = F32(np.int64(ql | (qh << 4)) - 32) * dsc


def _into(kernel):
    def dequantize(b: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        b = np.ascontiguousarray(b)
        if out is None:
            out = np.empty((b.shape[0], QK_K), dtype=F32)
        kernel(b, out)
        return out

    dequantize.__name__ = kernel.__name__.replace("_", "dequantize_", 1)
    return dequantize


dequantize_q2_k = _into(_q2_k)
dequantize_q3_k = _into(_q3_k)
dequantize_q4_k = _into(_q4_k)
dequantize_q5_k = _into(_q5_k)
dequantize_q6_k = _into(_q6_k)
