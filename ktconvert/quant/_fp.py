"""Bit-level emulation of the C float idioms ggml's reference quantizers rely on.

Every helper reproduces what gcc emits for ``ggml-quants.c`` on x86-64 (SSE2, no FMA), including the
results on inputs where C is formally undefined (float to int8 of NaN or infinity), because those
inputs do occur on real tensors (subnormal blocks give an infinite inverse scale).
"""

from __future__ import annotations

import threading

import numpy as np

F32 = np.float32
_MAGIC = F32(12582912.0)  # 1.5 * 2**23: adding it rounds to an integer in the mantissa
_HALF_BELOW = np.nextafter(F32(0.5), F32(0.0))
#: |v| below this: nearest_int(v) == rint(v) and no float to int conversion can overflow.
SAFE_INT = F32(4194303.0)


def nearest_int(v: np.ndarray) -> np.ndarray:
    """ggml's ``nearest_int``: the ``+ 12582912.f`` bit trick, exact for every float including NaN/inf."""
    t = np.add(v, _MAGIC, dtype=F32)
    i = t.view(np.int32)
    np.bitwise_and(i, 0x007FFFFF, out=i)
    np.subtract(i, 0x00400000, out=i)
    return i


def nint_clip_f32(v: np.ndarray, lo: int, hi: int, safe: bool) -> np.ndarray:
    """``MAX(lo, MIN(hi, nearest_int(v)))`` as float32, in place on ``v`` when the fast path applies.

    ``safe`` asserts every element is finite with |v| <= SAFE_INT, where nearest_int equals
    round-half-even; callers derive it from per-block bounds, never by scanning ``v``.
    """
    if safe:
        np.rint(v, out=v)
        np.clip(v, F32(lo), F32(hi), out=v)
        return v
    i = nearest_int(v)
    np.clip(i, lo, hi, out=i)
    v[...] = i
    return v


def all_within(*bounds: np.ndarray) -> bool:
    """True when every bound is finite and within SAFE_INT (NaN compares false, so it fails)."""
    for b in bounds:
        if b.size and not (np.all(b <= SAFE_INT) and np.all(b >= -SAFE_INT)):
            return False
    return True


def cvtt_i32(v: np.ndarray) -> np.ndarray:
    """C float -> int conversion as x86 ``cvttss2si`` does it: truncate; NaN and out-of-range give INT32_MIN."""
    v = np.asarray(v, dtype=F32)
    ok = np.abs(v) < F32(2147483648.0)  # False for NaN and inf
    out = np.full(v.shape, np.iinfo(np.int32).min, dtype=np.int32)
    out[ok] = v[ok].astype(np.int32)
    return out


def roundf(v: np.ndarray) -> np.ndarray:
    """C ``roundf`` (half away from zero), in place, exact for every float32.

    ``trunc(v + copysign(0.49999997, v))`` avoids the 0.49999997 trap of ``floor(v + 0.5)``.
    """
    h = np.copysign(_HALF_BELOW, v)
    np.add(v, h, out=v)
    np.trunc(v, out=v)
    return v


def fp16_bits(v: np.ndarray) -> np.ndarray:
    """fp32 -> IEEE fp16 bits (round to nearest even, overflow to inf), as ``GGML_FP32_TO_FP16``.

    For a NaN ggml keeps only the sign and returns the quiet NaN 0x7E00; numpy keeps the top payload
    bits, which is the same for every NaN float arithmetic can produce, so only that case is patched.
    """
    v = np.asarray(v, dtype=F32)
    with np.errstate(over="ignore", invalid="ignore"):
        h = v.astype(np.float16).view(np.uint16)
    nan = np.isnan(v)
    if nan.any():
        h[nan] = ((v[nan].view(np.uint32) >> 16) & 0x8000).astype(np.uint16) | np.uint16(0x7E00)
    return h


def fp16_to_f32(h: np.ndarray) -> np.ndarray:
    """fp16 bits -> float32 (exact)."""
    return h.view(np.float16).astype(F32)


def _seq_reduce(a: np.ndarray) -> np.ndarray:
    if a.shape[1] < 2:
        # a single column would be reduced along a contiguous axis, where numpy sums pairwise
        a2 = np.zeros((a.shape[0], 2), dtype=a.dtype)
        a2[:, :1] = a
        return np.add.reduce(a2, axis=0)[:1]
    return np.add.reduce(a, axis=0)


def seqsum0(a: np.ndarray) -> np.ndarray:
    """``float s = 0; for (i...) s += a[i];`` for each column of a 2-D array.

    numpy reduces a non-contiguous axis row by row, left to right, in float32 (its pairwise summation
    only applies along a contiguous axis); :func:`check_reduce_order` guards that assumption.
    ``+ 0`` turns an all-(-0.0) sum into +0.0 as the C's ``0 + ...`` start does.
    """
    s = _seq_reduce(a)
    s += F32(0.0)
    return s


def seqsum_first(a: np.ndarray) -> np.ndarray:
    """``float s = a[0]; for (i = 1...) s += a[i];`` for each column."""
    return _seq_reduce(a)


_ORDER_OK: list[bool] = []


def check_reduce_order() -> None:
    """Fail loudly (once per process) if this numpy does not reduce axis 0 strictly left to right."""
    if _ORDER_OK:
        return
    # left to right, (2^25 + 1) + 1 + ... rounds every +1 away; any tree order keeps some of them
    a = np.ones((17, 3), dtype=F32)
    a[0] = F32(2.0 ** 25)
    if not np.all(seqsum_first(a) == a[0]):
        raise RuntimeError(f"numpy {np.__version__} does not sum axis 0 sequentially; "
                           "ktconvert's quantizers cannot be bit-exact with it")
    _ORDER_OK.append(True)


_TLS = threading.local()


def scratch(key: str, shape: tuple[int, ...], dtype=F32) -> np.ndarray:
    """A reusable per-thread buffer. Fresh multi-MB arrays cost a page fault per 4 KiB on first touch
    (~10x the arithmetic on them here), so hot kernels draw their temporaries from here instead. Each
    call site uses its own ``key``; the contents are garbage on return."""
    bufs = _TLS.__dict__.setdefault("bufs", {})
    n = 1
    for d in shape:
        n *= int(d)
    a = bufs.get(key)
    if a is None or a.size < n or a.dtype != np.dtype(dtype):
        a = np.empty(max(n, 1), dtype=dtype)
        bufs[key] = a
    return a[:n].reshape(shape)
