"""Compiled (numba) quantizers, byte-exact with ggml's ``quantize_row_*_ref``: scalar loops in the C's order.

Why compiled: the earlier numpy formulation was bound by array passes whose cost varied with
the CPU and numpy build; these loops do what the C does, element by element, so their speed tracks the C's on
any machine, and they release the GIL so threads over row slices use every core.

Exactness rules kept here (see the module tests against ggml's C): every value is float32 and every literal a
float32 constant (a Python float or an int mixed with a float32 would promote to float64); fastmath is off, so
LLVM neither reassociates the sequential sums nor contracts ``a*b + c`` into an FMA (it only does either with
the ``contract``/``reassoc`` flags fastmath sets); ``error_model="numpy"`` gives IEEE division (x/0 = inf, not
an exception). C's float-to-int conversions are x86 ``cvttss2si`` (NaN and out of range give INT32_MIN) and
``nearest_int`` is the ``+ 12582912.f`` bit trick, both emulated exactly because subnormal blocks feed them
infinities. fp32<->fp16 are done on the bit patterns (round to nearest even; NaN -> sign | 0x7E00 as ggml).

Kernels take float32 ``(n_blocks, block_size)`` and fill uint8 ``(n_blocks, type_size)``; they are compiled on
first use (only the types used) and cached on disk by numba (``cache=True``: beside this file, or in numba's
per-user cache directory when the install is read-only; ``NUMBA_CACHE_DIR`` overrides both).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

_OPTS = dict(nogil=True, error_model="numpy", fastmath=False, boundscheck=False)


def _njit(fn=None, **kw):
    """``njit`` with numba's on-disk cache where one is writable; without it (numba finds no writable place:
    a read-only install and a read-only home) the kernels still work, compiled in each process."""
    def deco(f):
        try:
            return njit(cache=True, **kw)(f)
        except RuntimeError:  # "cannot cache function ...: no locator available"
            return njit(cache=False, **kw)(f)
    return deco if fn is None else deco(fn)

F32 = np.float32
F0, F1 = F32(0.0), F32(1.0)
F_HALF_BELOW = F32(0.49999997)     # nextafter(0.5f, 0): roundf(v) == trunc(v + copysign(this, v)) for every float
F_MAGIC = F32(12582912.0)          # 1.5 * 2^23
F_TWO_M24 = F32(2.0 ** -24)        # fp16 subnormal unit
F_I32_LIM = F32(2147483648.0)
F_EPS = F32(1e-15)                 # GROUP_MAX_EPS
F_0_1, F_0_5 = F32(0.1), F32(0.5)
F_127, F_63, F_32, F_15 = F32(127.0), F32(63.0), F32(32.0), F32(15.0)
F_FLT_MAX = F32(np.finfo(np.float32).max)


@intrinsic
def _f32_bits(typingctx, x):
    """The IEEE bits of a float32, as int32 (C's memcpy)."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.int32(types.float32), codegen


@intrinsic
def _bits_f32(typingctx, i):
    """The float32 whose bits are the low 32 of integer ``i``."""
    if not isinstance(i, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        v = args[0]
        if i.bitwidth > 32:
            v = builder.trunc(v, ir.IntType(32))
        elif i.bitwidth < 32:
            v = builder.zext(v, ir.IntType(32))
        return builder.bitcast(v, ir.FloatType())

    return types.float32(i), codegen


@intrinsic
def _nint_clamp_f(typingctx, v, lo, hi):
    """``(float)MAX(lo, MIN(hi, nearest_int(v)))`` for a float32 ``v`` and int ``lo``/``hi`` constants: the same
    bit trick as :func:`nearest_int`, in 32-bit integer lanes (numba would widen to int64), so a loop over it
    vectorizes."""
    if v != types.float32 or not isinstance(lo, types.Integer) or not isinstance(hi, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        lo_, hi_ = (builder.trunc(a, i32) if t.bitwidth > 32 else builder.sext(a, i32) if t.bitwidth < 32 else a
                    for a, t in zip(args[1:], sig.args[1:]))
        t = builder.fadd(args[0], ir.Constant(ir.FloatType(), 12582912.0))
        i = builder.sub(builder.and_(builder.bitcast(t, i32), ir.Constant(i32, 0x007FFFFF)),
                        ir.Constant(i32, 0x00400000))
        i = builder.select(builder.icmp_signed(">", i, hi_), hi_, i)
        i = builder.select(builder.icmp_signed("<", i, lo_), lo_, i)
        return builder.sitofp(i, ir.FloatType())

    return types.float32(v, lo, hi), codegen


@_njit(inline="always", **_OPTS)
def nearest_int(v):
    """ggml's nearest_int (assert compiled out, so exact for every float, NaN and inf included)."""
    t = v + F_MAGIC
    return (np.int64(_f32_bits(t)) & 0x007FFFFF) - 0x00400000


@_njit(inline="always", **_OPTS)
def _cvtt(v):
    """C float -> int on x86-64 (cvttss2si): truncation; NaN and out of range give INT32_MIN."""
    if v > -F_I32_LIM and v < F_I32_LIM:
        return np.int64(v)
    return np.int64(-2147483648)


@_njit(inline="always", **_OPTS)
def _i8(c):
    """``(int8_t)c``: the low byte, sign-extended."""
    return ((c + 128) & 0xFF) - 128


@_njit(inline="always", **_OPTS)
def _fp16(f):
    """fp32 -> fp16 bits, round to nearest even, overflow to inf, NaN -> sign | 0x7E00 (GGML_FP32_TO_FP16)."""
    b = np.int64(_f32_bits(f)) & 0xFFFFFFFF
    sign = (b >> 16) & 0x8000
    a = b & 0x7FFFFFFF
    if a > 0x7F800000:
        return sign | 0x7E00
    if a >= 0x477FF000:               # >= 65520 rounds to inf
        return sign | 0x7C00
    if a >= 0x38800000:               # fp16 normal: rebias the exponent, round the 13 dropped bits
        return sign | ((a - 0x38000000 + 0xFFF + ((a >> 13) & 1)) >> 13)
    if a <= 0x33000000:               # <= 2^-25 rounds to (signed) zero
        return sign
    e = a >> 23
    m = (a & 0x7FFFFF) | 0x800000
    sh = 126 - e                      # value = m * 2^(e-150); fp16 subnormal unit 2^-24
    h = m >> sh
    rem = m & ((np.int64(1) << sh) - 1)
    half = np.int64(1) << (sh - 1)
    if rem > half or (rem == half and (h & 1) == 1):
        h += 1
    return sign | h


@_njit(inline="always", **_OPTS)
def _fp16_f32(h):
    """fp16 bits -> float32 (exact)."""
    sign = (h & 0x8000) << 16
    e = (h >> 10) & 0x1F
    m = h & 0x3FF
    if e == 0:
        if m == 0:
            return _bits_f32(sign)
        v = F32(m) * F_TWO_M24
        return _bits_f32(np.int64(_f32_bits(v)) | sign)
    if e == 31:
        return _bits_f32(sign | 0x7F800000 | (m << 13))
    return _bits_f32(sign | ((e + 112) << 23) | (m << 13))


@_njit(inline="always", **_OPTS)
def _put16(out, b, at, h):
    out[b, at] = h & 0xFF
    out[b, at + 1] = (h >> 8) & 0xFF


# ----------------------------------------------------------------------------------------------------
# F16 and the 32-element types


@_njit(**_OPTS)
def finite(x):
    """Whether every element of the float32 2-D array is finite: one pass over the exponent bits (integer max,
    so it vectorizes), fused with the quantization of the same chunk while it is in cache."""
    acc = np.int64(0)
    for r in range(x.shape[0]):
        for c in range(x.shape[1]):
            acc = max(acc, np.int64(_f32_bits(x[r, c])) & 0x7F800000)
    return acc < 0x7F800000


# The float "quantizers" are one pass over memory, so a separate finite() pass would cost as much as the
# conversion itself: they check finiteness in the same loop and return it (the caller drops the output on False).

@_njit(**_OPTS)
def f32(x, out):
    """float32 rows copied bit for bit into ``out`` (an int32 view of the same shape); returns whether every value
    was finite. One pass, as the C's memcpy."""
    acc = np.int32(0)
    for r in range(x.shape[0]):
        for c in range(x.shape[1]):
            b = _f32_bits(x[r, c])
            out[r, c] = b
            acc = max(acc, b & np.int32(0x7F800000))
    return acc < 0x7F800000


@_njit(**_OPTS)
def from_bf16(raw, out):
    """bf16 bits (uint16 rows) -> float32 bits (``out``: an int32 view of the float32 rows of the same shape), the
    exact widening; returns whether every value was finite. One pass: the decode and the finiteness check that
    numpy would make three passes of (cast, shift, max/min)."""
    acc = np.int32(0)
    for r in range(raw.shape[0]):
        for c in range(raw.shape[1]):
            b = np.int32(raw[r, c]) << 16
            out[r, c] = b
            acc = max(acc, b & np.int32(0x7F800000))
    return acc < 0x7F800000


@_njit(**_OPTS)
def bf16(x, out):
    """float32 rows -> bf16 bits (uint16), round to nearest even on the bit pattern (ggml_compute_fp32_to_bf16
    without its NaN branch: a NaN makes the result False and the output is not used); returns finiteness."""
    acc = np.int64(0)
    for r in range(x.shape[0]):
        for c in range(x.shape[1]):
            u = np.int64(_f32_bits(x[r, c])) & 0xFFFFFFFF
            acc = max(acc, u & 0x7F800000)
            out[r, c] = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return acc < 0x7F800000


@_njit(**_OPTS)
def f16(x, out):
    """float32 rows -> fp16 bits (uint16, same shape); returns finiteness."""
    acc = np.int32(0)
    for r in range(x.shape[0]):
        for c in range(x.shape[1]):
            acc = max(acc, _f32_bits(x[r, c]) & np.int32(0x7F800000))
            out[r, c] = _fp16(x[r, c])
    return acc < 0x7F800000


@_njit(**_OPTS)
def q8_0(x, out):
    for b in range(x.shape[0]):
        amax = F0
        for j in range(32):
            v = abs(x[b, j])
            amax = amax if amax > v else v          # MAX(amax, fabsf(v))
        d = amax / F_127
        idd = F1 / d if d != F0 else F0
        _put16(out, b, 0, _fp16(d))
        for j in range(32):
            v = x[b, j] * idd
            v = v + (F_HALF_BELOW if v >= F0 else -F_HALF_BELOW)   # roundf, then the int8 store
            out[b, 2 + j] = _cvtt(v) & 0xFF


@_njit(inline="always", **_OPTS)
def _signed_absmax(x, b):
    """The value at the first index of max |x| (``if (amax < fabsf(v))`` from 0), +0.0 for an all-zero block."""
    amax = F0
    mx = F0
    for j in range(x.shape[1]):
        v = x[b, j]
        av = abs(v)
        if amax < av:
            amax = av
            mx = v
    return mx


@_njit(inline="always", **_OPTS)
def _first_zero(x, b):
    for j in range(x.shape[1]):
        if x[b, j] == F0:
            return x[b, j]
    return F0


@_njit(inline="always", **_OPTS)
def _min_max(x, b):
    """min and max as the C finds them from FLT_MAX / -FLT_MAX with strict ``<``/``>``: integer min/max over
    order-preserving keys of the bits (vectorizes); when the result is a zero the C kept the first zero it met,
    whose sign can differ from the key's."""
    lo = np.int64(2147483647)
    hi = np.int64(-2147483648)
    for j in range(x.shape[1]):
        i = np.int64(_f32_bits(x[b, j]))
        k = i ^ ((i >> 31) & 0x7FFFFFFF)
        lo = min(lo, k)
        hi = max(hi, k)
    mn = _bits_f32(lo ^ ((lo >> 31) & 0x7FFFFFFF))
    mx = _bits_f32(hi ^ ((hi >> 31) & 0x7FFFFFFF))
    if mn == F0:
        mn = _first_zero(x, b)
    if mx == F0:
        mx = _first_zero(x, b)
    return mn, mx


@_njit(**_OPTS)
def q4_0(x, out):
    for b in range(x.shape[0]):
        d = _signed_absmax(x, b) / F32(-8.0)
        idd = F1 / d if d != F0 else F0
        _put16(out, b, 0, _fp16(d))
        for j in range(16):
            x0 = x[b, j] * idd
            x1 = x[b, 16 + j] * idd
            q0 = min(15, _i8(_cvtt(x0 + F32(8.5))))
            q1 = min(15, _i8(_cvtt(x1 + F32(8.5))))
            out[b, 2 + j] = (q0 | (q1 << 4)) & 0xFF


@_njit(**_OPTS)
def q5_0(x, out):
    for b in range(x.shape[0]):
        d = _signed_absmax(x, b) / F32(-16.0)
        idd = F1 / d if d != F0 else F0
        _put16(out, b, 0, _fp16(d))
        qh = np.int64(0)
        for j in range(16):
            x0 = x[b, j] * idd
            x1 = x[b, 16 + j] * idd
            q0 = min(31, _i8(_cvtt(x0 + F32(16.5)))) & 0xFF
            q1 = min(31, _i8(_cvtt(x1 + F32(16.5)))) & 0xFF
            out[b, 6 + j] = (q0 & 0x0F) | ((q1 & 0x0F) << 4)
            qh |= ((q0 & 0x10) >> 4) << j
            qh |= ((q1 & 0x10) >> 4) << (j + 16)
        for k in range(4):
            out[b, 2 + k] = (qh >> (8 * k)) & 0xFF


@_njit(**_OPTS)
def q4_1(x, out):
    for b in range(x.shape[0]):
        mn, mx = _min_max(x, b)
        d = (mx - mn) / F_15
        idd = F1 / d if d != F0 else F0
        _put16(out, b, 0, _fp16(d))
        _put16(out, b, 2, _fp16(mn))
        for j in range(16):
            x0 = (x[b, j] - mn) * idd
            x1 = (x[b, 16 + j] - mn) * idd
            q0 = min(15, _i8(_cvtt(x0 + F_0_5)))
            q1 = min(15, _i8(_cvtt(x1 + F_0_5)))
            out[b, 4 + j] = (q0 | (q1 << 4)) & 0xFF


@_njit(**_OPTS)
def q5_1(x, out):
    for b in range(x.shape[0]):
        mn, mx = _min_max(x, b)
        d = (mx - mn) / F32(31.0)
        idd = F1 / d if d != F0 else F0
        _put16(out, b, 0, _fp16(d))
        _put16(out, b, 2, _fp16(mn))
        qh = np.int64(0)
        for j in range(16):
            x0 = (x[b, j] - mn) * idd
            x1 = (x[b, 16 + j] - mn) * idd
            q0 = _cvtt(x0 + F_0_5) & 0xFF            # (uint8_t)
            q1 = _cvtt(x1 + F_0_5) & 0xFF
            out[b, 8 + j] = (q0 & 0x0F) | ((q1 & 0x0F) << 4)
            qh |= ((q0 & 0x10) >> 4) << j
            qh |= ((q1 & 0x10) >> 4) << (j + 16)
        for k in range(4):
            out[b, 4 + k] = (qh >> (8 * k)) & 0xFF


# ----------------------------------------------------------------------------------------------------
# K-quant searches


@_njit(inline="always", **_OPTS)
def _requant_asym(x, b, o, n, d, dm, nmax, L):
    """``if (!d) continue; L = clamp(nearest_int((x + dm)/d), 0, nmax)``."""
    if d == F0:
        return
    for i in range(n):
        L[o + i] = min(nmax, max(0, nearest_int((x[b, o + i] + dm) / d)))


_STEP = 8  # elements summed in registers between loads and stores of the lane sums (n is a multiple of it)


@_njit(inline="always", **_OPTS)
def _qkx2_lanes(X, Wt, n, S, nmax, rmin, rdelta, nstep, use_mad, Laux, V, Lf, step):
    """make_qkx2_quants(n, nmax, x, w, L, &the_min, Laux, rmin, rdelta, nstep, use_mad) for S sub-blocks at once
    (also make_qkx3_quants with its weights given: the two differ only in ``max <= min`` for ``max == min``,
    the same test once ``min`` is clamped to <= 0).

    ``X[i, s]``/``Wt[i, s]``: element i of sub-block s and its weight, so each sub-block's sums still run over
    its elements in order while the loops over s (independent lanes) vectorize. Returns nothing: ``V[4]`` gets
    the scales, ``V[0]`` the mins (``-min``, >= 0) and ``Lf[i, s]`` the levels. Keeps the C quirk that ``min``
    is updated in place when an iteration is accepted (later iterations use it in ``max - min`` and
    ``x - min``); the accepted levels are rebuilt once at the end from that iteration's (iscale, min).

    ``step`` (a constant, dividing n): elements whose lane sums stay in registers between a load and a store of
    them. ``_STEP`` where S is 16 or more (an unrolled block of 8 per vector of lanes); 1 for fewer lanes (the
    importance-matrix searches' 8-16), whose vector loop would otherwise fall to its scalar remainder."""
    fnmax = F32(nmax)
    mn, mx, sum_w, sum_x, scale, best, isc = V[0], V[1], V[2], V[3], V[4], V[5], V[6]
    sl, sl2, sxl, ts, tm, err, acc_isc, acc_mn, live = V[7], V[8], V[9], V[10], V[11], V[12], V[13], V[14], V[15]
    for s in range(S):
        v = X[0, s]
        mn[s] = v
        mx[s] = v
        sum_w[s] = Wt[0, s]
        sum_x[s] = Wt[0, s] * v
    for i in range(1, n):
        for s in range(S):
            v = X[i, s]
            if v < mn[s]:
                mn[s] = v
            if v > mx[s]:
                mx[s] = v
            w = Wt[i, s]
            sum_w[s] += w
            sum_x[s] += w * v
    for s in range(S):
        if mn[s] > F0:
            mn[s] = F0
        live[s] = F1 if mx[s] != mn[s] else F0     # max == min: L = 0, scale 0 (C returns at once)
        isc[s] = fnmax / (mx[s] - mn[s])
        scale[s] = F1 / isc[s]
        acc_isc[s] = isc[s]
        acc_mn[s] = mn[s]
        best[s] = F0
    for i in range(n):
        for s in range(S):
            v = X[i, s]
            l = _nint_clamp_f(isc[s] * (v - mn[s]), 0, nmax)
            diff = scale[s] * l + mn[s] - v
            diff = abs(diff) if use_mad else diff * diff
            best[s] += Wt[i, s] * diff
    for it in range(nstep + 1):
        c = rmin + rdelta * F32(it) + fnmax
        for s in range(S):
            isc[s] = c / (mx[s] - mn[s])
            sl[s] = F0
            sl2[s] = F0
            sxl[s] = F0
        for i0 in range(0, n, step):
            for s in range(S):
                a_sl = sl[s]
                a_sl2 = sl2[s]
                a_sxl = sxl[s]
                isc_s = isc[s]
                mn_s = mn[s]
                for k in range(step):
                    v = X[i0 + k, s]
                    l = _nint_clamp_f(isc_s * (v - mn_s), 0, nmax)
                    Laux[i0 + k, s] = l
                    wl = Wt[i0 + k, s] * l
                    a_sl += wl                       # sum_l += w*l
                    a_sl2 += wl * l                  # sum_l2 += w*l*l
                    a_sxl += wl * v                  # sum_xl += w*l*x
                sl[s] = a_sl
                sl2[s] = a_sl2
                sxl[s] = a_sxl
        for s in range(S):
            D = sum_w[s] * sl2[s] - sl[s] * sl[s]
            this_scale = (sum_w[s] * sxl[s] - sum_x[s] * sl[s]) / D
            this_min = (sl2[s] * sum_x[s] - sl[s] * sxl[s]) / D
            if this_min > F0:
                this_min = F0
                this_scale = sxl[s] / sl2[s]
            ts[s] = this_scale
            tm[s] = this_min
            if not (D > F0):                         # C skips the error and the update
                live[s] = -live[s] if live[s] > F0 else live[s]
        for s in range(S):
            err[s] = F0
        for i0 in range(0, n, step):
            for s in range(S):
                a_err = err[s]
                ts_s = ts[s]
                tm_s = tm[s]
                for k in range(step):
                    diff = ts_s * Laux[i0 + k, s] + tm_s - X[i0 + k, s]
                    diff = abs(diff) if use_mad else diff * diff
                    a_err += Wt[i0 + k, s] * diff
                err[s] = a_err
        for s in range(S):
            if live[s] > F0 and err[s] < best[s]:
                best[s] = err[s]
                scale[s] = ts[s]
                acc_isc[s] = isc[s]
                acc_mn[s] = mn[s]                    # the min Laux was made with
                mn[s] = tm[s]
            if live[s] < F0:
                live[s] = F1
    for i in range(n):
        for s in range(S):
            Lf[i, s] = _nint_clamp_f(acc_isc[s] * (X[i, s] - acc_mn[s]), 0, nmax) if live[s] > F0 else F0
    for s in range(S):
        if live[s] == F0:
            scale[s] = F0
        mn[s] = -mn[s]


@_njit(inline="always", **_OPTS)
def _q45_group(x, out, b0, g, nmax, rmin, nstep, L, X, Wt, Laux, V, Lf):
    """Q4_K / Q5_K for super-blocks b0..b0+g-1: sub-block searches (8 per block, all g*8 as lanes), 6-bit
    scales, fp16 d/dmin; leaves block t's re-quantized levels in ``L[t]``."""
    S = 8 * g
    for t in range(g):
        for j in range(8):
            for i in range(32):
                X[i, 8 * t + j] = x[b0 + t, 32 * j + i]
    sx2 = V[16]
    for s in range(S):
        sx2[s] = F0
    for i in range(32):
        for s in range(S):
            v = X[i, s]
            sx2[s] += v * v
    for s in range(S):
        sx2[s] = np.sqrt(sx2[s] / F_32)           # av_x
    for i in range(32):
        for s in range(S):
            Wt[i, s] = sx2[s] + abs(X[i, s])      # weights[l] = av_x + fabsf(x[l])
    _qkx2_lanes(X, Wt, 32, S, nmax, rmin, F_0_1, nstep, False, Laux, V, Lf, _STEP)
    for t in range(g):
        b = b0 + t
        max_scale = F0
        max_min = F0
        for j in range(8):
            sc = V[4, 8 * t + j]
            m = V[0, 8 * t + j]
            if sc > max_scale:
                max_scale = sc
            if m > max_min:
                max_min = m
            for i in range(32):
                L[t, 32 * j + i] = np.int64(Lf[i, 8 * t + j])
        inv_scale = F_63 / max_scale if max_scale > F0 else F0
        inv_min = F_63 / max_min if max_min > F0 else F0
        for k in range(12):
            out[b, 4 + k] = 0
        dh = _fp16(max_scale / F_63)
        mh = _fp16(max_min / F_63)
        _put16(out, b, 0, dh)
        _put16(out, b, 2, mh)
        d_all = _fp16_f32(dh)
        m_all = _fp16_f32(mh)
        for j in range(8):
            ls = min(63, nearest_int(inv_scale * V[4, 8 * t + j]) & 0xFF)
            lm = min(63, nearest_int(inv_min * V[0, 8 * t + j]) & 0xFF)
            if j < 4:
                out[b, 4 + j] = ls
                out[b, 8 + j] = lm
            else:
                out[b, 8 + j] = (ls & 0x0F) | ((lm & 0x0F) << 4)
                out[b, j] |= (ls >> 4) << 6
                out[b, 4 + j] |= (lm >> 4) << 6
            _requant_asym(x, b, 32 * j, 32, d_all * F32(ls), m_all * F32(lm), nmax, L[t])


@_njit(inline="always", **_OPTS)
def pack_q4k_qs(out, b, L):
    """Q4_K's 128 bytes of levels: 64-element chunks, element l and l+32 in one byte."""
    for c in range(4):
        for l in range(32):
            out[b, 16 + 32 * c + l] = L[64 * c + l] | (L[64 * c + 32 + l] << 4)


@_njit(inline="always", **_OPTS)
def pack_q5k_qs(out, b, L):
    """Q5_K's high bits (32 bytes) and low nibbles (128 bytes)."""
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
def pack_2bit(out, b, at, L):
    """Q2_K/Q3_K's 64 bytes of 2-bit levels at ``at``: element l, l+32, l+64, l+96 of each 128 in one byte."""
    for h in range(2):
        for l in range(32):
            o = 128 * h + l
            out[b, at + 32 * h + l] = (L[o] | (L[o + 32] << 2) | (L[o + 64] << 4) | (L[o + 96] << 6)) & 0xFF


@_njit(inline="always", **_OPTS)
def q3k_tail(xr, o, out, b, L):
    """Q3_K after its scales (bytes 96..107) and d (108) are stored: re-quantize each sub-block with the stored
    scale (a zero one keeps its levels), then the high-bit mask and the 2-bit levels."""
    d_all = _fp16_f32(np.int64(out[b, 108]) | (np.int64(out[b, 109]) << 8))
    for j in range(16):
        lo = np.int64(out[b, 96 + j]) & 0x0F if j < 8 else np.int64(out[b, 96 + j - 8]) >> 4
        sc = (lo | (((np.int64(out[b, 104 + j % 4]) >> (2 * (j // 4))) & 3) << 4)) - 32
        d = d_all * F32(sc)
        if d == F0:
            continue
        for i in range(16):
            L[16 * j + i] = 4 + min(3, max(-4, nearest_int(xr[o + 16 * j + i] / d)))
    for m in range(32):
        hm = 0
        for k in range(8):
            if L[32 * k + m] > 3:
                hm |= 1 << k
                L[32 * k + m] -= 4
        out[b, m] = hm
    pack_2bit(out, b, 32, L)


@_njit(inline="always", **_OPTS)
def q6k_tail(xr, o, out, b, L, scales):
    """Q6_K after the 16 sub-block searches: int8 sub-scales against the largest, fp16 d, re-quantization with
    the stored scales (a zero one keeps its levels), packing; an all-zero block is 210 zero bytes."""
    max_scale = F0
    max_abs = F0
    for j in range(16):
        s = scales[j]
        a = abs(s)
        if a > max_abs:
            max_abs = a
            max_scale = s
    if max_abs < F_EPS:
        for k in range(210):
            out[b, k] = 0
        return
    iscale = F32(-128.0) / max_scale
    dh = _fp16(F1 / iscale)
    _put16(out, b, 208, dh)
    d_all = _fp16_f32(dh)
    for j in range(16):
        q = _i8(min(127, nearest_int(iscale * scales[j])))
        out[b, 192 + j] = q & 0xFF
        d = d_all * F32(q)
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
            out[b, 128 + 32 * h + l] = (a0 >> 4) | ((a1 >> 4) << 2) | ((a2 >> 4) << 4) | ((a3 >> 4) << 6)


_G = 4  # super-blocks searched together: 32 lanes of sub-blocks (two vectors of 16: two independent sum chains)


@_njit(inline="always", **_OPTS)
def _lane_scratch(n, S):
    return (np.empty((_G, 256), dtype=np.int64), np.empty((n, S), dtype=np.float32),
            np.empty((n, S), dtype=np.float32), np.empty((n, S), dtype=np.float32),
            np.empty((17, S), dtype=np.float32), np.empty((n, S), dtype=np.float32))


@_njit(**_OPTS)
def q4_k(x, out):
    L, X, Wt, Laux, V, Lf = _lane_scratch(32, 8 * _G)
    nb = x.shape[0]
    for b0 in range(0, nb, _G):
        g = min(_G, nb - b0)
        _q45_group(x, out, b0, g, 15, F32(-1.0), 20, L, X, Wt, Laux, V, Lf)
        for t in range(g):
            pack_q4k_qs(out, b0 + t, L[t])


@_njit(**_OPTS)
def q5_k(x, out):
    L, X, Wt, Laux, V, Lf = _lane_scratch(32, 8 * _G)
    nb = x.shape[0]
    for b0 in range(0, nb, _G):
        g = min(_G, nb - b0)
        _q45_group(x, out, b0, g, 31, F32(-0.5), 15, L, X, Wt, Laux, V, Lf)
        for t in range(g):
            pack_q5k_qs(out, b0 + t, L[t])


@_njit(**_OPTS)
def q2_k(x, out):
    L1, X, Wt, Laux, V, Lf = _lane_scratch(16, 16)
    L = L1[0]
    for b in range(x.shape[0]):
        for j in range(16):
            for i in range(16):
                v = x[b, 16 * j + i]
                X[i, j] = v
                Wt[i, j] = abs(v)
        _qkx2_lanes(X, Wt, 16, 16, 3, F32(-0.5), F_0_1, 15, True, Laux, V, Lf, _STEP)
        scales, mins = V[4], V[0]
        max_scale = F0
        max_min = F0
        for j in range(16):
            if scales[j] > max_scale:
                max_scale = scales[j]
            if mins[j] > max_min:
                max_min = mins[j]
            for i in range(16):
                L[16 * j + i] = np.int64(Lf[i, j])
        if max_scale > F0:
            iscale = F_15 / max_scale
            for j in range(16):
                out[b, j] = nearest_int(iscale * scales[j]) & 0xFF
            dh = _fp16(max_scale / F_15)
        else:
            for j in range(16):
                out[b, j] = 0
            dh = _fp16(F0)
        if max_min > F0:
            iscale = F_15 / max_min
            for j in range(16):
                out[b, j] = (out[b, j] | (nearest_int(iscale * mins[j]) << 4)) & 0xFF
            mh = _fp16(max_min / F_15)
        else:
            mh = _fp16(F0)
        _put16(out, b, 80, dh)
        _put16(out, b, 82, mh)
        d_all = _fp16_f32(dh)
        m_all = _fp16_f32(mh)
        for j in range(16):
            sc = np.int64(out[b, j])
            _requant_asym(x, b, 16 * j, 16, d_all * F32(sc & 0x0F), m_all * F32(sc >> 4), 3, L)
        pack_2bit(out, b, 16, L)


@_njit(inline="always", **_OPTS)
def _qx_trials(Xt, W, WX, isc, slx, sl2):
    """One make_qx_quants trial (nmax 32, weights x*x) for the 16 sub-blocks at once: ``Xt[i, s]`` is element i
    of sub-block s, so each sub-block's sums still run over its elements in order, and the loop over s (16
    independent lanes) vectorizes."""
    for s in range(16):
        slx[s] = F0
        sl2[s] = F0
    for i0 in range(0, 16, _STEP):  # as in _qkx2_lanes: the sums stay in registers for _STEP elements
        for s in range(16):
            a_slx = slx[s]
            a_sl2 = sl2[s]
            isc_s = isc[s]
            for k in range(_STEP):
                l = _nint_clamp_f(isc_s * Xt[i0 + k, s], -32, 31)
                a_slx += WX[i0 + k, s] * l     # w*x[i]*l, w = x*x
                a_sl2 += W[i0 + k, s] * l * l  # w*l*l
            slx[s] = a_slx
            sl2[s] = a_sl2


@_njit(inline="always", **_OPTS)
def _make_qx_q6_all(x, b, L, Xt, W, WX, amax, den, isc, slx, sl2, scale, best, best_isc):
    """make_qx_quants(16, 32, x + 16*s, L + 16*s, rmse_type=1, qw=NULL) for s = 0..15; scales into ``scale``."""
    for s in range(16):
        amax[s] = F0
        den[s] = F0
        for i in range(16):
            v = x[b, 16 * s + i]
            Xt[i, s] = v
    for i0 in range(0, 16, _STEP):
        for s in range(16):
            a = amax[s]
            d = den[s]
            for k in range(_STEP):
                v = Xt[i0 + k, s]
                w = v * v
                W[i0 + k, s] = w
                WX[i0 + k, s] = w * v
                av = abs(v)
                if av > a:                     # first index of max |x|
                    a = av
                    d = v
            amax[s] = a
            den[s] = d
    for s in range(16):
        if amax[s] < F_EPS:
            den[s] = F1                        # all-zero group: trials are discarded below
        isc[s] = F32(-32.0) / den[s]
        best_isc[s] = isc[s]
    _qx_trials(Xt, W, WX, isc, slx, sl2)
    for s in range(16):
        scale[s] = slx[s] / sl2[s] if sl2[s] != F0 else F0
        best[s] = scale[s] * slx[s]
    for k in range(-9, 10):
        if k == 0:
            continue
        c = -(F_32 + F_0_1 * F32(k))
        for s in range(16):
            isc[s] = c / den[s]
        _qx_trials(Xt, W, WX, isc, slx, sl2)
        for s in range(16):
            if sl2[s] > F0 and slx[s] * slx[s] > best[s] * sl2[s]:
                best_isc[s] = isc[s]
                scale[s] = slx[s] / sl2[s]
                best[s] = scale[s] * slx[s]
    for s in range(16):
        if amax[s] < F_EPS:
            scale[s] = F0
            for i in range(16):
                L[16 * s + i] = 0
        else:                                  # the levels of the trial taken last, as C rebuilds them
            for i in range(16):
                L[16 * s + i] = 32 + np.int64(_nint_clamp_f(best_isc[s] * x[b, 16 * s + i], -32, 31))


@_njit(**_OPTS)
def q6_k(x, out):
    L = np.empty(256, dtype=np.int64)
    Xt = np.empty((16, 16), dtype=np.float32)
    W = np.empty((16, 16), dtype=np.float32)
    WX = np.empty((16, 16), dtype=np.float32)
    v16 = np.empty((9, 16), dtype=np.float32)
    amax, den, isc, slx, sl2, scales, best, best_isc = v16[0], v16[1], v16[2], v16[3], v16[4], v16[5], v16[6], v16[7]
    for b in range(x.shape[0]):
        _make_qx_q6_all(x, b, L, Xt, W, WX, amax, den, isc, slx, sl2, scales, best, best_isc)
        q6k_tail(x[b], 0, out, b, L, scales)


@_njit(inline="always", **_OPTS)
def _make_q3(x, b, o, L):
    """make_q3_quants(16, 4, x + o, L + o, do_rmse=true); L gets levels 0..7 (l + 4), or 0 for a zero group."""
    amax = F0
    mx = F0
    for i in range(16):
        v = x[b, o + i]
        av = abs(v)
        if av > amax:
            amax = av
            mx = v
    if amax < F_EPS:
        for i in range(16):
            L[o + i] = 0
        return F0
    iscale = F32(-4.0) / mx
    sumlx = F0
    suml2 = F0
    for i in range(16):
        xi = x[b, o + i]
        l = min(3, max(-4, nearest_int(iscale * xi)))
        L[o + i] = l
        fl = F32(l)
        w = xi * xi
        sumlx += w * xi * fl
        suml2 += w * fl * fl
    for _ in range(5):
        changed = 0
        for i in range(16):
            xi = x[b, o + i]
            w = xi * xi
            li = F32(L[o + i])
            slx = sumlx - w * xi * li
            if slx > F0:
                sl2 = suml2 - w * li * li
                nl = min(3, max(-4, nearest_int(xi * sl2 / slx)))
                if nl != L[o + i]:
                    fn = F32(nl)
                    slx += w * xi * fn
                    sl2 += w * fn * fn
                    if sl2 > F0 and slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[o + i] = nl
                        sumlx = slx
                        suml2 = sl2
                        changed += 1
        if changed == 0:
            break
    for i in range(16):
        L[o + i] += 4
    return sumlx / suml2 if suml2 > F0 else F0


@_njit(**_OPTS)
def q3_k(x, out):
    L = np.empty(256, dtype=np.int64)
    scales = np.empty(16, dtype=np.float32)
    for b in range(x.shape[0]):
        max_scale = F0
        amax = F0
        for j in range(16):
            s = _make_q3(x, b, 16 * j, L)
            scales[j] = s
            a = abs(s)
            if a > amax:
                amax = a
                max_scale = s
        for k in range(96, 108):
            out[b, k] = 0
        if max_scale != F0:
            iscale = F32(-32.0) / max_scale
            for j in range(16):
                l = min(31, max(-32, _i8(nearest_int(iscale * scales[j])))) + 32
                if j < 8:
                    out[b, 96 + j] = l & 0x0F
                else:
                    out[b, 96 + j - 8] |= (l & 0x0F) << 4
                out[b, 104 + j % 4] |= (l >> 4) << (2 * (j // 4))
            dh = _fp16(F1 / iscale)
        else:
            dh = _fp16(F0)
        _put16(out, b, 108, dh)
        q3k_tail(x[b], 0, out, b, L)
