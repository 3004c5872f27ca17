"""K-quants (Q2_K..Q6_K), bit-exact with ggml's ``quantize_row_q*_K_ref``.

Vectorised across sub-blocks: a chunk of super-blocks is transposed to ``(n, S)`` (element index of the
sub-block first), so every sequential float32 sum of the C (``s += w*l`` over 16 or 32 elements) is one
``np.add.reduce(axis=0)``, which numpy evaluates row after row, left to right, exactly like the C loop.
Operation order and parenthesisation follow the C line by line; the traps are commented where they
are reproduced.
"""

from __future__ import annotations

import numpy as np

from ._fp import (
    F32,
    SAFE_INT,
    all_within,
    fp16_bits,
    fp16_to_f32,
    nearest_int,
    nint_clip_f32,
    scratch,
    seqsum0,
    seqsum_first,
)

QK_K = 256
_EPS = F32(1e-15)  # GROUP_MAX_EPS


def _to_cols(x: np.ndarray, n: int) -> np.ndarray:
    """(nb, 256) -> (n, S): column s is sub-block s (super-block s // (256//n))."""
    return np.ascontiguousarray(x.reshape(-1, n).T)


def _from_cols(L: np.ndarray, nb: int) -> np.ndarray:
    """(n, S) uint8 quant levels -> (nb, 256) uint8 in element order. One strided row copy per element
    index: about 3x faster than numpy's transposing copy, which moves one n-byte run per call."""
    n, S = L.shape
    out = np.empty((S, n), dtype=np.uint8)
    for i in range(n):
        out[:, i] = L[i]
    return out.reshape(nb, QK_K)


