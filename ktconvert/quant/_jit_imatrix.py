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
    F_32,
    F_EPS,
    F32,
    _fp16,
    _fp16_f32,
    _njit,
    _nint_clamp_f,
    _put16,
    _qkx2_lanes,
    nearest_int,
    pack_2bit,
    pack_q4k_qs,
    pack_q5k_qs,
    q3k_tail,
    q6k_tail,
)

F_RMIN = F32(-0.9)       # make_qkx3_quants' rmin, rdelta and nstep as every _impl passes them
F_RDELTA = F32(0.05)
NSTEP = 36
F_TWO = F32(2.0)
F_256 = F32(256.0)

#: the 16 levels of IQ4_NL / IQ4_XS (ggml's ``kvalues_iq4nl``; also in the gguf package's dequantizer)
IQ4NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32)
_LANES = 16  # sub-blocks (or trial scales) searched side by side


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


@_njit(inline="always", **_OPTS)
def _load_lanes(xr, q, o, n, cnt, sigma2, X, Wt, sw, s0):
    """Sub-blocks o, o+n, ... (``cnt`` of them) of a row into lanes s0.. of ``X``/``Wt`` (element i of lane s
    at ``[i, s]``), with weights ``q * sqrtf(sigma2 + x^2)`` and their sequential sums in ``sw``."""
    for c in range(cnt):
        s = s0 + c
        t = F0
        for i in range(n):
            v = xr[o + n * c + i]
            w = q[o + n * c + i] * np.sqrt(sigma2 + v * v)
            X[i, s] = v
            Wt[i, s] = w
            t += w
        sw[s] = t


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


@_njit(**_OPTS)
def _qx(x, o, n, nmax, L, lo, w, T):
    """make_qx_quants(n, nmax, x + o, L + lo, rmse_type=1, w): L gets l + nmax. The 18 trial scales do not
    depend on each other's outcome, so their sums run side by side (lanes of ``T``, each still over the
    elements in order) and the C's sequential pick among them follows."""
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
    isc, slx, sl2 = T[0], T[1], T[2]
    isc[18] = -fnmax / mx                       # the first guess, then is = -9..-1, 1..9
    for t in range(18):
        isc[t] = -(fnmax + F_0_1 * F32(t - 9 if t < 9 else t - 8)) / mx
    for t in range(19):
        slx[t] = F0
        sl2[t] = F0
    for i in range(n):
        v = x[o + i]
        wi = w[i]
        wv = wi * v
        for t in range(19):
            l = _nint_clamp_f(isc[t] * v, -nmax, nmax - 1)
            slx[t] += wv * l                   # w*x*l
            sl2[t] += wi * l * l               # w*l*l
    take = isc[18]
    scale = slx[18] / sl2[18] if sl2[18] != F0 else F0
    best = scale * slx[18]
    for t in range(18):
        if sl2[t] > F0 and slx[t] * slx[t] > best * sl2[t]:
            take = isc[t]
            scale = slx[t] / sl2[t]
            best = scale * slx[t]
    for i in range(n):
        L[lo + i] = nmax + min(nmax - 1, max(-nmax, nearest_int(take * x[o + i])))
    return scale


@_njit(inline="always", **_OPTS)
def _scratch():
    """Lane buffers: X, Wt, Laux, Lf (32 x 16), V (17 x 16: the lane search's vectors), F (rows 0-2: a
    trial-lane search's sums, 3: sub-block weight sums, 4: sub-block scales, 5: one block's weights),
    L (levels of 16 lanes of 32), Ls/Lm (16 packed sub-scales each)."""
    return (np.empty((32, _LANES), dtype=np.float32), np.empty((32, _LANES), dtype=np.float32),
            np.empty((32, _LANES), dtype=np.float32), np.empty((32, _LANES), dtype=np.float32),
            np.empty((17, _LANES), dtype=np.float32), np.empty((6, 32), dtype=np.float32),
            np.empty(32 * _LANES, dtype=np.int64), np.empty((2, 16), dtype=np.int64))


@_njit(inline="always", **_OPTS)
def _scale_min_k4(out, b, j):
    s = out[b, 4:16]
    if j < 4:
        return np.int64(s[j]) & 63, np.int64(s[j + 4]) & 63
    d = (np.int64(s[j + 4]) & 0x0F) | ((np.int64(s[j - 4]) >> 6) << 4)
    m = (np.int64(s[j + 4]) >> 4) | ((np.int64(s[j]) >> 6) << 4)
    return d, m


