"""32-element block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) and the plain float types, bit-exact with
ggml's ``quantize_row_*_ref``.

Kernels take a float32 C-contiguous ``(n_blocks, 32)`` chunk and return ``(n_blocks, type_size)`` uint8.
Short per-block reductions go through torch (``amax`` over 32 contiguous floats is ~7x faster there
than numpy's); everything else is numpy. A block whose inverse scale is not finite (a subnormal block,
or a range that overflows) takes an exact C-emulation path; all others the fast one.
"""

from __future__ import annotations

import numpy as np

from ._fp import F32, cvtt_i32, fp16_bits, fp16_to_f32, roundf


def _torch():
    import torch  # deferred: only quantization needs it

    return torch


def _amax_amin(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    t = _torch().from_numpy(x)
    return t.amax(dim=1).numpy(), t.amin(dim=1).numpy()


def _first_zero_sign_fix(x: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Where a block's extreme ``v`` is zero, the C scan keeps the FIRST zero it met (``<``/``>`` never
    prefer -0.0 over +0.0 or back), so its sign is that of the first zero element of the block."""
    z = np.flatnonzero(v == 0)
    if z.size:
        rows = x[z]
        first = np.argmax(rows == 0, axis=1)
        v = v.copy()
        v[z] = rows[np.arange(z.size), first]
    return v


def _min_max(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-block ``min``/``max`` as the C loops starting at +-FLT_MAX find them (signed zeros included)."""
    mx, mn = _amax_amin(x)
    return _first_zero_sign_fix(x, mn), _first_zero_sign_fix(x, mx)


def _signed_absmax(x: np.ndarray) -> np.ndarray:
    """The value at the FIRST index of max |x| per block (``if (amax < fabsf(v))``), +0.0 if all zero."""
    mx, mn = _amax_amin(x)
    amax = np.maximum(mx, -mn)
    vmax = np.where(mx >= -mn, mx, mn)
    both = (mx == -mn) & (mx > 0)  # +a and -a both present: the first one in the block wins
    if both.any():
        rows = x[both]
        vmax[both] = rows[np.arange(rows.shape[0]), np.argmax(np.abs(rows) == amax[both][:, None], axis=1)]
    vmax[amax == 0] = F32(0.0)
    return vmax


def _inverse(d: np.ndarray) -> np.ndarray:
    """``d ? 1.0f/d : 0.0f``."""
    with np.errstate(divide="ignore", over="ignore"):
        return np.where(d != 0, F32(1.0) / np.where(d != 0, d, F32(1.0)), F32(0.0)).astype(F32)


def _to_c_uint8(v: np.ndarray, exotic: np.ndarray, signed: bool) -> np.ndarray:
    """``(int8_t)v`` or ``(uint8_t)v`` as int32 (low byte kept, as gcc's truncating conversion does),
    with the exact x86 result for the rows flagged ``exotic`` (NaN/inf/out of range possible)."""
    q = np.empty(v.shape, dtype=np.int32)
    ok = ~exotic
    if ok.all():
        q[...] = v.astype(np.int32)
    else:
        q[ok] = v[ok].astype(np.int32)
        q[exotic] = cvtt_i32(v[exotic])
    if signed:
        q = ((q + 128) & 0xFF) - 128
    else:
        q &= 0xFF
    return q


def _out(nb: int, parts: list[np.ndarray]) -> np.ndarray:
    size = sum(p.shape[1] for p in parts)
    out = np.empty((nb, size), dtype=np.uint8)
    o = 0
    for p in parts:
        out[:, o:o + p.shape[1]] = p
        o += p.shape[1]
    return out


def _h16(v: np.ndarray) -> np.ndarray:
    return fp16_bits(v).view(np.uint8).reshape(-1, 2)


def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    nb = x.shape[0]
    mx, mn = _amax_amin(x)
    amax = np.maximum(mx, -mn) + F32(0.0)   # MAX(amax, fabsf(v)) from +0: never -0.0
    d = amax / F32(127)
    inv = _inverse(d)
    exotic = ~np.isfinite(inv)
    v = x * inv[:, None]
    roundf(v)
    q = _to_c_uint8(v, np.broadcast_to(exotic[:, None], v.shape), signed=True) if exotic.any() else v.astype(np.int8)
    return _out(nb, [_h16(d), q.astype(np.int8).view(np.uint8)])


def _q_sym(x: np.ndarray, nlev: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_0 / Q5_0: ``d = max / -nlev``, ``q = MIN(2nlev-1, (int8_t)(x*id + nlev+0.5))``."""
    vmax = _signed_absmax(x)
    d = vmax / F32(-nlev)
    inv = _inverse(d)
    exotic = ~np.isfinite(inv)
    v = x * inv[:, None]
    v += F32(nlev + 0.5)
    if exotic.any():
        q = _to_c_uint8(v, np.broadcast_to(exotic[:, None], v.shape), signed=True)
        np.minimum(q, 2 * nlev - 1, out=q)
        q = (q & 0xFF).astype(np.uint8)  # stored through uint8_t
    else:
        q = v.astype(np.uint8)  # v in [0.5, 2*nlev + 0.5]: truncation fits in a byte
        np.minimum(q, np.uint8(2 * nlev - 1), out=q)
    return d, q


def _q_asym(x: np.ndarray, nmax: int, clamp: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_1 / Q5_1: ``d = (max - min) / nmax``, ``q = (x - min)*id + 0.5`` truncated."""
    mn, mx = _min_max(x)
    with np.errstate(over="ignore", invalid="ignore"):
        d = (mx - mn) / F32(nmax)
        inv = _inverse(d)
        exotic = ~(np.isfinite(inv) & np.isfinite(d))
        v = x - mn[:, None]
        v *= inv[:, None]
        v += F32(0.5)
    if exotic.any():
        q = _to_c_uint8(v, np.broadcast_to(exotic[:, None], v.shape), signed=clamp)
        if clamp:  # Q4_1: MIN(15, (int8_t)...), then stored as uint8_t
            np.minimum(q, nmax, out=q)
        q = (q & 0xFF).astype(np.uint8)
    else:
        q = v.astype(np.uint8)  # v in [0.5, nmax + 0.5]
        if clamp:
            np.minimum(q, np.uint8(nmax), out=q)
    return d, mn, q


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """``qs[j] = (q[j] & 0xF) | (q[j+16] & 0xF) << 4``."""
    return (q[:, :16] & np.uint8(0x0F)) | (q[:, 16:] << np.uint8(4))


def _pack_qh(q: np.ndarray) -> np.ndarray:
    """The 5th bit of each of the 32 quants as a little-endian uint32 (bit j = element j)."""
    return np.packbits((q >> np.uint8(4)) & np.uint8(1), axis=1, bitorder="little")


def quantize_q4_0(x: np.ndarray) -> np.ndarray:
    d, q = _q_sym(x, 8)
    return _out(x.shape[0], [_h16(d), q[:, :16] | (q[:, 16:] << np.uint8(4))])


def quantize_q5_0(x: np.ndarray) -> np.ndarray:
    d, q = _q_sym(x, 16)
    return _out(x.shape[0], [_h16(d), _pack_qh(q), _pack_nibbles(q)])


def quantize_q4_1(x: np.ndarray) -> np.ndarray:
    d, mn, q = _q_asym(x, 15, clamp=True)
    return _out(x.shape[0], [_h16(d), _h16(mn), q[:, :16] | (q[:, 16:] << np.uint8(4))])


def quantize_q5_1(x: np.ndarray) -> np.ndarray:
    d, mn, q = _q_asym(x, 31, clamp=False)
    return _out(x.shape[0], [_h16(d), _h16(mn), _pack_qh(q), _pack_nibbles(q)])


# ----------------------------------------------------------------------------------------------------
# dequantization, in the C's operation order (``x0*d``, ``x0*d + m``) so results are bit-identical


def _d16(b: np.ndarray, at: int) -> np.ndarray:
    return fp16_to_f32(np.ascontiguousarray(b[:, at:at + 2]).view(np.uint16)).reshape(-1)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    return np.unpackbits(qh, axis=1, bitorder="little")


def dequantize_q8_0(b: np.ndarray) -> np.ndarray:
    return b[:, 2:].view(np.int8).astype(F32) * _d16(b, 0)[:, None]


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
