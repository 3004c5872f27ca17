"""RAWINT4: compressed-tensors ``pack-quantized`` symmetric INT4 with one scale per group of input columns
(Kimi-K2-Thinking / K2.5 / K2.6, group 32), read as released by kt-kernel's RAWINT4 method.

``X.weight_packed`` I32 ``[N, ceil(K/8)]`` (eight 4-bit codes per int32, the lowest bits first, i.e. the low nibble
of each little-endian byte first; U8 ``[N, K/2]`` is the same bytes); ``X.weight_scale`` BF16/F16/F32
``[N, K/group]``; ``X.weight_shape`` I32 ``[2]`` = ``[N, K]``. A code ``c`` stores ``q + 8`` (q in -8..7); value =
``(c - 8) * scale``, exact in float32 for a BF16/F16 scale (compressed-tensors multiplies in the scale's dtype, so
its own BF16 result can be one rounding coarser). An asymmetric checkpoint (``weight_zero_point``) is refused.
"""

from __future__ import annotations

import numpy as np

from ktconvert.formats.packed import Packed, apply_groups, pack_nibbles, unpack_nibbles
from ktconvert.io.dtypes import decode_float32

FMT = "RAWINT4"
SCALE_DTYPES = ("BF16", "F16", "F32")
FIX = "the scale belongs to another weight or release; re-download the checkpoint"


def match(tensors: dict, name: str, read_small=None) -> Packed | None:
    if not name.endswith(".weight_packed"):
        return None
    w = tensors[name]
    base = name[: -len("_packed")]
    sname, shname = base + "_scale", base + "_shape"
    if w.dtype not in ("I32", "U8") or len(w.shape) != 2:
        return None
    if sname in tensors and tensors[sname].dtype == "F8_E4M3":
        return None  # NVFP4's compressed-tensors spelling
    per = 8 if w.dtype == "I32" else 2
    n, k = w.shape[0], w.shape[1] * per
    parts = [("codes", name), ("scale", sname)] + ([("shape", shname)] if shname in tensors else [])
    p = Packed(FMT, base, name, (n, k), 0, tuple(parts))
    if sname not in tensors:
        return p.refused(name, f"packed INT4 weight has no scale tensor {sname}", "a shard or the index is missing; "
                         "re-download the checkpoint")
    if base + "_zero_point" in tensors:
        return p.refused(base + "_zero_point", "asymmetric INT4 (a weight_zero_point) is not supported",
                         "use a symmetric release")
    if shname in tensors and read_small is not None:
        sh = tensors[shname]
        vals = read_small(sh) if sh.dtype in ("I32", "I64") and sh.n_elements == 2 else None
        if vals is None:
            return p.refused(shname, f"weight_shape is {sh.dtype} {list(sh.shape)}, expected two integers [N, K]", FIX)
        rn, rk = int(vals[0]), int(vals[1])
        if rn != n or not (k - per < rk <= k):
            return p.refused(shname, f"weight_shape [{rn}, {rk}] disagrees with {name} {list(w.shape)} "
                             f"({per} codes per element: [{n}, {k - per + 1}..{k}])", FIX)
        k = rk
        p = Packed(FMT, base, name, (n, k), 0, tuple(parts))
    s = tensors[sname]
    if s.dtype not in SCALE_DTYPES:
        return p.refused(sname, f"scale stored as {s.dtype}, expected one of {', '.join(SCALE_DTYPES)}", FIX)
    if len(s.shape) != 2 or s.shape[0] != n or s.shape[1] < 1:
        return p.refused(sname, f"scale shape {list(s.shape)} does not match weight {base} [{n}, {k}]", FIX)
    if k % s.shape[1]:
        return p.refused(sname, f"{s.shape[1]} scale columns do not divide K = {k} of {base} into whole groups", FIX)
    return Packed(FMT, base, name, (n, k), k // s.shape[1], tuple(parts))


def _scale(ck, p: Packed, r0: int, r1: int) -> np.ndarray:
    return decode_float32(np.asarray(ck.read(p.scale)[r0:r1]), ck[p.scale].dtype)


def decode_rows(ck, p: Packed, r0: int, r1: int) -> np.ndarray:
    raw = np.ascontiguousarray(ck.read(p.stored)[r0:r1]).view(np.uint8)
    x = unpack_nibbles(raw)[:, : p.shape[1]].astype(np.float32) - np.float32(8)
    return apply_groups(x, _scale(ck, p, r0, r1), p.group)


def scale_values(ck, p: Packed) -> list[tuple[str, np.ndarray]]:
    return [(p.scale, _scale(ck, p, 0, p.shape[0]))]


def encode(x: np.ndarray, group: int = 32) -> dict[str, tuple[np.ndarray, str]]:
    """float32 ``[N, K]`` (K a multiple of 8) -> stored tensors: BF16 scale amax/7 per group (rounded up to BF16 so
    no code saturates), codes round(x/scale) + 8 packed into int32."""
    n, k = x.shape
    amax = np.abs(x).reshape(n, k // group, group).max(axis=2) / np.float32(7)
    bits = amax.astype(np.float32).view(np.uint32)
    up = ((bits + 0xFFFF) & 0xFFFF0000).view(np.float32)  # BF16, rounded up
    scale = np.where(up > 0, up, np.float32(1)).astype(np.float32)
    q = np.clip(np.rint(x / np.repeat(scale, group, axis=1)), -8, 7).astype(np.int16) + 8
    packed = np.ascontiguousarray(pack_nibbles(q.astype(np.uint8))).view("<i4")
    return {"weight_packed": (packed, "I32"), "weight_scale": ((scale.view(np.uint32) >> 16).astype(np.uint16), "BF16"),
            "weight_shape": (np.array([n, k], dtype=np.int32), "I32")}
