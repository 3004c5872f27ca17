"""Compiled (numba) IQ grid quantizers, byte-exact with ggml's ``quantize_iq3_xxs`` / ``quantize_iq3_s`` /
``quantize_iq2_xxs`` / ``quantize_iq2_xs`` (what ``ggml_quantize_chunk`` and so ``llama-quantize`` run).

The IQ types store groups of 4 (IQ3) or 8 (IQ2) magnitudes as an index into a fixed grid of allowed level
patterns (256 or 512 points of levels 0..7 or 0..2; the value of level l is 2l+1 times the sub-block scale) and
keep the signs apart. ggml's search, per sub-block of 32 (IQ2_XS: 16): take |x| (the XXS/XS types store 7 signs
per 8 and make the count of negatives even by flipping the element of least weight*x^2), try a range of scales;
for each, round every group to levels, and where that pattern is not a grid point take the nearest grid point
(weighted by sqrt of the element weights) among the point's precomputed neighbours; keep the scale with the best
weighted least-squares fit; re-round the off-grid groups with the fitted scale and refit. The sub-block scales are
then stored as 4-bit multiples of the largest / 31.

Tables: the grid points come from the ``gguf`` package's dequantization grids (the same points in the same order
as ggml's ``kgrid_*``: its dequantizers are bit-exact with ggml's), read as level indices; the map from a level
pattern to its grid index and the neighbour lists of the patterns off the grid are computed here the way ggml's
``iq2xs_init_impl`` / ``iq3xs_init_impl`` do (every grid point at one of the ``nwant`` smallest squared distances,
ordered by distance then index), once per process and type. Nothing is stored in the repository: the grids are
format data the decoder already carries.

Exactness rules of ``_jit`` hold (float32 everywhere, the C's order of operations, ``nearest_int``'s bit trick).
Kernels take whole rows: ``x`` float32 ``(rows, n)``, ``qw`` float32 ``(E, n)`` (zero rows: no importance matrix,
the weights are then x^2 where ggml allows that), and fill ``out`` uint8 ``(rows, row_bytes)``.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from ._jit import _OPTS, F0, F1, F_EPS, F_FLT_MAX, F32, _fp16, _njit, _put16, nearest_int
from ._jit_imatrix import _qp, _sum_sq  # make_qp_quants: IQ2_XXS starts from its scale; sum of x^2

F_HALF = F32(0.5)
F_0_1, F_0_2 = F32(0.1), F32(0.2)
F_31 = F32(31.0)
F_256 = F32(256.0)
F_TWO = F32(2.0)
F_EPS_IQ3 = F32(1e-8)         # GROUP_MAX_EPS_IQ3_XXS
F_IQ3XXS_FUDGE = F32(1.0125)  # the scale fudge factors ggml stores d with
F_IQ3S_FUDGE = F32(1.033)


# ----------------------------------------------------------------------------------------------------
# tables


@_njit(**_OPTS)
def _build_tables(levels, nbits, maxl, nwant):
    """``levels`` uint8 (G, gs): the grid points as level indices. Returns the grid as positions 2l+1 (float32),
    the map (pattern -> grid index, or -(offset+1) into the neighbour list) and the neighbour list (at each
    offset: the count, then the grid indices). Patterns with a level above ``maxl`` are never looked up (the
    search clamps to it) and get no list."""
    G, gs = levels.shape
    size = 1 << (nbits * gs)
    grid = np.empty((G, gs), dtype=np.float32)  # the positions as the floats the distances use
    kmap = np.full(size, -1, dtype=np.int32)
    for j in range(G):
        u = 0
        for k in range(gs):
            grid[j, k] = 2 * levels[j, k] + 1
            u |= np.int64(levels[j, k]) << (nbits * k)
        kmap[u] = j
    mask = (1 << nbits) - 1
    d2 = np.empty(G, dtype=np.int64)
    pos = np.empty(gs, dtype=np.int64)
    lv = np.empty(nwant, dtype=np.int64)
    nbrs = np.empty(1 << 16, dtype=np.uint16)
    used = 0
    for i in range(size):
        if kmap[i] >= 0:
            continue
        ok = True
        for k in range(gs):
            l = (i >> (nbits * k)) & mask
            ok = ok and l <= maxl
            pos[k] = 2 * l + 1
        if not ok:
            continue
        for j in range(G):
            s = 0
            for k in range(gs):
                d = np.int64(levels[j, k]) * 2 + 1 - pos[k]
                s += d * d
            d2[j] = s
        nl = 0                                  # the nwant smallest distinct distances, ascending
        while nl < nwant:
            m = np.int64(1) << 62
            for j in range(G):
                if d2[j] < m and (nl == 0 or d2[j] > lv[nl - 1]):
                    m = d2[j]
            if m == np.int64(1) << 62:
                break
            lv[nl] = m
            nl += 1
        cnt = 0
        for t in range(nl):
            for j in range(G):
                if d2[j] == lv[t]:
                    cnt += 1
        while used + 1 + cnt > nbrs.shape[0]:
            bigger = np.empty(2 * nbrs.shape[0], dtype=np.uint16)
            bigger[:used] = nbrs[:used]
            nbrs = bigger
        kmap[i] = -(used + 1)
        nbrs[used] = cnt
        used += 1
        for t in range(nl):
            for j in range(G):
                if d2[j] == lv[t]:
                    nbrs[used] = j
                    used += 1
    return grid, kmap, nbrs[:used].copy()


#: per type: (gguf's grid class name, bits per level, highest level the search uses, nwant of ggml's init)
_GRID_SPECS = {"IQ3_XXS": (3, 7, 2), "IQ3_S": (3, 7, 3), "IQ2_XXS": (2, 2, 2), "IQ2_XS": (2, 2, 2),
               "IQ2_S": (2, 2, 1), "IQ1_S": (2, 2, 3)}


@lru_cache(maxsize=None)
def tables(type_name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(grid positions, pattern map, neighbour lists) of an IQ type, computed once per process."""
    from gguf import GGMLQuantizationType
    from gguf import quants as gq

    if type_name == "IQ1_M":       # IQ1_S's grid and tables
        return tables("IQ1_S")
    cls = gq._type_traits[GGMLQuantizationType[type_name]]
    cls.init_grid()
    vals = np.asarray(cls.grid, dtype=np.float32).reshape(cls.grid_shape)
    gmap = np.asarray(cls.grid_map, dtype=np.float32)
    levels = np.searchsorted(gmap, vals).astype(np.uint8)
    if not np.array_equal(gmap[levels], vals):
        raise RuntimeError(f"the gguf package's {type_name} grid holds values off its own level map")
    nbits, maxl, nwant = _GRID_SPECS[type_name]
    return _build_tables(levels, nbits, maxl, nwant)


