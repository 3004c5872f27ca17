"""Compiled (numba) kt-amx packer: one part of an expert matrix -> kt-kernel's AMXINT8/AMXINT4 bytes and row scales.

The same arithmetic and layout as the numpy reference in :mod:`ktconvert.formats.kt_amx` (its docstring has the
rules; the tests compare both with kt-kernel's compiled packer byte for byte), in one pass per row instead of a
dozen array passes over the matrix: the row's largest magnitude is found on the bit patterns (an integer max,
which also tells a NaN/Inf apart), then each value is scaled, rounded and clamped, and its code lands straight
at its place in the tiles. The input is either float32 holding bf16 values or the stored bf16 bits themselves
(``uint16``, no float32 copy of the matrix made): both are read as float32 bit patterns shifted by ``shift``.

Exactness: every value is float32 (fastmath off, no FMA, ``error_model="numpy"``: x/0 = inf); ``rint`` is the
``+ 1.5 * 2^23`` trick of :mod:`._jit`, exact (ties to even) because the scaled values stay within +-128; the
flush-to-zero of the kernel's scale and of a subnormal input in a row whose largest magnitude is below 1e-30
is done as the reference does it. Compiled on first use and cached on disk (``cache=True``) like the quantizers.
"""

from __future__ import annotations

import numpy as np

from ._jit import _OPTS, _bits_f32, _nint_clamp_f, _njit

_F0 = np.float32(0.0)
_F1 = np.float32(1.0)
_INV127 = np.float32(1) / np.float32(127)
_F112 = np.float32(112.0)
_FLT_MIN_BITS = np.uint32(0x00800000)  # smallest normal float32, as bits
_SMALL = np.float32(1e-30)
_K_BLOCK = 3584
_NONFINITE = np.uint32(0x7F800000)


@_njit(**_OPTS)
def pack_part(src, shift, r0, c0, n, k, bits, out_w, out_s):
    """Pack rows ``r0 .. r0+n``, columns ``c0 .. c0+k`` of ``src`` (float32 bf16 values viewed as ``uint32`` with
    ``shift`` 0, or bf16 bits as ``uint16`` with ``shift`` 16) with ``bits`` 8 or 4 into ``out_w`` (uint32, the
    part's ``n*k*bits/8`` bytes as words) and ``out_s`` (float32 ``n``). Returns the first row holding a NaN or
    an infinity (then nothing is usable), or -1."""
    nb = 64 if bits == 8 else 128  # rows per row block
    kbytes = k if bits == 8 else k // 2  # bytes per packed row
    kb = _K_BLOCK if bits == 8 else _K_BLOCK // 2  # bytes per K block
    codes = np.empty(k, np.int8)
    packed = np.empty(kbytes, np.uint8)
    row = codes.view(np.uint32) if bits == 8 else packed.view(np.uint32)
    sh = np.uint32(shift)
    for rr in range(n):
        srow = src[r0 + rr, c0:c0 + k]
        # the row's largest magnitude, on the bits (non-negative floats order as their bit patterns)
        top = np.uint32(0)
        for j in range(k):
            a = (np.uint32(srow[j]) << sh) & np.uint32(0x7FFFFFFF)
            top = max(top, a)
        if top >= _NONFINITE:
            return rr
        amax = _bits_f32(top)
        d = amax * _INV127 if bits == 8 else amax / _F112
        if d < _bits_f32(_FLT_MIN_BITS):  # d >= 0: the kernel's flush-to-zero
            d = _F0
        r = _F1 / d if d != _F0 else _F0
        out_s[rr] = d
        if amax < _SMALL:  # only here can a subnormal input (which the kernel reads as 0) change a code
            for j in range(k):
                b = np.uint32(srow[j]) << sh
                x = _bits_f32(b) if (b & np.uint32(0x7FFFFFFF)) >= _FLT_MIN_BITS else _F0
                codes[j] = np.int8(_nint_clamp_f(x * r, -128, 127))
        else:
            for j in range(k):
                codes[j] = np.int8(_nint_clamp_f(_bits_f32(np.uint32(srow[j]) << sh) * r, -128, 127))
        if bits == 4:
            # to a multiple of 16, half away from zero, kept as the 4-bit code q/16: (|q| + 8) >> 4 with the sign
            # (+128 would wrap to -128 in the kernel's int8 store: code 8 either way); column c of each 128-column
            # tile in the low nibble, c+64 in the high one
            for t in range(k // 128):
                for o in range(64):
                    lo, hi = np.int32(codes[t * 128 + o]), np.int32(codes[t * 128 + 64 + o])
                    ml, mh = (abs(lo) + 8) >> 4, (abs(hi) + 8) >> 4
                    cl = (ml if lo >= 0 else -ml) & 0xF
                    ch = (mh if hi >= 0 else -mh) & 0xF
                    packed[t * 64 + o] = np.uint8(cl | (ch << 4))
        # scatter the row's 4-byte words into the tiles
        block = rr // nb * nb
        nbs = min(nb, n - block)
        ri = rr - block
        g, h, i = ri // 32, (ri // 16) % 2, ri % 16
        for kb0 in range(0, kbytes, kb):
            kbs = min(kb, kbytes - kb0)
            tiles = kbs // 64
            base = (block * kbytes + kb0 * nbs) // 4
            for c in range(tiles):
                dst = base + ((g * tiles + c) * 2 + h) * 256 + i
                srcw = (kb0 + c * 64) // 4
                for w in range(16):
                    out_w[dst + w * 16] = row[srcw + w]
    return -1