def _first_absmax_cols(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per column: max |x| and the signed value at its FIRST occurrence, as the C scan
    ``if (ax > amax) { amax = ax; max = x[i]; }`` from 0 finds them: +0.0 for an all-zero column,
    and a NaN (possible in scales computed from overflowing sums) is never taken."""
    mx = np.fmax.reduce(x, axis=0, initial=F32(0.0))     # two passes instead of |x| and its max
    mn = np.fmin.reduce(x, axis=0, initial=F32(0.0))
    amax = np.fmax(mx, -mn) + F32(0.0)
    vmax = np.where(mx == amax, mx, -amax).astype(F32)
    both = (mx == amax) & (amax > 0) & (mn == -amax)
    if both.any():  # +a and -a in the same column: the first one wins
        cols = np.flatnonzero(both)
        first = np.argmax(np.abs(x[:, cols]) == amax[cols], axis=0)
        vmax[cols] = x[first, cols]
    vmax[amax == 0] = F32(0.0)
    return amax, vmax


# ----------------------------------------------------------------------------------------------------
# make_qkx2_quants (Q2_K, Q4_K, Q5_K)


def _tv(a: np.ndarray):
    """A torch view of a numpy array (shared memory): torch's in-place element-wise kernels are faster
    than numpy's for broadcasts and clamps; reductions stay in numpy for their summation order."""
    return _torch().from_numpy(a)


def _torch():
    import torch  # deferred: only the quantizers need it

    return torch


def _round_clip(V: np.ndarray, lo: int, hi: int, safe: bool = True) -> np.ndarray:
    """``nint_clip_f32`` with torch's in-place round/clamp (half to even, as np.rint), faster than
    numpy's on these shapes; ``safe`` as there (every |v| <= SAFE_INT)."""
    if not safe:
        return nint_clip_f32(V, lo, hi, False)
    t = _tv(V)
    t.round_()
    t.clamp_(lo, hi)
    return V


def _levels(tV, V: np.ndarray, tX, tmn, mn: np.ndarray, tisc, isc: np.ndarray, xmin: np.ndarray,
            xmax: np.ndarray, nmax: int, top: bool) -> np.ndarray:
    """``V = MAX(0, MIN(nmax, nearest_int(isc*(X - mn))))`` as float32, in place (numpy ``V``, torch ``tV``).

    ``fl(isc*fl(x - mn))`` is monotone in x (isc > 0), so its values at xmin and xmax bound every element;
    as isc = c/(max - min), the one at xmax is c*(1 +- 2^-23). When both bounds are finite and small,
    round-half-even equals nearest_int and only the clamps that can bind run (``top``: c may round to
    nmax + 1); otherwise (an infinite iscale, an overflowed range) the exact bit-trick path runs.
    """
    _torch().sub(tX, tmn, out=tV)
    tV.mul_(tisc)
    lo = isc * (xmin - mn)
    lo_min, lo_max = lo.min(), lo.max()
    hi_max = (isc * (xmax - mn)).max()  # ~c, unless (max - min) overflowed: then 0*inf is NaN
    if not (lo_min >= -SAFE_INT and lo_max <= SAFE_INT and hi_max <= SAFE_INT):
        return nint_clip_f32(V, 0, nmax, False)
    tV.round_()
    if lo_min < -0.5:
        tV.clamp_(0, nmax) if top else tV.clamp_(min=0)
    elif top:
        tV.clamp_(max=nmax)
    return V


def _make_qkx2(X: np.ndarray, W: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int,
               use_mad: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Returns (scale, the_min, L as float32 (n, S)).

    The search keeps the C quirk that ``min`` is updated in place when an iteration is accepted, so
    later iterations use the new ``min`` in both ``(max - min)`` and ``(x - min)``. Instead of copying
    the accepted levels every iteration, it records which iteration each column accepted last and
    rebuilds those levels once at the end from that iteration's (iscale, min).
    """
    torch = _torch()
    n, S = X.shape
    tX = _tv(X)
    xmin = np.minimum.reduce(X, axis=0)
    xmax = np.maximum.reduce(X, axis=0)
    sum_w = seqsum_first(W)               # sum_w = weights[0]; sum_w += w
    V = np.multiply(W, X, out=scratch("k2V", X.shape))
    tV = _tv(V)
    sum_x = seqsum_first(V)               # sum_x = w0*x0;      sum_x += w*x
    mn0 = np.minimum(xmin, F32(0.0))      # if (min > 0) min = 0
    flat = xmax == mn0                    # max == min: L = 0, scale 0, the_min = -min
    live = ~flat
    flat_f = flat.astype(F32)             # (max - min) + 1 for flat columns keeps their iscale finite
    fnmax = F32(nmax)
    steps = nstep + 1
    M = scratch("k2M", (steps + 1, S))               # M[k]: the min in force before iteration k
    M[0] = mn0
    H_iscale = scratch("k2Hi", (steps + 1, S))       # [0]: initial, [k+1]: iteration k
    H_scale = scratch("k2Hs", (steps + 1, S))
    tM, tH = _tv(M), _tv(H_iscale)
    rng = np.empty(S, dtype=F32)
    WL = scratch("k2WL", X.shape)
    T = scratch("k2T", X.shape)
    tT = _tv(T)

    def error(scale: np.ndarray, mn) -> np.ndarray:
        """sum of w * f(scale*L + min - x), f = |.| or square, sequentially from 0."""
        torch.mul(tV, _tv(scale), out=tT)
        tT.add_(mn)
        np.subtract(T, X, out=T)
        if use_mad:
            np.abs(T, out=T)
        else:
            np.multiply(T, T, out=T)
        np.multiply(T, W, out=T)
        return seqsum0(T)

    np.subtract(xmax, mn0, out=rng)
    rng += flat_f
    iscale = np.divide(fnmax, rng, out=H_iscale[0])
    H_scale[0] = F32(1.0) / iscale
    _levels(tV, V, tX, tM[0], mn0, tH[0], iscale, xmin, xmax, nmax, True)
    best = error(H_scale[0], tM[0])

    last = np.zeros(S, dtype=np.int32)    # row of H_* / M the column accepted last (0: initial)
    for it in range(steps):
        mn = M[it]
        c = F32(rmin) + F32(rdelta) * F32(it) + fnmax   # (rmin + rdelta*is) + nmax
        np.subtract(xmax, mn, out=rng)
        rng += flat_f
        isc = np.divide(c, rng, out=H_iscale[it + 1])
        _levels(tV, V, tX, tM[it], mn, tH[it + 1], isc, xmin, xmax, nmax, c * F32(1.0000003) >= nmax + 0.5)
        np.multiply(W, V, out=WL)
        sum_l = seqsum0(WL)                            # sum_l  += w*l
        np.multiply(WL, V, out=T)
        sum_l2 = seqsum0(T)                            # sum_l2 += w*l*l
        np.multiply(WL, X, out=T)
        sum_xl = seqsum0(T)                            # sum_xl += w*l*x
        D = sum_w * sum_l2
        D -= sum_l * sum_l
        this_scale = np.subtract(sum_w * sum_xl, sum_x * sum_l, out=H_scale[it + 1])
        this_scale /= D
        this_min = sum_l2 * sum_x
        this_min -= sum_l * sum_xl
        this_min /= D
        cm = this_min > 0
        if cm.any():
            this_min[cm] = F32(0.0)
            this_scale[cm] = sum_xl[cm] / sum_l2[cm]
        cur = error(this_scale, _tv(this_min))
        acc = cur < best                               # a NaN error is never accepted, as in C
        acc &= D > 0
        acc &= live
        best = np.where(acc, cur, best)
        np.copyto(M[it + 1], np.where(acc, this_min, mn))
        last[acc] = it + 1

    cols = np.arange(S)
    scale = H_scale[last, cols]
    sel_min = np.ascontiguousarray(M[np.maximum(last - 1, 0), cols])  # the min when that Laux was made
    sel_isc = np.ascontiguousarray(H_iscale[last, cols])
    _levels(tV, V, tX, _tv(sel_min), sel_min, _tv(sel_isc), sel_isc, xmin, xmax, nmax, True)
    if flat.any():
        V[:, flat] = F32(0.0)
        scale[flat] = F32(0.0)
    return scale, -M[steps], V  # V is this thread's scratch: valid until the next _make_qkx2 call


def _requant_asym(X: np.ndarray, L: np.ndarray, d: np.ndarray, dm: np.ndarray, nmax: int) -> np.ndarray:
    """``if (!d) continue; L = clamp(nearest_int((x + dm)/d), 0, nmax)`` per sub-block (column)."""
    keep = d == 0
    ds = np.where(keep, F32(1.0), d)
    V = X + dm
    V /= ds
    xmin = np.minimum.reduce(X, axis=0)
    xmax = np.maximum.reduce(X, axis=0)
    with np.errstate(invalid="ignore", over="ignore"):
        safe = all_within(((xmin + dm) / ds)[~keep], ((xmax + dm) / ds)[~keep])
    Lnew = nint_clip_f32(V, 0, nmax, safe)
    if keep.any():
        Lnew[:, keep] = L[:, keep]
    return Lnew


def _pack_scales_k4(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """6-bit scales and mins of Q4_K/Q5_K into 12 bytes (j < 4 direct, j >= 4 split into nibbles + top bits)."""
    out = np.empty((ls.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = ls[:, 0:4] | ((ls[:, 4:8] >> 4) << 6)
    out[:, 4:8] = lm[:, 0:4] | ((lm[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (ls[:, 4:8] & 0x0F) | ((lm[:, 4:8] & 0x0F) << 4)
    return out


def _q45_k(x: np.ndarray, nmax: int, rmin: float, nstep: int) -> tuple[np.ndarray, ...]:
    nb = x.shape[0]
    X = _to_cols(x, 32)
    sum_x2 = seqsum0(X * X)
    av_x = np.sqrt(sum_x2 / F32(32))
    W = np.abs(X)
    W += av_x                                   # weights[l] = av_x + fabsf(x[l])
    scales, mins, L = _make_qkx2(X, W, nmax, rmin, 0.1, nstep, False)
    sc = scales.reshape(nb, 8)
    mi = mins.reshape(nb, 8)
    with np.errstate(invalid="ignore"):
        # `if (scale > max_scale)` from +0: a -0.0 never replaces the start, hence the + 0
        max_scale = np.fmax.reduce(sc, axis=1, initial=F32(0.0)) + F32(0.0)
        max_min = np.fmax.reduce(mi, axis=1, initial=F32(0.0)) + F32(0.0)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        inv_scale = np.where(max_scale > 0, F32(63.0) / max_scale, F32(0.0)).astype(F32)
        inv_min = np.where(max_min > 0, F32(63.0) / max_min, F32(0.0)).astype(F32)
        ls = np.minimum(nearest_int(inv_scale[:, None] * sc) & 0xFF, 63).astype(np.uint8)  # (uint8_t) then MIN
        lm = np.minimum(nearest_int(inv_min[:, None] * mi) & 0xFF, 63).astype(np.uint8)
        d_bits = fp16_bits(max_scale / F32(63.0))
        dmin_bits = fp16_bits(max_min / F32(63.0))
        # re-quantize with the fp16-rounded super-block scales and the 6-bit sub-block scales
        d = (fp16_to_f32(d_bits)[:, None] * ls).reshape(-1)
        dm = (fp16_to_f32(dmin_bits)[:, None] * lm).reshape(-1)
        L = _requant_asym(X, L, d, dm, nmax)
    Lb = _from_cols(L.astype(np.uint8), nb)
    head = np.empty((nb, 16), dtype=np.uint8)
    head[:, 0:2] = d_bits.view(np.uint8).reshape(nb, 2)
    head[:, 2:4] = dmin_bits.view(np.uint8).reshape(nb, 2)
    head[:, 4:16] = _pack_scales_k4(ls, lm)
    return head, Lb


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    nb = x.shape[0]
    head, Lb = _q45_k(x, 15, -1.0, 20)
    A = Lb.reshape(nb, 4, 2, 32)
    qs = (A[:, :, 0] | (A[:, :, 1] << 4)).reshape(nb, 128)
    return np.concatenate([head, qs], axis=1)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    nb = x.shape[0]
    head, Lb = _q45_k(x, 31, -0.5, 15)
    A = Lb.reshape(nb, 4, 2, 32)               # [chunk of 64, low/high half, j]
    hi = (A >> 4).astype(np.uint8)              # 1 where l > 15
    shifts = (2 * np.arange(4, dtype=np.uint8))[None, :, None]
    qh = ((hi[:, :, 0] << shifts) | (hi[:, :, 1] << (shifts + 1))).astype(np.uint8)
    qh = np.bitwise_or.reduce(qh, axis=1)       # (nb, 32)
    lo = A & 0x0F
    qs = (lo[:, :, 0] | (lo[:, :, 1] << 4)).reshape(nb, 128)
    return np.concatenate([head, qh, qs], axis=1)


def quantize_q2_k(x: np.ndarray) -> np.ndarray:
    nb = x.shape[0]
    X = _to_cols(x, 16)
    W = np.abs(X)
    scales, mins, L = _make_qkx2(X, W, 3, -0.5, 0.1, 15, True)
    sc = scales.reshape(nb, 16)
    mi = mins.reshape(nb, 16)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        max_scale = np.fmax.reduce(sc, axis=1, initial=F32(0.0)) + F32(0.0)
        max_min = np.fmax.reduce(mi, axis=1, initial=F32(0.0)) + F32(0.0)
        has_s = max_scale > 0
        has_m = max_min > 0
        q4 = F32(15.0)
        iscale = np.where(has_s, q4 / max_scale, F32(0.0)).astype(F32)
        lsc = np.where(has_s[:, None], nearest_int(iscale[:, None] * sc), 0)
        imin = np.where(has_m, q4 / max_min, F32(0.0)).astype(F32)
        lmn = np.where(has_m[:, None], nearest_int(imin[:, None] * mi) << 4, 0)
        scales_b = ((lsc & 0xFF) | lmn) & 0xFF              # y.scales[j] = l; y.scales[j] |= l << 4
        d_bits = fp16_bits(np.where(has_s, max_scale / q4, F32(0.0)))
        dmin_bits = fp16_bits(np.where(has_m, max_min / q4, F32(0.0)))
        d = (fp16_to_f32(d_bits)[:, None] * (scales_b & 0x0F)).astype(F32).reshape(-1)
        dm = (fp16_to_f32(dmin_bits)[:, None] * (scales_b >> 4)).astype(F32).reshape(-1)
        L = _requant_asym(X, L, d, dm, 3)
    Lb = _from_cols(L.astype(np.uint8), nb)
    A = Lb.reshape(nb, 2, 4, 32)                # [half of 128, group of 32, l]
    qs = (A[:, :, 0] | (A[:, :, 1] << 2) | (A[:, :, 2] << 4) | (A[:, :, 3] << 6)).reshape(nb, 64)
    return np.concatenate([scales_b.astype(np.uint8), qs, d_bits.view(np.uint8).reshape(nb, 2),
                           dmin_bits.view(np.uint8).reshape(nb, 2)], axis=1)


# ----------------------------------------------------------------------------------------------------
# Q6_K: make_qx_quants(16, 32, x, L, rmse_type=1, qw=NULL)


def _make_qx_rmse1(X: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Returns (scale, the iscale taken, max |x|) per column. The 18 trial scales do not depend on
    which one was taken, so the search is a running arg-best over independent trials. The levels are
    only needed where the re-quantization keeps them (:func:`_qx_levels`), so they are not built here."""
    n, S = X.shape
    amax, vmax = _first_absmax_cols(X)
    zero = amax < _EPS
    safe_max = np.where(zero, F32(1.0), vmax).astype(F32)
    W = np.multiply(X, X, out=scratch("qxW", X.shape))
    WX = np.multiply(W, X, out=scratch("qxWX", X.shape))   # w*x[i]*l == (w*x)*l
    V = scratch("qxV", X.shape)
    T = scratch("qxT", X.shape)
    tX, tV = _tv(X), _tv(V)
    torch = _torch()
    fn = F32(nmax)
    lo, hi = -nmax, nmax - 1

    def trial(iscale):
        # |iscale*x| <= (nmax+0.9)*(1+eps) since |x| <= |max|: round-half-even is nearest_int here
        torch.mul(tX, _tv(iscale), out=tV)
        tV.round_()
        tV.clamp_(lo, hi)
        np.multiply(WX, V, out=T)
        sumlx = seqsum0(T)
        np.multiply(W, V, out=T)
        np.multiply(T, V, out=T)
        suml2 = seqsum0(T)
        return sumlx, suml2

    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        iscale = (-fn) / safe_max
        sumlx, suml2 = trial(iscale)
        scale = np.where(suml2 != 0, sumlx / suml2, F32(0.0)).astype(F32)
        best = scale * sumlx
        sel = iscale.copy()
        for i in range(-9, 10):
            if i == 0:
                continue
            isc = -(fn + F32(0.1) * F32(i)) / safe_max
            sumlx, suml2 = trial(isc)
            acc = suml2 > 0
            acc &= sumlx * sumlx > best * suml2
            k = np.flatnonzero(acc)                # 0.1-10% of the columns after the first trials
            if k.size:
                lx = sumlx[k]
                new_scale = lx / suml2[k]
                scale[k] = new_scale
                best[k] = new_scale * lx
                sel[k] = isc[k]
    scale[zero] = F32(0.0)
    return scale, sel, amax


def _qx_levels(X: np.ndarray, sel: np.ndarray, amax: np.ndarray, nmax: int) -> np.ndarray:
    """make_qx_quants' levels L + nmax (float32) for the columns of ``X``, from the iscale it took;
    0 for an all-zero column."""
    L = X * sel
    _round_clip(L, -nmax, nmax - 1)               # |iscale*x| <= (nmax+0.9)*(1+eps)
    L += F32(nmax)
    L[:, amax < _EPS] = F32(0.0)
    return L


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    nb = x.shape[0]
    X = _to_cols(x, 16)
    scales, sel, amax = _make_qx_rmse1(X, 32)
    sc = scales.reshape(nb, 16)
    # max_scale: the signed scale at the first max |scale| (strict >, from 0)
    amax_s, max_scale = _first_absmax_cols(np.ascontiguousarray(sc.T))
    blk_zero = amax_s < _EPS
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        iscale = F32(-128.0) / np.where(blk_zero, F32(1.0), max_scale).astype(F32)
        d_bits = fp16_bits(F32(1.0) / iscale)
        q_sc = np.minimum(nearest_int(iscale[:, None] * sc), 127)
        q_sc = ((q_sc + 128) & 0xFF) - 128                      # stored as int8_t
        d = (fp16_to_f32(d_bits)[:, None] * q_sc).astype(F32).reshape(-1)
        keep = d == 0
        ds = np.where(keep, F32(1.0), d).astype(F32)
        V = np.divide(X, ds, out=scratch("q6V", X.shape))
        safe = all_within((amax / np.abs(ds))[~keep])       # |x| <= amax
    Lnew = _round_clip(V, -32, 31, safe)
    Lnew += F32(32.0)
    if keep.any():
        Lnew[:, keep] = _qx_levels(X[:, keep], sel[keep], amax[keep], 32)
    Lb = _from_cols(Lnew.astype(np.uint8), nb)
    A = Lb.reshape(nb, 2, 4, 32)                # [half of 128, group of 32, l]
    ql = ((A[:, :, 0:2] & 0x0F) | ((A[:, :, 2:4] & 0x0F) << 4)).reshape(nb, 128)
    h = A >> 4
    qh = (h[:, :, 0] | (h[:, :, 1] << 2) | (h[:, :, 2] << 4) | (h[:, :, 3] << 6)).reshape(nb, 64)
    out = np.concatenate([ql, qh, q_sc.astype(np.int8).view(np.uint8), d_bits.view(np.uint8).reshape(nb, 2)], axis=1)
    if blk_zero.any():
        out[blk_zero] = 0
    return out


# ----------------------------------------------------------------------------------------------------
# Q3_K: make_q3_quants(16, 4, x, L, do_rmse=true)


def _q3_refine(X: np.ndarray, W: np.ndarray, WX: np.ndarray, L: np.ndarray, P: np.ndarray, Q: np.ndarray,
               sumlx: np.ndarray, suml2: np.ndarray, cols: np.ndarray, nmax: int) -> None:
    """make_q3_quants' rmse refinement (up to 5 sweeps of element-by-element updates), in place on
    ``L`` (float32 levels), ``sumlx``, ``suml2`` for the columns ``cols``. ``W`` = x*x and ``WX`` = w*x;
    ``P`` = w*x*L and ``Q`` = w*L*L are the products the sums were made from.

    Each accepted change alters the sums the next element is tested against, so the C is sequential
    along the sub-block. It is evaluated speculatively instead: every remaining element of every live
    column is tested against the column's current sums at once, the first acceptance per column is
    applied (exactly what the C would do at that element, since nothing before it changed), and the
    columns continue from the element after it. A sweep ends at the first round with no acceptance
    left; a column stops after a sweep without change or after 5 sweeps. Most columns accept 0-2 times,
    so the rounds shrink fast (about 1.7 full passes in total on gaussian data).

    Only ``new_l`` is computed densely: the C tests acceptance only where ``slx > 0`` and
    ``new_l != L[i]``, about 2% of the elements, so the acceptance test runs on those alone.
    """
    n, S = X.shape
    c = cols                                     # live columns, and per live column:
    p = np.zeros(c.size, dtype=np.int32)         # the next element to test in the current sweep,
    sweep = np.zeros(c.size, dtype=np.int32)     # the sweep (0..4),
    changed = np.zeros(c.size, dtype=bool)       # whether this sweep changed a level
    size = n * c.size
    fbuf = scratch("q3f", (8, size))
    bbuf = scratch("q3b", (2, size), np.bool_)
    first_round = c.size == S
    while c.size:
        m = c.size
        sh = (n, m)
        A, B, C, D, La, Xa, Wa, WXa = (fbuf[k, :n * m].reshape(sh) for k in range(8))
        E, F = (bbuf[k, :n * m].reshape(sh) for k in range(2))
        slx0, sl20 = sumlx[c], suml2[c]
        if first_round:  # every column live: no gather, and the products of the sums are at hand
            first_round = False
            Xa, Wa, WXa, La = X, W, WX, L
            np.subtract(slx0, P, out=A)          # slx = sumlx - w*x[i]*L[i]
            np.subtract(sl20, Q, out=B)          # sl2 = suml2 - w*L[i]*L[i]
        else:
            np.take(X, c, axis=1, out=Xa, mode="clip")
            np.multiply(Xa, Xa, out=Wa)          # recomputing w and w*x is cheaper than gathering them
            np.multiply(Wa, Xa, out=WXa)
            np.take(L, c, axis=1, out=La, mode="clip")
            np.multiply(WXa, La, out=A)
            np.subtract(slx0, A, out=A)
            np.multiply(Wa, La, out=B)
            B *= La
            np.subtract(sl20, B, out=B)
        np.multiply(Xa, B, out=C)
        C /= A                                   # x[i]*sl2/slx: may be huge or NaN, so the exact
        C += F32(12582912.0)                     # nearest_int bit trick, in place
        Ci = C.view(np.int32)
        Ci &= 0x007FFFFF
        Ci -= 0x00400000
        _tv(Ci).clamp_(-nmax, nmax - 1)
        np.copyto(D, Ci, casting="unsafe")       # new_l
        np.greater(A, F32(0.0), out=E)           # if (slx > 0) ... if (new_l != L[i])
        np.not_equal(D, La, out=F)
        E &= F
        # the candidates, in element-major order (row, then column), from element p on
        idx = np.flatnonzero(E)
        row, col = np.divmod(idx, m)
        if p.any():
            ge = row >= p[col]
            idx, row, col = idx[ge], row[ge], col[ge]
        d = D.ravel()[idx]
        a = A.ravel()[idx]
        a += WXa.ravel()[idx] * d                # slx += w*x[i]*new_l
        b = Wa.ravel()[idx] * d
        b *= d
        b += B.ravel()[idx]                      # sl2 += w*new_l*new_l
        s0 = slx0[col]
        ok = a * a
        ok *= sl20[col]                          # slx*slx*suml2 > sumlx*sumlx*sl2
        ok = (ok > b * (s0 * s0)) & (b > F32(0.0))
        k = np.flatnonzero(ok)
        first = np.full(m, n, dtype=np.int64)
        if k.size:
            hc = col[k]
            np.minimum.at(first, hc, row[k])     # the first acceptance per column: its lowest row
            lowest = row[k] == first[hc]
            k, hc = k[lowest], hc[lowest]
            ch = c[hc]
            L[row[k], ch] = d[k]
            sumlx[ch] = a[k]
            suml2[ch] = b[k]
            changed[hc] = True
        # a sweep is over for columns without a hit, or whose hit was the last element; a column
        # whose sweep changed something starts the next one (at most 5), the others are done
        over = first >= n - 1
        restart = over & changed & (sweep < 4)
        keep = np.flatnonzero(~over | restart)
        p = np.where(over, 0, first + 1).astype(np.int32)
        changed &= ~over
        sweep += restart
        c, p, sweep, changed = c[keep], p[keep], sweep[keep], changed[keep]


def _make_q3(X: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """make_q3_quants(n, nmax, x, L, do_rmse=true). Returns (scale, L as float32 levels -nmax..nmax-1,
    max |x|) per column; the levels of an all-zero column (max |x| < GROUP_MAX_EPS) are garbage, the
    C leaves them at 0 (L + nmax)."""
    n, S = X.shape
    amax, vmax = _first_absmax_cols(X)
    zero = amax < _EPS
    safe_max = np.where(zero, F32(1.0), vmax).astype(F32)
    iscale = F32(-nmax) / safe_max
    L = X * iscale
    _round_clip(L, -nmax, nmax - 1)                  # |iscale*x| <= nmax: in range
    W = np.multiply(X, X, out=scratch("q3W", X.shape))
    WX = np.multiply(W, X, out=scratch("q3WX", X.shape))
    P = np.multiply(WX, L, out=scratch("q3P", X.shape))
    sumlx = seqsum0(P)                               # sumlx += w*x[i]*l
    Q = np.multiply(W, L, out=scratch("q3Q", X.shape))
    Q *= L
    suml2 = seqsum0(Q)                               # suml2 += w*l*l
    _q3_refine(X, W, WX, L, P, Q, sumlx, suml2, np.flatnonzero(~zero), nmax)
    scale = np.where(suml2 > 0, sumlx / suml2, F32(0.0)).astype(F32)
    scale[zero] = F32(0.0)
    return scale, L, amax


def quantize_q3_k(x: np.ndarray) -> np.ndarray:
    nb = x.shape[0]
    X = _to_cols(x, 16)
    scales, L, amax = _make_q3(X, 4)
    sc = scales.reshape(nb, 16)
    amax_s, max_scale = _first_absmax_cols(np.ascontiguousarray(sc.T))
    has = max_scale != 0
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        iscale = np.where(has, F32(-32.0) / np.where(has, max_scale, F32(1.0)), F32(0.0)).astype(F32)
        l = nearest_int(iscale[:, None] * sc)
        l = ((l + 128) & 0xFF) - 128                        # int8_t l = nearest_int(...)
        l = np.clip(l, -32, 31) + 32
        l = np.where(has[:, None], l, 0)                    # scales stay memset to 0
        d_bits = fp16_bits(np.where(has, F32(1.0) / iscale, F32(0.0)))
        sc_dec = l - 32                                     # what the C decodes back from the 6 bits
        d = (fp16_to_f32(d_bits)[:, None] * sc_dec).astype(F32).reshape(-1)
        keep = d == 0
        ds = np.where(keep, F32(1.0), d).astype(F32)
        V = np.divide(X, ds, out=scratch("q3V", X.shape))
        safe = all_within((amax / np.abs(ds))[~keep])       # |x| <= amax
    Lnew = _round_clip(V, -4, 3, safe)
    Lnew += F32(4.0)
    if keep.any():
        Lnew[:, keep] = L[:, keep] + F32(4.0)
        Lnew[:, keep & (amax < _EPS)] = F32(0.0)
    Lb = _from_cols(Lnew.astype(np.uint8), nb)              # levels 0..7
    hbit = (Lb >> np.uint8(2)).reshape(nb, 8, 32)           # element j -> hmask[j % 32] bit j // 32
    hmask = hbit[:, 0].copy()
    for b in range(1, 8):
        hmask |= hbit[:, b] << np.uint8(b)
    low = Lb & np.uint8(3)                                  # L > 3 ? L - 4 : L
    A = low.reshape(nb, 2, 4, 32)
    qs = (A[:, :, 0] | (A[:, :, 1] << 2) | (A[:, :, 2] << 4) | (A[:, :, 3] << 6)).reshape(nb, 64)
    lu = l.astype(np.uint8)
    scb = np.zeros((nb, 12), dtype=np.uint8)
    scb[:, 0:8] = (lu[:, 0:8] & 0x0F) | ((lu[:, 8:16] & 0x0F) << 4)
    hi2 = lu >> 4                                           # j -> byte 8 + j%4, shift 2*(j//4)
    for j in range(16):
        scb[:, 8 + j % 4] |= hi2[:, j] << (2 * (j // 4))
    return np.concatenate([hmask, qs, scb, d_bits.view(np.uint8).reshape(nb, 2)], axis=1)


# ----------------------------------------------------------------------------------------------------
# dequantization (C operation order)


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