# ----------------------------------------------------------------------------------------------------
# the shared search


@_njit(inline="always", **_OPTS)
def _qrow(qw, r0, r, rpe):
    return qw[0] if qw.shape[0] == 1 else qw[(r0 + r) // rpe]


@_njit(inline="always", **_OPTS)
def _weights(xr, o, n, q, has_qw, sigma2, weight, waux):
    """``weight = qw * sqrtf(sigma2 + x^2)`` (or ``x^2`` without importances) and ``waux = sqrtf(weight)``."""
    for i in range(n):
        v = xr[o + i]
        weight[i] = q[o + i] * np.sqrt(sigma2 + v * v) if has_qw else v * v
    for i in range(n):
        waux[i] = np.sqrt(weight[i])


@_njit(inline="always", **_OPTS)
def _abs_signs(xr, o, n, weight, xval, signs, even):
    """``xval = |x|`` and per 8 elements the sign bits; ``even`` (the XXS/XS types keep 7 bits): an odd count
    of negatives is made even by flipping the element of least ``weight*x*x`` back to its signed value."""
    for k in range(n // 8):
        nflip = 0
        s = 0
        for i in range(8):
            v = xr[o + 8 * k + i]
            if v >= F0:
                xval[8 * k + i] = v
            else:
                xval[8 * k + i] = -v
                nflip += 1
                s |= 1 << i
        if even and nflip % 2 == 1:
            imin = 0
            v = xr[o + 8 * k]
            mn = weight[8 * k] * v * v
            for i in range(1, 8):
                v = xr[o + 8 * k + i]
                ax = weight[8 * k + i] * v * v
                if ax < mn:
                    mn = ax
                    imin = i
            xval[8 * k + imin] = -xval[8 * k + imin]
            s ^= 1 << imin
        signs[k] = s & 127 if even else s


@_njit(inline="always", **_OPTS)
def _group(xval, waux, o, gs, nbits, kmaxq, idv, scale, grid, kmap, nbrs, L, err):
    """Round group ``xval[o:o+gs]`` to levels with inverse scale ``idv``; a pattern off the grid becomes its
    nearest neighbour for ``scale`` (iq*_find_best_neighbour: weighted by ``waux``, the first of equal
    distances). Writes ``L[o:o+gs]``; returns (grid index, whether the pattern was on the grid). When no
    neighbour has a distance below FLT_MAX (weights that overflowed float32), ggml aborts the process
    (``GGML_ASSERT(grid_index >= 0)``): ``err[0]`` is set and the first neighbour taken."""
    u = 0
    for i in range(gs):
        l = min(kmaxq - 1, max(0, nearest_int(F_HALF * (idv * xval[o + i] - F1))))
        L[o + i] = l
        u |= l << (nbits * i)
    gi = kmap[u]
    if gi >= 0:
        return gi, True
    off = -gi - 1
    best = F_FLT_MAX
    bi = -1
    for j in range(1, np.int64(nbrs[off]) + 1):
        g = np.int64(nbrs[off + j])
        d2 = F0
        for i in range(gs):
            diff = scale * grid[g, i] - xval[o + i]
            d2 += waux[o + i] * diff * diff
        if d2 < best:
            best = d2
            bi = g
    if bi < 0:
        err[0] = 1
        bi = np.int64(nbrs[off + 1])
    for i in range(gs):
        L[o + i] = np.int64(grid[bi, i]) >> 1   # (2l+1-1)/2
    return bi, False


@_njit(inline="always", **_OPTS)
def _fit(weight, xval, L, n):
    """Sequential ``sum w*x*q`` and ``sum w*q*q`` for q = 2L+1."""
    sumqx = F0
    sumq2 = F0
    for i in range(n):
        w = weight[i]
        q = F32(2 * L[i] + 1)
        sumqx += w * xval[i] * q
        sumq2 += w * q * q
    return sumqx, sumq2


@_njit(inline="always", **_OPTS)
def _trials(xval, weight, waux, n, gs, nbits, kmaxq, ntry, step, smax, scale, on0,
            grid, kmap, nbrs, L, Laux, on, on_aux, err):
    """The scale trials ``id = (2*kMaxQ-1 + is*step)/smax`` for is = -ntry..ntry; the best fit's levels go to
    ``L`` and its on-grid flags to ``on``. Returns the best scale (``scale`` if no trial fits)."""
    ng = n // gs
    best = F0
    for k in range(ng):
        on[k] = on0
    for t in range(-ntry, ntry + 1):
        idv = (F32(2 * kmaxq - 1) + F32(t) * step) / smax
        this_scale = F1 / idv
        for k in range(ng):
            on_aux[k] = _group(xval, waux, gs * k, gs, nbits, kmaxq, idv, this_scale, grid, kmap, nbrs, Laux, err)[1]
        sumqx, sumq2 = _fit(weight, xval, Laux, n)
        if sumq2 > F0 and sumqx * sumqx > best * sumq2:
            scale = sumqx / sumq2
            best = scale * sumqx
            for i in range(n):
                L[i] = Laux[i]
            for k in range(ng):
                on[k] = on_aux[k]
    return scale


@_njit(inline="always", **_OPTS)
def _refit(xval, weight, waux, n, gs, nbits, kmaxq, scale, only_off, grid, kmap, nbrs, L, on, err):
    """Re-round the groups (``only_off``: those off the grid) with ``scale`` and refit it."""
    idv = F1 / scale
    for k in range(n // gs):
        if only_off and on[k]:
            continue
        _group(xval, waux, gs * k, gs, nbits, kmaxq, idv, scale, grid, kmap, nbrs, L, err)
    sumqx, sumq2 = _fit(weight, xval, L, n)
    return sumqx / sumq2 if sumq2 > F0 else scale


@_njit(inline="always", **_OPTS)
def _grid_index(L, o, gs, nbits, kmap):
    u = 0
    for i in range(gs):
        u |= L[o + i] << (nbits * i)
    return kmap[u]


@_njit(inline="always", **_OPTS)
def _scratch():
    """weight, waux, xval (32), L, Laux (32), on, on_aux (8), signs (4), scales (16), qp levels (32), and the
    flag of a search ggml would abort (1)."""
    return (np.empty(32, dtype=np.float32), np.empty(32, dtype=np.float32), np.empty(32, dtype=np.float32),
            np.empty(32, dtype=np.int64), np.empty(32, dtype=np.int64), np.empty(8, dtype=np.bool_),
            np.empty(8, dtype=np.bool_), np.empty(4, dtype=np.int64), np.empty(16, dtype=np.float32),
            np.empty(32, dtype=np.int64), np.zeros(1, dtype=np.int64))


@_njit(inline="always", **_OPTS)
def _scale_nibble(idv, s):
    return min(15, max(0, nearest_int(F_HALF * (idv * s - F1))))


# ----------------------------------------------------------------------------------------------------
# IQ3_XXS (98 bytes: fp16 d, 64 grid indices, 8 x uint32 (4 x 7 sign bits | 4-bit scale << 28))
# IQ3_S (110 bytes: fp16 d, qs[64] low 8 bits of the grid indices, qh[8] their 9th bits, signs[32], scales[4])


@_njit(inline="always", **_OPTS)
def _iq3_rows(x, qw, r0, rpe, out, grid, kmap, nbrs, xxs):
    weight, waux, xval, L, Laux, on, on_aux, signs, scales, _, err = _scratch()
    has_qw = qw.shape[0] > 0
    nb = x.shape[1] // 256
    for r in range(x.shape[0]):
        if err[0]:
            return r - 1
        xr = x[r]
        q = _qrow(qw, r0, r, rpe) if has_qw else xr
        for ibl in range(nb):
            b = r * nb + ibl
            o = 256 * ibl
            for i in range(out.shape[1]):
                out[b, i] = 0
            max_scale = F0
            sigma2 = F_TWO * _sum_sq(xr, o, 256) / F_256
            qs_at = 2              # IQ3_S: qs and signs advance only past sub-blocks that were not all zero
            sg_at = 74
            for ib in range(8):
                ob = o + 32 * ib
                _weights(xr, ob, 32, q, has_qw, sigma2, weight, waux)
                _abs_signs(xr, ob, 32, weight, xval, signs, xxs)
                mx = xval[0]
                for i in range(1, 32):
                    mx = mx if mx > xval[i] else xval[i]
                for i in range(32):
                    L[i] = 0
                if (xxs and mx < F_EPS_IQ3) or (not xxs and mx == F0):
                    scales[ib] = F0
                    continue
                scale = _trials(xval, weight, waux, 32, 4, 3, 8, 15 if xxs else 9, F_0_2, mx, mx / F32(15.0),
                                xxs, grid, kmap, nbrs, L, Laux, on, on_aux, err)
                n_off = 0
                for k in range(8):
                    n_off += 0 if on[k] else 1
                if n_off > 0 and scale > F0:
                    scale = _refit(xval, weight, waux, 32, 4, 3, 8, scale, xxs, grid, kmap, nbrs, L, on, err)
                if scale < F0:
                    scale = -scale
                    for k in range(4):
                        signs[k] = (~signs[k]) & (127 if xxs else 255)
                for k in range(8):
                    gi = np.int64(_grid_index(L, 4 * k, 4, 3, kmap))
                    if xxs:
                        out[b, 2 + 8 * ib + k] = gi
                    else:
                        out[b, qs_at + k] = gi & 255
                        out[b, 66 + ib] |= (gi >> 8) << k
                if xxs:
                    ss = signs[0] | (signs[1] << 7) | (signs[2] << 14) | (signs[3] << 21)
                    for j in range(4):
                        out[b, 66 + 4 * ib + j] = (ss >> (8 * j)) & 0xFF
                else:
                    for k in range(4):
                        out[b, sg_at + k] = signs[k]
                    qs_at += 8
                    sg_at += 4
                scales[ib] = scale
                max_scale = max_scale if max_scale > scale else scale
            if max_scale == F0:      # IQ3_XXS stores zeros; IQ3_S keeps what the sub-blocks wrote, with d = 0
                if xxs:
                    for i in range(out.shape[1]):
                        out[b, i] = 0
                continue
            d = max_scale / F_31
            _put16(out, b, 0, _fp16(d * (F_IQ3XXS_FUDGE if xxs else F_IQ3S_FUDGE)))
            idv = F1 / d
            for ib in range(8):
                l = _scale_nibble(idv, scales[ib])
                if xxs:
                    out[b, 66 + 4 * ib + 3] |= l << 4
                elif ib % 2 == 0:
                    out[b, 106 + ib // 2] = l
                else:
                    out[b, 106 + ib // 2] |= l << 4
    return x.shape[0] - 1 if err[0] else -1


@_njit(**_OPTS)
def _iq3_xxs(x, qw, r0, rpe, out, grid, kmap, nbrs):
    return _iq3_rows(x, qw, r0, rpe, out, grid, kmap, nbrs, True)


@_njit(**_OPTS)
def _iq3_s(x, qw, r0, rpe, out, grid, kmap, nbrs):
    return _iq3_rows(x, qw, r0, rpe, out, grid, kmap, nbrs, False)


def iq3_xxs(x, qw, r0, rpe, out):
    return _iq3_xxs(x, qw, r0, rpe, out, *tables("IQ3_XXS"))


def iq3_s(x, qw, r0, rpe, out):
    return _iq3_s(x, qw, r0, rpe, out, *tables("IQ3_S"))


# ----------------------------------------------------------------------------------------------------
# IQ2_XXS (66 bytes: fp16 d, per 32: 4 grid indices, then uint32 4 x 7 sign bits | 4-bit scale << 28)
# IQ2_XS (74 bytes: fp16 d, per 16 elements: 2 x uint16 (9-bit grid index | 7 sign bits << 9), scales[8])


@_njit(inline="always", **_OPTS)
def _iq2_rows(x, qw, r0, rpe, out, grid, kmap, nbrs, xxs):
    weight, waux, xval, L, Laux, on, on_aux, signs, scales, Lqp, err = _scratch()
    n = 32 if xxs else 16
    nsub = 256 // n
    nb = x.shape[1] // 256
    for r in range(x.shape[0]):
        if err[0]:
            return r - 1
        xr = x[r]
        q = _qrow(qw, r0, r, rpe)
        for ibl in range(nb):
            b = r * nb + ibl
            o = 256 * ibl
            for i in range(out.shape[1]):
                out[b, i] = 0
            max_scale = F0
            sigma2 = _sum_sq(xr, o, 256) / F_256
            for ib in range(nsub):
                ob = o + n * ib
                _weights(xr, ob, n, q, True, sigma2, weight, waux)
                _abs_signs(xr, ob, n, weight, xval, signs, True)
                mx = xval[0]
                for i in range(1, n):
                    mx = mx if mx > xval[i] else xval[i]
                for i in range(n):
                    L[i] = 0
                if mx < F_EPS:
                    scales[ib] = F0
                    continue
                if xxs:
                    scale = _qp(32, 4, xval, Lqp, weight)
                    eff_max = scale * F32(3.0)
                    if eff_max <= F0:
                        scales[ib] = F0
                        continue
                    scale = _trials(xval, weight, waux, 32, 8, 2, 3, 6, F_0_1, eff_max, scale, True,
                                    grid, kmap, nbrs, L, Laux, on, on_aux, err)
                    if scale > F0:
                        scale = _refit(xval, weight, waux, 32, 8, 2, 3, scale, False, grid, kmap, nbrs, L, on, err)
                else:
                    scale = _trials(xval, weight, waux, 16, 8, 2, 3, 9, F_0_1, mx, mx / F32(5.0), True,
                                    grid, kmap, nbrs, L, Laux, on, on_aux, err)
                    if (not on[0] or not on[1]) and scale > F0:
                        scale = _refit(xval, weight, waux, 16, 8, 2, 3, scale, True, grid, kmap, nbrs, L, on, err)
                if scale < F0:
                    scale = -scale
                    for k in range(n // 8):
                        signs[k] = (~signs[k]) & 127
                if xxs:
                    for k in range(4):
                        out[b, 2 + 8 * ib + k] = _grid_index(L, 8 * k, 8, 2, kmap)
                    ss = signs[0] | (signs[1] << 7) | (signs[2] << 14) | (signs[3] << 21)
                    for j in range(4):
                        out[b, 6 + 8 * ib + j] = (ss >> (8 * j)) & 0xFF
                else:
                    for k in range(2):
                        v = np.int64(_grid_index(L, 8 * k, 8, 2, kmap)) | (signs[k] << 9)
                        _put16(out, b, 2 + 4 * ib + 2 * k, v)
                scales[ib] = scale
                max_scale = max_scale if max_scale > scale else scale
            if max_scale == F0:
                for i in range(out.shape[1]):
                    out[b, i] = 0
                continue
            d = max_scale / F_31
            _put16(out, b, 0, _fp16(d))
            idv = F1 / d
            for ib in range(nsub):
                l = _scale_nibble(idv, scales[ib])
                if xxs:
                    out[b, 6 + 8 * ib + 3] |= l << 4
                elif ib % 2 == 0:
                    out[b, 66 + ib // 2] = l
                else:
                    out[b, 66 + ib // 2] |= l << 4
    return x.shape[0] - 1 if err[0] else -1


@_njit(**_OPTS)
def _iq2_xxs(x, qw, r0, rpe, out, grid, kmap, nbrs):
    return _iq2_rows(x, qw, r0, rpe, out, grid, kmap, nbrs, True)


@_njit(**_OPTS)
def _iq2_xs(x, qw, r0, rpe, out, grid, kmap, nbrs):
    return _iq2_rows(x, qw, r0, rpe, out, grid, kmap, nbrs, False)


def iq2_xxs(x, qw, r0, rpe, out):
    return _iq2_xxs(x, qw, r0, rpe, out, *tables("IQ2_XXS"))


def iq2_xs(x, qw, r0, rpe, out):
    return _iq2_xs(x, qw, r0, rpe, out, *tables("IQ2_XS"))


# ----------------------------------------------------------------------------------------------------
# IQ2_S (82 bytes: fp16 d, qs[32] low 8 bits of the grid indices, qs[32:64] 8 sign bits per 8, qh[8] their 9th-10th
# bits, scales[8]); a 1024-point grid, 16-element sub-blocks, no importance matrix allowed (weights sigma2/4 + x^2)

F_QUARTER = F32(0.25)
F_EPS_IQ2S = F32(1e-8)        # GROUP_MAX_EPS_IQ2_S
F_IQ2S_FUDGE = F32(0.9875)


@_njit(**_OPTS)
def _iq2_s(x, qw, r0, rpe, out, grid, kmap, nbrs):
    weight, waux, xval, L, Laux, on, on_aux, signs, scales, _, err = _scratch()
    has_qw = qw.shape[0] > 0
    nb = x.shape[1] // 256
    for r in range(x.shape[0]):
        if err[0]:
            return r - 1
        xr = x[r]
        q = _qrow(qw, r0, r, rpe) if has_qw else xr
        for ibl in range(nb):
            b = r * nb + ibl
            o = 256 * ibl
            for i in range(out.shape[1]):
                out[b, i] = 0
            max_scale = F0
            sigma2 = F_TWO * _sum_sq(xr, o, 256) / F_256
            for ib in range(16):
                ob = o + 16 * ib
                if has_qw:
                    _weights(xr, ob, 16, q, True, sigma2, weight, waux)
                else:
                    for i in range(16):
                        v = xr[ob + i]
                        weight[i] = F_QUARTER * sigma2 + v * v
                    for i in range(16):
                        waux[i] = np.sqrt(weight[i])
                _abs_signs(xr, ob, 16, weight, xval, signs, False)
                mx = xval[0]
                for i in range(1, 16):
                    mx = mx if mx > xval[i] else xval[i]
                for i in range(16):
                    L[i] = 0
                if mx < F_EPS_IQ2S:
                    scales[ib] = F0
                    continue
                scale = _trials(xval, weight, waux, 16, 8, 2, 3, 9, F_0_1, mx, mx / F32(5.0), True,
                                grid, kmap, nbrs, L, Laux, on, on_aux, err)
                if (not on[0] or not on[1]) and scale > F0:
                    scale = _refit(xval, weight, waux, 16, 8, 2, 3, scale, True, grid, kmap, nbrs, L, on, err)
                if scale < F0:
                    scale = -scale
                    for k in range(2):
                        signs[k] = (~signs[k]) & 255
                for k in range(2):
                    gi = np.int64(_grid_index(L, 8 * k, 8, 2, kmap))
                    i8 = 2 * ib + k
                    out[b, 2 + i8] = gi & 255
                    out[b, 66 + i8 // 4] |= (gi >> 8) << (2 * (i8 % 4))
                    out[b, 34 + i8] = signs[k]
                scales[ib] = scale
                max_scale = max_scale if max_scale > scale else scale
            if max_scale == F0:       # as ggml: what the sub-blocks wrote stays, with d = 0
                continue
            d = max_scale / F_31
            _put16(out, b, 0, _fp16(d * F_IQ2S_FUDGE))
            idv = F1 / d
            for ib in range(16):
                l = _scale_nibble(idv, scales[ib])
                if ib % 2 == 0:
                    out[b, 74 + ib // 2] = l
                else:
                    out[b, 74 + ib // 2] |= l << 4
    return x.shape[0] - 1 if err[0] else -1


def iq2_s(x, qw, r0, rpe, out):
    return _iq2_s(x, qw, r0, rpe, out, *tables("IQ2_S"))


# ----------------------------------------------------------------------------------------------------
# IQ1_S (50 bytes: fp16 d, qs[32] low 8 bits of the grid indices, qh[8] uint16: 3 high bits per index, a 3-bit
# scale << 12 and the sign of the 0.125 shift << 15); a 2048-point grid of levels -1, 0, 1 in groups of 8

F_IQ1_DELTA = F32(0.125)
F_IQ1S_FUDGE = F32(1.125)
F_15 = F32(15.0)
F_EPS_IQ1S = F32(1e-12)       # GROUP_MAX_EPS_IQ1_S


@_njit(inline="always", **_OPTS)
def _split_fit(sumx, sumw, n, x_p, x_m, scale, at):
    """The exhaustive search of quantize_row_iq1_s_impl: levels x_p (or x_m) for the sorted elements split into
    [0, i1), [i1, i2), [i2, n), every split (i1 <= i2) with x_p then x_m, sequential in the C's order. ``at`` gets
    the best split and its shift (1 for x_p, -1 for x_m, 0 if none fits); returns the best scale."""
    best = -F_FLT_MAX
    at[2] = 0
    p0, p1, p2 = x_p[0], x_p[1], x_p[2]
    m0, m1, m2 = x_m[0], x_m[1], x_m[2]
    for i1 in range(n + 1):
        ax = sumx[i1] - sumx[0]
        aw = sumw[i1] - sumw[0]
        for i2 in range(i1, n + 1):
            bx = sumx[i2] - sumx[i1]
            cx = sumx[n] - sumx[i2]
            bw = sumw[i2] - sumw[i1]
            cw = sumw[n] - sumw[i2]
            sumqx = ax * p0 + bx * p1 + cx * p2
            sumq2 = aw * p0 * p0 + bw * p1 * p1 + cw * p2 * p2
            if sumq2 > F0 and sumqx * sumqx > best * sumq2:
                scale = sumqx / sumq2
                best = scale * sumqx
                at[0] = i1
                at[1] = i2
                at[2] = 1
            sumqx = ax * m0 + bx * m1 + cx * m2
            sumq2 = aw * m0 * m0 + bw * m1 * m1 + cw * m2 * m2
            if sumq2 > F0 and sumqx * sumqx > best * sumq2:
                scale = sumqx / sumq2
                best = scale * sumqx
                at[0] = i1
                at[1] = i2
                at[2] = -1
    return scale


@_njit(inline="always", **_OPTS)
def _iq1_neighbour(xb, xo, weight, o, scale, xx, grid, nbrs, off, L, err):
    """iq1_find_best_neighbour2: the neighbour whose levels times ``scale`` are nearest ``x`` (weights
    ``weight``); none with a finite distance is where ggml scans the whole grid reading past the group's 8 values
    (undefined): ``err[0]`` is set instead."""
    best = F_FLT_MAX
    bi = -1
    for j in range(1, np.int64(nbrs[off]) + 1):
        g = np.int64(nbrs[off + j])
        d2 = F0
        for i in range(8):
            q = xx[np.int64(grid[g, i]) >> 1]
            diff = scale * q - xb[xo + i]
            d2 += weight[o + i] * diff * diff
        if d2 < best:
            best = d2
            bi = g
    if bi < 0:
        err[0] = 1
        bi = np.int64(nbrs[off + 1])
    for i in range(8):
        L[o + i] = np.int64(grid[bi, i]) >> 1   # (2l+1-1)/2
    return bi


@_njit(**_OPTS)
def _iq1_s(x, qw, r0, rpe, out, grid, kmap, nbrs):
    weight = np.empty(32, dtype=np.float32)
    sumx = np.empty(33, dtype=np.float32)
    sumw = np.empty(33, dtype=np.float32)
    order = np.empty(32, dtype=np.int64)
    L = np.empty(32, dtype=np.int64)
    index = np.empty(4, dtype=np.int64)
    scales = np.empty(8, dtype=np.float32)
    shifts = np.empty(8, dtype=np.int64)
    at = np.empty(3, dtype=np.int64)
    err = np.zeros(1, dtype=np.int64)
    x_p = np.array([-F1 + F_IQ1_DELTA, F_IQ1_DELTA, F1 + F_IQ1_DELTA], dtype=np.float32)
    x_m = np.array([-F1 - F_IQ1_DELTA, -F_IQ1_DELTA, F1 - F_IQ1_DELTA], dtype=np.float32)
    nb = x.shape[1] // 256
    for r in range(x.shape[0]):
        if err[0]:
            return r - 1
        xr = x[r]
        q = _qrow(qw, r0, r, rpe)
        for ibl in range(nb):
            b = r * nb + ibl
            o = 256 * ibl
            for i in range(out.shape[1]):
                out[b, i] = 0
            max_scale = F0
            sigma2 = F_TWO * _sum_sq(xr, o, 256) / F_256
            for ib in range(8):
                ob = o + 32 * ib
                for i in range(32):
                    v = xr[ob + i]
                    weight[i] = q[ob + i] * np.sqrt(sigma2 + v * v)
                mx = abs(xr[ob])
                for i in range(1, 32):
                    a = abs(xr[ob + i])
                    mx = mx if mx > a else a
                if mx < F_EPS_IQ1S:
                    scales[ib] = F0
                    shifts[ib] = 1
                    continue
                for j in range(32):          # sort by value, equal values in index order (glibc's merge sort)
                    v = xr[ob + j]
                    k = j
                    while k > 0 and xr[ob + order[k - 1]] > v:
                        order[k] = order[k - 1]
                        k -= 1
                    order[k] = j
                sumx[0] = F0
                sumw[0] = F0
                for j in range(32):
                    i = order[j]
                    sumx[j + 1] = sumx[j] + weight[i] * xr[ob + i]
                    sumw[j + 1] = sumw[j] + weight[i]
                scale = _split_fit(sumx, sumw, 32, x_p, x_m, mx, at)
                shift = at[2]
                if shift == 0:
                    scales[ib] = F0
                    shifts[ib] = 1
                    continue
                for j in range(32):
                    L[order[j]] = 0 if j < at[0] else (1 if j < at[1] else 2)
                if scale < F0:
                    for j in range(32):
                        L[j] = 2 - L[j]
                    scale = -scale
                    shift = -shift
                xx = x_p if shift == 1 else x_m
                on = True
                for k in range(4):
                    u = 0
                    for j in range(8):
                        u |= L[8 * k + j] << (2 * j)
                    gi = np.int64(kmap[u])
                    if gi < 0:
                        on = False
                        gi = _iq1_neighbour(xr, ob + 8 * k, weight, 8 * k, scale, xx, grid, nbrs, -gi - 1, L, err)
                    index[k] = gi
                if not on:
                    sumqx = F0
                    sumq2 = F0
                    for k in range(4):
                        for j in range(8):
                            w = weight[8 * k + j]
                            qv = xx[np.int64(grid[index[k], j]) >> 1]
                            sumqx += w * qv * xr[ob + 8 * k + j]
                            sumq2 += w * qv * qv
                    if sumqx > F0 and sumq2 > F0:
                        scale = sumqx / sumq2
                h = 0
                for k in range(4):
                    out[b, 2 + 4 * ib + k] = index[k] & 255
                    h |= (index[k] >> 8) << (3 * k)
                _put16(out, b, 34 + 2 * ib, h)
                scales[ib] = scale
                shifts[ib] = shift
                max_scale = max_scale if max_scale > scale else scale
            if max_scale == F0:
                continue
            d = max_scale / F_15
            _put16(out, b, 0, _fp16(d * F_IQ1S_FUDGE))
            idv = F1 / d
            for ib in range(8):
                l = min(7, max(0, nearest_int(F_HALF * (idv * scales[ib] - F1))))
                if shifts[ib] == -1:
                    l |= 8
                out[b, 34 + 2 * ib + 1] |= l << 4
    return x.shape[0] - 1 if err[0] else -1


def iq1_s(x, qw, r0, rpe, out):
    return _iq1_s(x, qw, r0, rpe, out, *tables("IQ1_S"))


# ----------------------------------------------------------------------------------------------------
# IQ1_M (56 bytes: qs[32] low 8 bits of the grid indices, qh[16] their 3 high bits and the shift signs per group,
# scales[8] as 4 x uint16: 3-bit scales per 16 elements and the nibbles of the fp16 super-block scale); IQ1_S's grid


F_EPS_IQ1M = F32(1e-7)        # GROUP_MAX_EPS_IQ1_M
F_IQ1M_FUDGE = F32(1.1125)


@_njit(inline="always", **_OPTS)
def _iq1m_xx(shift, k, x_p, x_m):
    """The levels of group ``k`` (0 or 1) for the sub-block's shift pair ``shift`` (0: ++, 1: +-, 2: -+, 3: --)."""
    if k == 0:
        return x_p if shift < 2 else x_m
    return x_p if shift % 2 == 0 else x_m


@_njit(inline="always", **_OPTS)
def _iq1m_weights(xr, ob, q, has_qw, sigma2, weight):
    for i in range(16):
        v = xr[ob + i]
        weight[i] = q[ob + i] * np.sqrt(sigma2 + v * v) if has_qw else v * v


@_njit(**_OPTS)
def _iq1_m(x, qw, r0, rpe, out, grid, kmap, nbrs):
    weight = np.empty(16, dtype=np.float32)
    px = np.empty((2, 17), dtype=np.float32)
    pw = np.empty((2, 17), dtype=np.float32)
    order = np.empty(16, dtype=np.int64)
    L = np.empty(16, dtype=np.int64)
    index = np.empty(2, dtype=np.int64)
    scales = np.empty(16, dtype=np.float32)
    shifts = np.empty(16, dtype=np.int64)
    sc = np.empty(4, dtype=np.int64)
    err = np.zeros(1, dtype=np.int64)
    x_p = np.array([-F1 + F_IQ1_DELTA, F_IQ1_DELTA, F1 + F_IQ1_DELTA], dtype=np.float32)
    x_m = np.array([-F1 - F_IQ1_DELTA, -F_IQ1_DELTA, F1 - F_IQ1_DELTA], dtype=np.float32)
    p2, m2 = x_p[2], x_m[2]
    cp1 = x_p[0] * x_p[0] - x_p[1] * x_p[1]
    cp2 = x_p[1] * x_p[1] - x_p[2] * x_p[2]
    cm1 = x_m[0] * x_m[0] - x_m[1] * x_m[1]
    cm2 = x_m[1] * x_m[1] - x_m[2] * x_m[2]
    has_qw = qw.shape[0] > 0
    nb = x.shape[1] // 256
    for r in range(x.shape[0]):
        if err[0]:
            return r - 1
        xr = x[r]
        q = _qrow(qw, r0, r, rpe) if has_qw else xr
        for ibl in range(nb):
            b = r * nb + ibl
            o = 256 * ibl
            for i in range(out.shape[1]):
                out[b, i] = 0
            max_scale = F0
            sigma2 = F_TWO * _sum_sq(xr, o, 256) / F_256
            for ib in range(16):
                ob = o + 16 * ib
                _iq1m_weights(xr, ob, q, has_qw, sigma2, weight)
                mx = abs(xr[ob])
                for i in range(1, 16):
                    a = abs(xr[ob + i])
                    mx = mx if mx > a else a
                if mx < F_EPS_IQ1M:
                    scales[ib] = F0
                    shifts[ib] = 0
                    continue
                for j in range(16):          # sort by value, equal values in index order (glibc's merge sort)
                    v = xr[ob + j]
                    k = j
                    while k > 0 and xr[ob + order[k - 1]] > v:
                        order[k] = order[k - 1]
                        k -= 1
                    order[k] = j
                for h in range(2):
                    px[h, 0] = F0
                    pw[h, 0] = F0
                for j in range(16):          # prefix sums per half of the sub-block
                    i = order[j]
                    h = 0 if i < 8 else 1
                    px[h, j + 1] = px[h, j] + weight[i] * xr[ob + i]
                    px[1 - h, j + 1] = px[1 - h, j]
                    pw[h, j + 1] = pw[h, j] + weight[i]
                    pw[1 - h, j + 1] = pw[1 - h, j]
                tx0, tx1, tw0, tw1 = px[0, 16], px[1, 16], pw[0, 16], pw[1, 16]
                best = -F_FLT_MAX
                scale = mx
                b1 = -1
                b2 = -1
                bk = -1
                for i1 in range(17):
                    for i2 in range(i1, 17):
                        sx0 = px[0, i1] + px[0, i2]
                        sx1 = px[1, i1] + px[1, i2]
                        qxp0 = tx0 * p2 - sx0
                        qxm0 = tx0 * m2 - sx0
                        qxp1 = tx1 * p2 - sx1
                        qxm1 = tx1 * m2 - sx1
                        q2p0 = tw0 * p2 * p2 + pw[0, i1] * cp1 + pw[0, i2] * cp2
                        q2m0 = tw0 * m2 * m2 + pw[0, i1] * cm1 + pw[0, i2] * cm2
                        q2p1 = tw1 * p2 * p2 + pw[1, i1] * cp1 + pw[1, i2] * cp2
                        q2m1 = tw1 * m2 * m2 + pw[1, i1] * cm1 + pw[1, i2] * cm2
                        for k in range(4):       # shift pairs ++, +-, -+, -- in ggml's order
                            sqx = (qxp0 if k < 2 else qxm0) + (qxp1 if k % 2 == 0 else qxm1)
                            sq2 = (q2p0 if k < 2 else q2m0) + (q2p1 if k % 2 == 0 else q2m1)
                            if sq2 > F0 and sqx * sqx > best * sq2:
                                scale = sqx / sq2
                                best = scale * sqx
                                b1 = i1
                                b2 = i2
                                bk = k
                if bk < 0:
                    scales[ib] = F0
                    shifts[ib] = 0
                    continue
                for j in range(16):
                    L[order[j]] = 0 if j < b1 else (1 if j < b2 else 2)
                if scale < F0:
                    for j in range(16):
                        L[j] = 2 - L[j]
                    scale = -scale
                    bk = 3 - bk
                on = True
                for k in range(2):
                    xx = _iq1m_xx(bk, k, x_p, x_m)
                    u = 0
                    for j in range(8):
                        u |= L[8 * k + j] << (2 * j)
                    gi = np.int64(kmap[u])
                    if gi < 0:
                        on = False
                        gi = _iq1_neighbour(xr, ob + 8 * k, weight, 8 * k, scale, xx, grid, nbrs, -gi - 1, L, err)
                    index[k] = gi
                if not on:
                    sqx = F0
                    sq2 = F0
                    for k in range(2):
                        xx = _iq1m_xx(bk, k, x_p, x_m)
                        for j in range(8):
                            w = weight[8 * k + j]
                            qv = xx[np.int64(grid[index[k], j]) >> 1]
                            sqx += w * qv * xr[ob + 8 * k + j]
                            sq2 += w * qv * qv
                    if sqx > F0 and sq2 > F0:
                        scale = sqx / sq2
                out[b, 2 * ib] = index[0] & 255
                out[b, 2 * ib + 1] = index[1] & 255
                out[b, 32 + ib] = (index[0] >> 8) | ((index[1] >> 8) << 4)
                scales[ib] = scale
                shifts[ib] = bk
                max_scale = max_scale if max_scale > scale else scale
            if max_scale == F0:
                continue
            d = max_scale / F_15
            idv = F1 / d
            sqx = F0
            sq2 = F0
            for j in range(4):
                sc[j] = 0
            for ib in range(16):
                ob = o + 16 * ib
                l = min(7, max(0, nearest_int(F_HALF * (idv * scales[ib] - F1))))
                sc[ib // 4] |= l << (3 * (ib % 4))
                sh = shifts[ib]
                out[b, 32 + ib] |= (0x80 if sh == 1 or sh == 3 else 0) | (0x08 if sh >= 2 else 0)
                _iq1m_weights(xr, ob, q, has_qw, sigma2, weight)
                qh = np.int64(out[b, 32 + ib])
                for k in range(2):
                    xx = _iq1m_xx(sh, k, x_p, x_m)
                    g = np.int64(out[b, 2 * ib + k]) + ((qh << (8 - 4 * k)) & 0x700)
                    for j in range(8):
                        w = weight[8 * k + j]
                        qv = xx[np.int64(grid[g, j]) >> 1] * F32(2 * l + 1)
                        sqx += w * qv * xr[ob + 8 * k + j]
                        sq2 += w * qv * qv
            if sq2 > F0:
                d = sqx / sq2
            h = _fp16(d * F_IQ1M_FUDGE)
            sc[0] |= (h & 0x000F) << 12
            sc[1] |= (h & 0x00F0) << 8
            sc[2] |= (h & 0x0F00) << 4
            sc[3] |= h & 0xF000
            for j in range(4):
                _put16(out, b, 48 + 2 * j, sc[j])
    return x.shape[0] - 1 if err[0] else -1


def iq1_m(x, qw, r0, rpe, out):
    return _iq1_m(x, qw, r0, rpe, out, *tables("IQ1_M"))
