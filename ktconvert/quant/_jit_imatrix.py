"""Compiled (numba) quantizers that take an importance matrix, byte-exact with ggml's ``quantize_row_*_impl``
(what ``ggml_quantize_chunk(..., imatrix)`` and so ``llama-quantize --imatrix`` run), and the IQ4 types.

With an importance matrix ggml takes another search than its reference path: per element a weight
``qw[i] * sqrt(sigma2 + x[i]^2)`` (``sigma2`` the mean square of the super-block, or of the whole row for the
32-element types), a least-squares fit of scale and min over 37 trial grids (``make_qkx3_quants``), and the
super-block's 6-bit (or 4-bit) sub-scales fitted to the sub-block scales in turn, weighted by the sub-blocks'
summed weights (``make_qp_quants``). Q6_K weights its search by ``qw`` alone. IQ4_NL / IQ4_XS pick, per
32-element block, the nearest of the 16 non-linear levels for 15 trial scales; without an importance matrix the
weights are ``x^2`` (ggml quantizes IQ4 that way too, ``quantize_iq4_*(..., NULL)``).

The exactness rules of ``_jit`` hold here (every value float32, the C's summation order and parenthesisation,
no FMA, ``nearest_int`` and the C's integer stores emulated: ``uint8_t`` levels wrap, ``int8_t`` sub-scales
wrap). Every kernel takes whole rows: ``x`` float32 ``(rows, n)``, ``qw`` float32 ``(E, n)`` (one importance
row per expert; row ``r`` of the call uses ``qw[(r0 + r) // rows_per_expert]``), and fills ``out`` uint8
``(rows, row_bytes)``. The IQ4 kernels take ``qw`` with zero rows for "no importance matrix".
"""

from __future__ import annotations

import numpy as np

from ._jit import (
    _OPTS,
    F0,
    F1,
    F_0_1,
    F_15,
    F_32,
    F_EPS,
    F_63,
    F32,
    _fp16,
    _fp16_f32,
    _i8,
    _njit,
    _put16,
    nearest_int,
)

F_RMIN = F32(-0.9)       # make_qkx3_quants' rmin, rdelta and nstep as every _impl passes them
F_RDELTA = F32(0.05)
NSTEP = 36
F_TWO = F32(2.0)
F_256 = F32(256.0)

#: the 16 levels of IQ4_NL / IQ4_XS (ggml's ``kvalues_iq4nl``; also in the gguf package's dequantizer)
IQ4NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int64)