@_njit(inline="always", **_OPTS)
def _q45(xr, q, o, g, out, b, nmax, X, Wt, Laux, Lf, V, F, L, LsLm):
    """``g`` (1 or 2) Q4_K (nmax 15) / Q5_K (31) super-blocks of quantize_row_q{4,5}_K_impl from ``o``, their
    8*g sub-blocks searched as lanes; leaves block t's levels in ``L[256*t:]``. (The lane count is a runtime
    value on purpose: with a constant 8 LLVM unrolls the lane loops instead of vectorizing them.)"""
    sw = F[3]
    for t in range(g):
        sigma2 = F_TWO * _sum_sq(xr, o + 256 * t, 256) / F_256
        _load_lanes(xr, q, o + 256 * t, 32, 8, sigma2, X, Wt, sw, 8 * t)
    _qkx2_lanes(X, Wt, 32, 8 * g, nmax, F_RMIN, F_RDELTA, NSTEP, False, Laux, V, Lf, 1)
    Ls, Lm = LsLm[0], LsLm[1]
    for t in range(g):
        bt = b + t
        ot = o + 256 * t
        Lt = L[256 * t:256 * t + 256]
        for j in range(8):
            for i in range(32):
                Lt[32 * j + i] = np.int64(Lf[i, 8 * t + j])
        d_block = _qp(8, 63, V[4, 8 * t:8 * t + 8], Ls, sw[8 * t:8 * t + 8])  # V[4]: scales, V[0]: -mins
        m_block = _qp(8, 63, V[0, 8 * t:8 * t + 8], Lm, sw[8 * t:8 * t + 8])
        for j in range(8):
            ls = Ls[j] & 0xFF
            lm = Lm[j] & 0xFF
            if nmax == 31:                        # Q5_K clamps the sub-scales, Q4_K stores them as they are
                ls = min(63, ls)
                lm = min(63, lm)
            if j < 4:
                out[bt, 4 + j] = ls
                out[bt, 8 + j] = lm
            else:
                out[bt, 8 + j] = ((ls & 0x0F) | ((lm & 0x0F) << 4)) & 0xFF
                out[bt, j] = (np.int64(out[bt, j]) | ((ls >> 4) << 6)) & 0xFF
                out[bt, 4 + j] = (np.int64(out[bt, 4 + j]) | ((lm >> 4) << 6)) & 0xFF
        dh = _fp16(d_block)
        mh = _fp16(m_block)
        _put16(out, bt, 0, dh)
        _put16(out, bt, 2, mh)
        d_all = _fp16_f32(dh)
        m_all = _fp16_f32(mh)
        for j in range(8):
            sc, m = _scale_min_k4(out, bt, j)
            d = d_all * F32(sc)
            if d == F0:
                continue
            dm = m_all * F32(m)
            for i in range(32):
                Lt[32 * j + i] = min(nmax, max(0, nearest_int((xr[ot + 32 * j + i] + dm) / d)))
        if nmax == 15:
            pack_q4k_qs(out, bt, Lt)
        else:
            pack_q5k_qs(out, bt, Lt)


@_njit(inline="always", **_OPTS)
def _q2k(xr, q, o, out, b, X, Wt, Laux, Lf, V, F, L, LsLm):
    """One Q2_K super-block of quantize_row_q2_K_impl (16 sub-blocks of 16 as lanes)."""
    sigma2 = _sum_sq(xr, o, 256) / F_256
    sw = F[3]
    _load_lanes(xr, q, o, 16, 16, sigma2, X, Wt, sw, 0)
    _qkx2_lanes(X, Wt, 16, X.shape[1], 3, F_RMIN, F_RDELTA, NSTEP, False, Laux, V, Lf, 1)  # 16, as a runtime value
    for j in range(16):
        for i in range(16):
            L[16 * j + i] = np.int64(Lf[i, j])
    Ls, Lm = LsLm[0], LsLm[1]
    dm = _qp(16, 15, V[4], Ls, sw)
    mm = _qp(16, 15, V[0], Lm, sw)
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
    pack_2bit(out, b, 16, L)