@_njit(inline="always", **_OPTS)
def _qrow(qw, r0, r, rpe):
    """The importance row for row ``r`` of this call."""
    return qw[0] if qw.shape[0] == 1 else qw[(r0 + r) // rpe]


@_njit(inline="always", **_OPTS)
def _weights(x, o, n, qw, sigma2, w):
    """``w[i] = qw[o+i] * sqrtf(sigma2 + x[o+i]^2)``; returns their sequential sum."""
    s = F0
    for i in range(n):
        v = x[o + i]
        w[i] = qw[o + i] * np.sqrt(sigma2 + v * v)
        s += w[i]
    return s


@_njit(inline="always", **_OPTS)
def _sum_sq(x, o, n):
    s = F0
    for i in range(n):
        v = x[o + i]
        s += v * v
    return s


@_njit(**_OPTS)
def _qkx3(x, o, n, w, nmax, L, lo, Laux):
    """make_qkx3_quants(n, nmax, x + o, w, L + lo, &the_min, Laux, -0.9f, 0.05f, 36, false): returns
    (scale, the_min); ``min`` is updated in place when a trial is taken, as in the C."""
    fnmax = F32(nmax)
    mn = x[o]
    mx = x[o]
    sum_w = w[0]
    sum_x = sum_w * x[o]
    for i in range(1, n):
        v = x[o + i]
        if v < mn:
            mn = v
        if v > mx:
            mx = v
        sum_w += w[i]
        sum_x += w[i] * v
    if mn > F0:
        mn = F0
    if mx <= mn:
        for i in range(n):
            L[lo + i] = 0
        return F0, -mn
    iscale = fnmax / (mx - mn)
    scale = F1 / iscale
    best = F0
    for i in range(n):
        v = x[o + i]
        l = min(nmax, max(0, nearest_int(iscale * (v - mn))))
        L[lo + i] = l
        diff = scale * F32(l) + mn - v
        best += w[i] * (diff * diff)
    for k in range(NSTEP + 1):
        iscale = (F_RMIN + F_RDELTA * F32(k) + fnmax) / (mx - mn)
        sl = F0
        sl2 = F0
        sxl = F0
        for i in range(n):
            v = x[o + i]
            l = min(nmax, max(0, nearest_int(iscale * (v - mn))))
            Laux[i] = l
            fl = F32(l)
            wl = w[i] * fl
            sl += wl
            sl2 += wl * fl
            sxl += wl * v
        D = sum_w * sl2 - sl * sl
        if D > F0:
            ts = (sum_w * sxl - sum_x * sl) / D
            tm = (sl2 * sum_x - sl * sxl) / D
            if tm > F0:
                tm = F0
                ts = sxl / sl2
            mad = F0
            for i in range(n):
                diff = ts * F32(Laux[i]) + tm - x[o + i]
                mad += w[i] * (diff * diff)
            if mad < best:
                for i in range(n):
                    L[lo + i] = Laux[i]
                best = mad
                scale = ts
                mn = tm
    return scale, -mn


@_njit(**_OPTS)
def _qp(n, nmax, x, L, qw):
    """make_qp_quants(n, nmax, x, L, qw): levels >= 0 for non-negative ``x``, stored as the C's uint8 (a negative
    level wraps)."""
    fnmax = F32(nmax)
    mx = F0
    for i in range(n):
        mx = mx if mx > x[i] else x[i]
    if mx < F_EPS:
        for i in range(n):
            L[i] = 0
        return F0
    iscale = fnmax / mx
    for i in range(n):
        L[i] = nearest_int(iscale * x[i]) & 0xFF
    scale = F1 / iscale
    best = F0
    for i in range(n):
        diff = x[i] - scale * F32(L[i])
        best += qw[i] * diff * diff
    for k in range(-4, 5):
        if k == 0:
            continue
        isc = (F_0_1 * F32(k) + fnmax) / mx
        sc = F1 / isc
        mse = F0
        for i in range(n):
            l = min(nmax, nearest_int(isc * x[i]))
            diff = x[i] - sc * F32(l)
            mse += qw[i] * diff * diff
        if mse < best:
            best = mse
            iscale = isc
    sumlx = F0
    suml2 = F0
    for i in range(n):
        l = min(nmax, nearest_int(iscale * x[i]))
        L[i] = l & 0xFF
        fl = F32(l)
        sumlx += qw[i] * x[i] * fl
        suml2 += qw[i] * fl * fl
    for _ in range(5):
        changed = 0
        for i in range(n):
            w = qw[i]
            li = F32(L[i])
            slx = sumlx - w * x[i] * li
            sl2 = suml2 - w * li * li
            if slx > F0 and sl2 > F0:
                nl = min(nmax, nearest_int(x[i] * sl2 / slx))
                if nl != L[i]:
                    fn = F32(nl)
                    slx += w * x[i] * fn
                    sl2 += w * fn * fn
                    if slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[i] = nl & 0xFF
                        sumlx = slx
                        suml2 = sl2
                        changed += 1
        if changed == 0:
            break
    return sumlx / suml2 if suml2 > F0 else F0


@_njit(inline="always", **_OPTS)
def _qx_levels(x, o, n, nmax, iscale, L, lo):
    for i in range(n):
        L[lo + i] = nmax + min(nmax - 1, max(-nmax, nearest_int(iscale * x[o + i])))


@_njit(**_OPTS)
def _qx(x, o, n, nmax, L, lo, w):
    """make_qx_quants(n, nmax, x + o, L + lo, rmse_type=1, w): L gets l + nmax."""
    fnmax = F32(nmax)
    amax = F0
    mx = F0
    for i in range(n):
        v = x[o + i]
        av = abs(v)
        if av > amax:
            amax = av
            mx = v
    if amax < F_EPS:
        for i in range(n):
            L[lo + i] = 0
        return F0
    iscale = -fnmax / mx
    sumlx = F0
    suml2 = F0
    for i in range(n):
        v = x[o + i]
        fl = F32(min(nmax - 1, max(-nmax, nearest_int(iscale * v))))
        sumlx += w[i] * v * fl
        suml2 += w[i] * fl * fl
    _qx_levels(x, o, n, nmax, iscale, L, lo)
    scale = sumlx / suml2 if suml2 != F0 else F0
    best = scale * sumlx
    for k in range(-9, 10):
        if k == 0:
            continue
        iscale = -(fnmax + F_0_1 * F32(k)) / mx
        sumlx = F0
        suml2 = F0
        for i in range(n):
            v = x[o + i]
            fl = F32(min(nmax - 1, max(-nmax, nearest_int(iscale * v))))
            sumlx += w[i] * v * fl
            suml2 += w[i] * fl * fl
        if suml2 > F0 and sumlx * sumlx > best * suml2:
            _qx_levels(x, o, n, nmax, iscale, L, lo)
            scale = sumlx / suml2
            best = scale * sumlx
    return scale


# ----------------------------------------------------------------------------------------------------
# K-quants


@_njit(inline="always", **_OPTS)
def _pack_scale_min_k4(out, b, Ls, Lm, clamp63):
    """The 12 bytes of 6-bit scales and mins of Q4_K/Q5_K (uint8 stores, as the C's)."""
    for j in range(8):
        ls = Ls[j] & 0xFF
        lm = Lm[j] & 0xFF
        if clamp63:
            ls = min(63, ls)
            lm = min(63, lm)
        if j < 4:
            out[b, 4 + j] = ls
            out[b, 8 + j] = lm
        else:
            out[b, 8 + j] = ((ls & 0x0F) | ((lm & 0x0F) << 4)) & 0xFF
            out[b, j] = (np.int64(out[b, j]) | ((ls >> 4) << 6)) & 0xFF
            out[b, 4 + j] = (np.int64(out[b, 4 + j]) | ((lm >> 4) << 6)) & 0xFF


@_njit(inline="always", **_OPTS)
def _scale_min_k4(out, b, j):
    s = out[b, 4:16]
    if j < 4:
        return np.int64(s[j]) & 63, np.int64(s[j + 4]) & 63
    d = (np.int64(s[j + 4]) & 0x0F) | ((np.int64(s[j - 4]) >> 6) << 4)
    m = (np.int64(s[j + 4]) >> 4) | ((np.int64(s[j]) >> 6) << 4)
    return d, m


@_njit(inline="always", **_OPTS)
def _q45_block(x, o, q, out, b, nmax, clamp63, L, Laux, w, scales, mins, sw, Ls, Lm):
    """One Q4_K / Q5_K super-block of quantize_row_q{4,5}_K_impl; leaves its levels in L[0:256]."""
    sigma2 = F_TWO * _sum_sq(x, o, 256) / F_256
    for j in range(8):
        sw[j] = _weights(x, o + 32 * j, 32, q, sigma2, w)
        scales[j], mins[j] = _qkx3(x, o + 32 * j, 32, w, nmax, L, 32 * j, Laux)
    d_block = _qp(8, 63, scales, Ls, sw)
    m_block = _qp(8, 63, mins, Lm, sw)
    _pack_scale_min_k4(out, b, Ls, Lm, clamp63)
    dh = _fp16(d_block)
    mh = _fp16(m_block)
    _put16(out, b, 0, dh)
    _put16(out, b, 2, mh)
    d_all = _fp16_f32(dh)
    m_all = _fp16_f32(mh)
    for j in range(8):
        sc, m = _scale_min_k4(out, b, j)
        d = d_all * F32(sc)
        if d == F0:
            continue
        dm = m_all * F32(m)
        for i in range(32):
            L[32 * j + i] = min(nmax, max(0, nearest_int((x[o + 32 * j + i] + dm) / d)))


@_njit(inline="always", **_OPTS)
def _k_scratch():
    return (np.empty(256, dtype=np.int64), np.empty(32, dtype=np.int64), np.empty(32, dtype=np.float32),
            np.empty((3, 16), dtype=np.float32), np.empty((2, 16), dtype=np.int64))


@_njit(**_OPTS)
def q4_k(x, qw, r0, rpe, out):
    L, Laux, w, f16s, i16s = _k_scratch()
    nb = x.shape[1] // 256
    for r in range(x.shape[0]):
        xr = x[r]
        q = _qrow(qw, r0, r, rpe)
        for k in range(nb):
            b = r * nb + k
            _q45_block(xr, 256 * k, q, out, b, 15, False, L, Laux, w, f16s[0], f16s[1], f16s[2], i16s[0], i16s[1])
            for c in range(4):
                for l in range(32):
                    out[b, 16 + 32 * c + l] = L[64 * c + l] | (L[64 * c + 32 + l] << 4)


@_njit(**_OPTS)
def q5_k(x, qw, r0, rpe, out):
    L, Laux, w, f16s, i16s = _k_scratch()
    nb = x.shape[1] // 256
    for r in range(x.shape[0]):
        xr = x[r]
        q = _qrow(qw, r0, r, rpe)
        for k in range(nb):
            b = r * nb + k
            _q45_block(xr, 256 * k, q, out, b, 31, True, L, Laux, w, f16s[0], f16s[1], f16s[2], i16s[0], i16s[1])
            for l in range(32):
                out[b, 16 + l] = 0
            for c in range(4):
                m1 = 1 << (2 * c)
                for l in range(32):
                    l1 = L[64 * c + l]
                    l2 = L[64 * c + 32 + l]
                    h = 0
                    if l1 > 15:
                        l1 -= 16
                        h |= m1
                    if l2 > 15:
                        l2 -= 16
                        h |= m1 << 1
                    out[b, 16 + l] |= h
                    out[b, 48 + 32 * c + l] = l1 | (l2 << 4)


@_njit(inline="always", **_OPTS)
def _pack_2bit(out, b, at, L):
    for h in range(2):
        for l in range(32):
            o = 128 * h + l
            out[b, at + 32 * h + l] = (L[o] | (L[o + 32] << 2) | (L[o + 64] << 4) | (L[o + 96] << 6)) & 0xFF


@_njit(**_OPTS)
def q2_k(x, qw, r0, rpe, out):
    L, Laux, w, f16s, i16s = _k_scratch()
    scales, mins, sw = f16s[0], f16s[1], f16s[2]
    Ls, Lm = i16s[0], i16s[1]
    nb = x.shape[1] // 256
    for r in range(x.shape[0]):
        xr = x[r]
        q = _qrow(qw, r0, r, rpe)
        for k in range(nb):
            b = r * nb + k
            o = 256 * k
            sigma2 = _sum_sq(xr, o, 256) / F_256
            for j in range(16):
                sw[j] = _weights(xr, o + 16 * j, 16, q, sigma2, w)
                scales[j], mins[j] = _qkx3(xr, o + 16 * j, 16, w, 3, L, 16 * j, Laux)
            dm = _qp(16, 15, scales, Ls, sw)
            mm = _qp(16, 15, mins, Lm, sw)
            dh = _fp16(dm)
            mh = _fp16(mm)
            _put16(out, b, 80, dh)
            _put16(out, b, 82, mh)
            d_all = _fp16_f32(dh)
            m_all = _fp16_f32(mh)
            for j in range(16):
                sc = (Ls[j] | (Lm[j] << 4)) & 0xFF
                out[b, j] = sc
                d = d_all * F32(sc & 0x0F)
                if d == F0:
                    continue
                m = m_all * F32(sc >> 4)
                for i in range(16):
                    L[16 * j + i] = min(3, max(0, nearest_int((xr[o + 16 * j + i] + m) / d)))
            _pack_2bit(out, b, 16, L)


@_njit(**_OPTS)
def q3_k(x, qw, r0, rpe, out):
    L, Laux, w, f16s, i16s = _k_scratch()
    scales, sw = f16s[0], f16s[2]
    Ls = i16s[0]
    nb = x.shape[1] // 256
    for r in range(x.shape[0]):
        xr = x[r]
        q = _qrow(qw, r0, r, rpe)
        for k in range(nb):
            b = r * nb + k
            o = 256 * k
            sigma2 = F_TWO * _sum_sq(xr, o, 256) / F_256
            for j in range(16):
                sw[j] = _weights(xr, o + 16 * j, 16, q, sigma2, w)
                scales[j] = _qx(xr, o + 16 * j, 16, 4, L, 16 * j, w)
            for i in range(96, 108):
                out[b, i] = 0
            d_block = _qx(scales, 0, 16, 32, Ls, 0, sw)
            for j in range(16):
                l = Ls[j]
                if j < 8:
                    out[b, 96 + j] = l & 0x0F
                else:
                    out[b, 96 + j - 8] |= (l & 0x0F) << 4
                out[b, 104 + j % 4] |= (l >> 4) << (2 * (j // 4))
            dh = _fp16(d_block)
            _put16(out, b, 108, dh)
            d_all = _fp16_f32(dh)
            for j in range(16):
                lo = np.int64(out[b, 96 + j]) & 0x0F if j < 8 else np.int64(out[b, 96 + j - 8]) >> 4
                sc = _i8((lo | (((np.int64(out[b, 104 + j % 4]) >> (2 * (j // 4))) & 3) << 4)) - 32)
                d = d_all * F32(sc)
                if d == F0:
                    continue
                for i in range(16):
                    L[16 * j + i] = 4 + min(3, max(-4, nearest_int(xr[o + 16 * j + i] / d)))
            for m in range(32):
                hm = 0
                for c in range(8):
                    if L[32 * c + m] > 3:
                        hm |= 1 << c
                        L[32 * c + m] -= 4
                out[b, m] = hm
            _pack_2bit(out, b, 32, L)


@_njit(**_OPTS)
def q6_k(x, qw, r0, rpe, out):
    L, Laux, w, f16s, i16s = _k_scratch()
    scales = f16s[0]
    nb = x.shape[1] // 256
    for r in range(x.shape[0]):
        xr = x[r]
        q = _qrow(qw, r0, r, rpe)
        for k in range(nb):
            b = r * nb + k
            o = 256 * k
            max_scale = F0
            max_abs = F0
            for j in range(16):
                s = _qx(xr, o + 16 * j, 16, 32, L, 16 * j, q[o + 16 * j:o + 16 * j + 16])
                scales[j] = s
                a = abs(s)
                if a > max_abs:
                    max_abs = a
                    max_scale = s
            if max_abs < F_EPS:
                for i in range(210):
                    out[b, i] = 0
                continue
            iscale = F32(-128.0) / max_scale
            dh = _fp16(F1 / iscale)
            _put16(out, b, 208, dh)
            d_all = _fp16_f32(dh)
            for j in range(16):
                sq = _i8(min(127, nearest_int(iscale * scales[j])))
                out[b, 192 + j] = sq & 0xFF
                d = d_all * F32(sq)
                if d == F0:
                    continue
                for i in range(16):
                    L[16 * j + i] = 32 + min(31, max(-32, nearest_int(xr[o + 16 * j + i] / d)))
            for h in range(2):
                for l in range(32):
                    p = 128 * h + l
                    a0, a1, a2, a3 = L[p], L[p + 32], L[p + 64], L[p + 96]
                    out[b, 64 * h + l] = (a0 & 0x0F) | ((a2 & 0x0F) << 4)
                    out[b, 64 * h + 32 + l] = (a1 & 0x0F) | ((a3 & 0x0F) << 4)
                    out[b, 128 + 32 * h + l] = ((a0 >> 4) | ((a1 >> 4) << 2) | ((a2 >> 4) << 4)
                                                | ((a3 >> 4) << 6)) & 0xFF


# ----------------------------------------------------------------------------------------------------
# 32-element types: sigma2 is the mean square of the whole row


@_njit(inline="always", **_OPTS)
def _pack_q5(out, b, at, L):
    """qs (16 bytes at ``at + 4``) and the 32 fifth bits (4 bytes at ``at``) of Q5_0/Q5_1."""
    qh = np.int64(0)
    for j in range(16):
        a = L[j] & 0xFF
        c = L[j + 16] & 0xFF
        out[b, at + 4 + j] = (a & 0x0F) | ((c & 0x0F) << 4)
        qh |= ((a & 0x10) >> 4) << j
        qh |= ((c & 0x10) >> 4) << (j + 16)
    for k in range(4):
        out[b, at + k] = (qh >> (8 * k)) & 0xFF


@_njit(inline="always", **_OPTS)
def _legacy_row(x, qw, r0, rpe, out, kind):
    """quantize_row_{q4_0,q4_1,q5_0,q5_1}_impl (kind 0..3) over every row."""
    L = np.empty(32, dtype=np.int64)
    Laux = np.empty(32, dtype=np.int64)
    w = np.empty(32, dtype=np.float32)
    n = x.shape[1]
    nb = n // 32
    fn = F32(n)
    for r in range(x.shape[0]):
        xr = x[r]
        q = _qrow(qw, r0, r, rpe)
        sigma2 = _sum_sq(xr, 0, n) / fn
        for k in range(nb):
            b = r * nb + k
            o = 32 * k
            _weights(xr, o, 32, q, sigma2, w)
            if kind == 0 or kind == 2:
                d = _qx(xr, o, 32, 8 if kind == 0 else 16, L, 0, w)
                _put16(out, b, 0, _fp16(d))
                if kind == 0:
                    for j in range(16):
                        out[b, 2 + j] = (L[j] | (L[j + 16] << 4)) & 0xFF
                else:
                    _pack_q5(out, b, 2, L)
            else:
                d, the_min = _qkx3(xr, o, 32, w, 15 if kind == 1 else 31, L, 0, Laux)
                _put16(out, b, 0, _fp16(d))
                _put16(out, b, 2, _fp16(-the_min))
                if kind == 1:
                    for j in range(16):
                        out[b, 4 + j] = (L[j] | (L[j + 16] << 4)) & 0xFF
                else:
                    _pack_q5(out, b, 4, L)


@_njit(**_OPTS)
def q4_0(x, qw, r0, rpe, out):
    _legacy_row(x, qw, r0, rpe, out, 0)


@_njit(**_OPTS)
def q4_1(x, qw, r0, rpe, out):
    _legacy_row(x, qw, r0, rpe, out, 1)


@_njit(**_OPTS)
def q5_0(x, qw, r0, rpe, out):
    _legacy_row(x, qw, r0, rpe, out, 2)


@_njit(**_OPTS)
def q5_1(x, qw, r0, rpe, out):
    _legacy_row(x, qw, r0, rpe, out, 3)


# ----------------------------------------------------------------------------------------------------
# IQ4_NL / IQ4_XS


@_njit(inline="always", **_OPTS)
def _best_index(vals, v):
    """best_index_int8(16, vals, v): the nearest level by bisection, ties (and NaN) as the C resolves them."""
    if v <= F32(vals[0]):
        return 0
    if v >= F32(vals[15]):
        return 15
    ml = 0
    mu = 15
    while mu - ml > 1:
        mav = (ml + mu) // 2
        if v < F32(vals[mav]):
            mu = mav
        else:
            ml = mav
    return mu - 1 if v - F32(vals[mu - 1]) < F32(vals[mu]) - v else mu


@_njit(inline="always", **_OPTS)
def _iq4_sub(xr, o, w, vals, L):
    """The 32-element search of quantize_row_iq4_nl_impl with ntry = 7: returns the block's scale (0 for an
    all-zero block, whose levels L keeps from before, as the C's)."""
    amax = F0
    mx = F0
    for j in range(32):
        v = xr[o + j]
        av = abs(v)
        if av > amax:
            amax = av
            mx = v
    if amax < F_EPS:
        return F0
    v0 = F32(vals[0])
    d = -mx / v0
    idd = F1 / d
    sumqx = F0
    sumq2 = F0
    for j in range(32):
        l = _best_index(vals, idd * xr[o + j])
        L[j] = l
        qv = F32(vals[l])
        sumqx += w[j] * qv * xr[o + j]
        sumq2 += w[j] * qv * qv
    d = sumqx / sumq2 if sumq2 > F0 else F0
    best = d * sumqx
    for t in range(-7, 8):
        idd = F32(t + vals[0]) / mx
        sumqx = F0
        sumq2 = F0
        for j in range(32):
            qv = F32(vals[_best_index(vals, idd * xr[o + j])])
            sumqx += w[j] * qv * xr[o + j]
            sumq2 += w[j] * qv * qv
        if sumq2 > F0 and sumqx * sumqx > best * sumq2:
            d = sumqx / sumq2
            best = d * sumqx
    return d


@_njit(inline="always", **_OPTS)
def _iq4_weights(xr, o, q, has_qw, sigma2, w):
    if has_qw:
        _weights(xr, o, 32, q, sigma2, w)
    else:
        for j in range(32):
            v = xr[o + j]
            w[j] = v * v


@_njit(**_OPTS)
def iq4_nl(x, qw, r0, rpe, out):
    """quantize_iq4_nl: one 32-element block at a time (its own sigma2), the levels for the fp32 scale."""
    vals = IQ4NL_VALUES
    L = np.zeros(32, dtype=np.int64)  # a zero block keeps the previous block's levels in the C: they are
    w = np.empty(32, dtype=np.float32)  # rewritten below from scale 0 before they are stored
    has_qw = qw.shape[0] > 0
    nb = x.shape[1] // 32
    for r in range(x.shape[0]):
        xr = x[r]
        q = _qrow(qw, r0, r, rpe) if has_qw else xr
        for k in range(nb):
            b = r * nb + k
            o = 32 * k
            sigma2 = _sum_sq(xr, o, 32) * (F_TWO / F_32)
            _iq4_weights(xr, o, q, has_qw, sigma2, w)
            d = _iq4_sub(xr, o, w, vals, L)
            _put16(out, b, 0, _fp16(d))
            idd = F1 / d if d != F0 else F0
            for j in range(32):
                L[j] = _best_index(vals, idd * xr[o + j])
            for j in range(16):
                out[b, 2 + j] = L[j] | (L[16 + j] << 4)


@_njit(**_OPTS)
def iq4_xs(x, qw, r0, rpe, out):
    """quantize_iq4_xs: 256-element super-blocks, eight 32-element scales fitted, then 6-bit sub-scales."""
    vals = IQ4NL_VALUES
    L = np.zeros(32, dtype=np.int64)
    w = np.empty(32, dtype=np.float32)
    scales = np.empty(8, dtype=np.float32)
    has_qw = qw.shape[0] > 0
    nb = x.shape[1] // 256
    for r in range(x.shape[0]):
        xr = x[r]
        q = _qrow(qw, r0, r, rpe) if has_qw else xr
        for k in range(nb):
            b = r * nb + k
            o = 256 * k
            sigma2 = _sum_sq(xr, o, 256) * (F_TWO / F_256)
            max_scale = F0
            amax_scale = F0
            for ib in range(8):
                _iq4_weights(xr, o + 32 * ib, q, has_qw, sigma2, w)
                s = _iq4_sub(xr, o + 32 * ib, w, vals, L)
                scales[ib] = s
                a = abs(s)
                if a > amax_scale:
                    amax_scale = a
                    max_scale = s
            d = -max_scale / F_32
            dh = _fp16(d)
            _put16(out, b, 0, dh)
            idd = F1 / d if d != F0 else F0
            sh = 0
            for ib in range(8):
                l = min(31, max(-32, nearest_int(idd * scales[ib])))
                dl = d * F32(l)
                idl = F1 / dl if dl != F0 else F0
                for j in range(32):
                    L[j] = _best_index(vals, idl * xr[o + 32 * ib + j])
                for j in range(16):
                    out[b, 8 + 16 * ib + j] = L[j] | (L[16 + j] << 4)
                l += 32
                if ib % 2 == 0:
                    out[b, 4 + ib // 2] = l & 0x0F
                else:
                    out[b, 4 + ib // 2] |= (l & 0x0F) << 4
                sh |= (l >> 4) << (2 * ib)
            _put16(out, b, 2, sh)