@_njit(inline="always", **_OPTS)
def _q3k(xr, q, o, out, b, F, L, LsLm):
    """One Q3_K super-block of quantize_row_q3_K_impl."""
    sigma2 = F_TWO * _sum_sq(xr, o, 256) / F_256
    w, sw, scales = F[5], F[3], F[4]
    T = F[:3]
    for j in range(16):
        sw[j] = _weights(xr, o + 16 * j, 16, q, sigma2, w)
        scales[j] = _qx(xr, o + 16 * j, 16, 4, L, 16 * j, w, T)
    for i in range(96, 108):
        out[b, i] = 0
    Ls = LsLm[0]
    d_block = _qx(scales, 0, 16, 32, Ls, 0, sw, T)
    for j in range(16):
        l = Ls[j]
        if j < 8:
            out[b, 96 + j] = l & 0x0F
        else:
            out[b, 96 + j - 8] |= (l & 0x0F) << 4
        out[b, 104 + j % 4] |= (l >> 4) << (2 * (j // 4))
    _put16(out, b, 108, _fp16(d_block))
    q3k_tail(xr, o, out, b, L)


@_njit(inline="always", **_OPTS)
def _q6k(xr, q, o, out, b, F, L):
    """One Q6_K super-block of quantize_row_q6_K_impl: the search weighted by the importances alone."""
    scales = F[4]
    T = F[:3]
    for j in range(16):
        scales[j] = _qx(xr, o + 16 * j, 16, 32, L, 16 * j, q[o + 16 * j:o + 16 * j + 16], T)
    q6k_tail(xr, o, out, b, L, scales)


@_njit(**_OPTS)
def _q4k_block(xr, q, o, g, out, b, S):
    X, Wt, Laux, Lf, V, F, L, LsLm = S
    _q45(xr, q, o, g, out, b, 15, X, Wt, Laux, Lf, V, F, L, LsLm)


@_njit(**_OPTS)
def _q5k_block(xr, q, o, g, out, b, S):
    X, Wt, Laux, Lf, V, F, L, LsLm = S
    _q45(xr, q, o, g, out, b, 31, X, Wt, Laux, Lf, V, F, L, LsLm)


@_njit(**_OPTS)
def _q2k_block(xr, q, o, g, out, b, S):
    X, Wt, Laux, Lf, V, F, L, LsLm = S
    _q2k(xr, q, o, out, b, X, Wt, Laux, Lf, V, F, L, LsLm)


@_njit(**_OPTS)
def _q3k_block(xr, q, o, g, out, b, S):
    _q3k(xr, q, o, out, b, S[5], S[6], S[7])


@_njit(**_OPTS)
def _q6k_block(xr, q, o, g, out, b, S):
    _q6k(xr, q, o, out, b, S[5], S[6])


@_njit(inline="always", **_OPTS)
def _rows(x, qw, r0, rpe, out, per, block):
    """``block`` (one of the ``_*_block`` kernels) on every row's 256-element super-blocks, ``per`` at a time."""
    S = _scratch()
    nb = x.shape[1] // 256
    for r in range(x.shape[0]):
        xr = x[r]
        q = _qrow(qw, r0, r, rpe)
        for k in range(0, nb, per):
            block(xr, q, 256 * k, min(per, nb - k), out, r * nb + k, S)


@_njit(**_OPTS)
def q4_k(x, qw, r0, rpe, out):
    _rows(x, qw, r0, rpe, out, 2, _q4k_block)


@_njit(**_OPTS)
def q5_k(x, qw, r0, rpe, out):
    _rows(x, qw, r0, rpe, out, 2, _q5k_block)


@_njit(**_OPTS)
def q2_k(x, qw, r0, rpe, out):
    _rows(x, qw, r0, rpe, out, 1, _q2k_block)


@_njit(**_OPTS)
def q3_k(x, qw, r0, rpe, out):
    _rows(x, qw, r0, rpe, out, 1, _q3k_block)


@_njit(**_OPTS)
def q6_k(x, qw, r0, rpe, out):
    _rows(x, qw, r0, rpe, out, 1, _q6k_block)


# ----------------------------------------------------------------------------------------------------
# 32-element types: sigma2 is the mean square of the whole row


@_njit(inline="always", **_OPTS)
def _pack_q5(out, b, at, L, lo):
    """qs (16 bytes at ``at + 4``) and the 32 fifth bits (4 bytes at ``at``) of Q5_0/Q5_1."""
    qh = np.int64(0)
    for j in range(16):
        a = L[lo + j] & 0xFF
        c = L[lo + j + 16] & 0xFF
        out[b, at + 4 + j] = (a & 0x0F) | ((c & 0x0F) << 4)
        qh |= ((a & 0x10) >> 4) << j
        qh |= ((c & 0x10) >> 4) << (j + 16)
    for k in range(4):
        out[b, at + k] = (qh >> (8 * k)) & 0xFF


@_njit(inline="always", **_OPTS)
def _legacy_rows(x, qw, r0, rpe, out, kind):
    """quantize_row_{q4_0,q4_1,q5_0,q5_1}_impl (kind 0..3) over every row; Q4_1/Q5_1 search 16 blocks of a row
    side by side."""
    X, Wt, Laux, Lf, V, F, L, LsLm = _scratch()
    n = x.shape[1]
    nb = n // 32
    fn = F32(n)
    for r in range(x.shape[0]):
        xr = x[r]
        q = _qrow(qw, r0, r, rpe)
        sigma2 = _sum_sq(xr, 0, n) / fn
        for k0 in range(0, nb, _LANES):
            g = min(_LANES, nb - k0)
            if kind == 1 or kind == 3:
                nmax = 15 if kind == 1 else 31
                _load_lanes(xr, q, 32 * k0, 32, g, sigma2, X, Wt, F[3], 0)
                _qkx2_lanes(X, Wt, 32, g, nmax, F_RMIN, F_RDELTA, NSTEP, False, Laux, V, Lf, 1)
                for t in range(g):
                    for i in range(32):
                        L[32 * t + i] = np.int64(Lf[i, t])
            for t in range(g):
                b = r * nb + k0 + t
                if kind == 1 or kind == 3:
                    _put16(out, b, 0, _fp16(V[4, t]))
                    _put16(out, b, 2, _fp16(-V[0, t]))
                    if kind == 1:
                        for j in range(16):
                            out[b, 4 + j] = (L[32 * t + j] | (L[32 * t + j + 16] << 4)) & 0xFF
                    else:
                        _pack_q5(out, b, 4, L, 32 * t)
                else:
                    w = F[5]
                    _weights(xr, 32 * (k0 + t), 32, q, sigma2, w)
                    d = _qx(xr, 32 * (k0 + t), 32, 8 if kind == 0 else 16, L, 0, w, F)
                    _put16(out, b, 0, _fp16(d))
                    if kind == 0:
                        for j in range(16):
                            out[b, 2 + j] = (L[j] | (L[j + 16] << 4)) & 0xFF
                    else:
                        _pack_q5(out, b, 2, L, 0)


@_njit(**_OPTS)
def q4_0(x, qw, r0, rpe, out):
    _legacy_rows(x, qw, r0, rpe, out, 0)


@_njit(**_OPTS)
def q4_1(x, qw, r0, rpe, out):
    _legacy_rows(x, qw, r0, rpe, out, 1)


@_njit(**_OPTS)
def q5_0(x, qw, r0, rpe, out):
    _legacy_rows(x, qw, r0, rpe, out, 2)


@_njit(**_OPTS)
def q5_1(x, qw, r0, rpe, out):
    _legacy_rows(x, qw, r0, rpe, out, 3)


# ----------------------------------------------------------------------------------------------------
# IQ4_NL / IQ4_XS


@_njit(inline="always", **_OPTS)
def _best_index(vals, v):
    """best_index_int8(16, vals, v) without its bisection's branches: the bisection ends at the last level
    ``v`` is not below (``!(v < vals[k])``, so a NaN walks to the top as in the C), then the nearer of it and
    the next, ties to the upper one."""
    if v <= vals[0]:
        return 0
    if v >= vals[15]:
        return 15
    ml = 0
    for k in range(1, 15):
        ml += 0 if v < vals[k] else 1
    return ml if v - vals[ml] < vals[ml + 1] - v else ml + 1


@_njit(inline="always", **_OPTS)
def _iq4_sub(xr, o, w, vals, T):
    """The 32-element search of quantize_row_iq4_nl_impl with ntry = 7: returns the block's scale (0 for an
    all-zero block). The 15 trial scales run side by side (lanes of ``T``), then the C's sequential pick."""
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
    isc, sqx, sq2 = T[0], T[1], T[2]
    isc[15] = F1 / (-mx / vals[0])
    for t in range(15):
        isc[t] = F32(t - 7) + vals[0]
        isc[t] = isc[t] / mx
    for t in range(16):
        sqx[t] = F0
        sq2[t] = F0
    for j in range(32):
        v = xr[o + j]
        wj = w[j]
        for t in range(16):
            qv = vals[_best_index(vals, isc[t] * v)]
            wq = wj * qv
            sqx[t] += wq * v                  # w*q*x
            sq2[t] += wq * qv                 # w*q*q
    d = sqx[15] / sq2[15] if sq2[15] > F0 else F0
    best = d * sqx[15]
    for t in range(15):
        if sq2[t] > F0 and sqx[t] * sqx[t] > best * sq2[t]:
            d = sqx[t] / sq2[t]
            best = d * sqx[t]
    return d


@_njit(inline="always", **_OPTS)
def _iq4_weights(xr, o, q, has_qw, sigma2, w):
    if has_qw:
        _weights(xr, o, 32, q, sigma2, w)
    else:
        for j in range(32):
            v = xr[o + j]
            w[j] = v * v


@_njit(inline="always", **_OPTS)
def _iq4_levels(out, b, at, xr, o, idl, vals):
    """The 32 levels for inverse scale ``idl``, packed element j and j+16 in one byte at ``at + j``."""
    for j in range(16):
        out[b, at + j] = _best_index(vals, idl * xr[o + j]) | (_best_index(vals, idl * xr[o + 16 + j]) << 4)


@_njit(inline="always", **_OPTS)
def _iq4_rows(x, qw, r0, rpe, out, xs):
    """quantize_iq4_nl (``xs`` False: 32-element blocks, the fp16 scale is the fitted one) and quantize_iq4_xs
    (256-element super-blocks, eight fitted scales as 6-bit multiples of the largest / -32)."""
    vals = IQ4NL_VALUES
    w = np.empty(32, dtype=np.float32)
    T = np.empty((3, 16), dtype=np.float32)
    scales = np.empty(8, dtype=np.float32)
    has_qw = qw.shape[0] > 0
    sbs = 256 if xs else 32
    nsub = sbs // 32
    nb = x.shape[1] // sbs
    for r in range(x.shape[0]):
        xr = x[r]
        q = _qrow(qw, r0, r, rpe) if has_qw else xr
        for k in range(nb):
            b = r * nb + k
            o = sbs * k
            sigma2 = _sum_sq(xr, o, sbs) * (F_TWO / F32(sbs))
            max_scale = F0
            amax_scale = F0
            for ib in range(nsub):
                _iq4_weights(xr, o + 32 * ib, q, has_qw, sigma2, w)
                s = _iq4_sub(xr, o + 32 * ib, w, vals, T)
                scales[ib] = s
                a = abs(s)
                if a > amax_scale:
                    amax_scale = a
                    max_scale = s
            if not xs:
                d = scales[0]
                _put16(out, b, 0, _fp16(d))
                _iq4_levels(out, b, 2, xr, o, F1 / d if d != F0 else F0, vals)
                continue
            d = -max_scale / F_32
            _put16(out, b, 0, _fp16(d))
            idd = F1 / d if d != F0 else F0
            sh = 0
            for ib in range(8):
                l = min(31, max(-32, nearest_int(idd * scales[ib])))
                dl = d * F32(l)
                _iq4_levels(out, b, 8 + 16 * ib, xr, o + 32 * ib, F1 / dl if dl != F0 else F0, vals)
                l += 32
                if ib % 2 == 0:
                    out[b, 4 + ib // 2] = l & 0x0F
                else:
                    out[b, 4 + ib // 2] |= (l & 0x0F) << 4
                sh |= (l >> 4) << (2 * ib)
            _put16(out, b, 2, sh)


@_njit(**_OPTS)
def iq4_nl(x, qw, r0, rpe, out):
    _iq4_rows(x, qw, r0, rpe, out, False)


@_njit(**_OPTS)
def iq4_xs(x, qw, r0, rpe, out):
    _iq4_rows(x, qw, r0, rpe, out, True)
