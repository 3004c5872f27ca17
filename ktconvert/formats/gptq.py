"""GPTQ INT4 (AutoGPTQ / GPTQModel checkpoint format, ``quant_method: gptq``, 4 bits), read as released by
kt-kernel's GPTQ_INT4 method.

``X.qweight`` I32 ``[K/8, N]``: eight 4-bit codes per int32 along the *input* axis, the lowest bits first;
``X.scales`` F16 ``[K/group, N]``; ``X.qzeros`` I32 ``[K/group, N/8]`` (zero points packed along N, stored minus one:
the v1 checkpoint format); ``X.g_idx`` I32 ``[K]`` (group of each input column; ``k // group`` without act-order).
Value = ``(code - (zero + 1)) * scale`` of the column's group, exact in float32 for an F16 scale. kt-kernel's method
is symmetric-only: it ignores ``qzeros`` (assumes zero 8) and ``g_idx`` (refuses act-order in config.json).
"""

from __future__ import annotations

import numpy as np

from ktconvert.formats.packed import Packed
from ktconvert.io.dtypes import decode_float32

FMT = "GPTQ_INT4"
FIX = "the tensors belong to other weights or releases; re-download the checkpoint"


def match(tensors: dict, name: str, read_small=None) -> Packed | None:
    if not name.endswith(".qweight") or tensors[name].dtype != "I32" or len(tensors[name].shape) != 2:
        return None
    base = name[: -len(".qweight")]
    wname = base + ".weight"
    q = tensors[name]
    k, n = q.shape[0] * 8, q.shape[1]
    parts = [("codes", name)] + [(r, base + s) for r, s in (("scale", ".scales"), ("zeros", ".qzeros"),
                                                             ("g_idx", ".g_idx")) if base + s in tensors]
    p = Packed(FMT, wname, name, (n, k), 0, tuple(parts))
    sname, zname = base + ".scales", base + ".qzeros"
    if sname not in tensors:
        return p.refused(name, f"GPTQ weight has no scale tensor {sname}", "a shard is missing; re-download")
    s = tensors[sname]
    if s.dtype not in ("F16", "BF16", "F32") or len(s.shape) != 2 or s.shape[1] != n or s.shape[0] < 1:
        return p.refused(sname, f"scales {s.dtype} {list(s.shape)} do not match qweight {list(q.shape)} "
                         f"(expected F16 [K/group, {n}])", FIX)
    if k % s.shape[0]:
        return p.refused(sname, f"{s.shape[0]} scale rows do not divide K = {k} into whole groups", FIX)
    if zname in tensors and (tensors[zname].dtype != "I32" or tuple(tensors[zname].shape) != (s.shape[0], -(-n // 8))):
        return p.refused(zname, f"qzeros {tensors[zname].dtype} {list(tensors[zname].shape)} does not match "
                         f"[{s.shape[0]}, {-(-n // 8)}]", FIX)
    gi = tensors.get(base + ".g_idx")
    if gi is not None and (gi.dtype not in ("I32", "I64") or tuple(gi.shape) != (k,)):
        return p.refused(base + ".g_idx", f"g_idx {gi.dtype} {list(gi.shape)} is not one integer per input column "
                         f"[{k}]", FIX)
    return Packed(FMT, wname, name, (n, k), k // s.shape[0], tuple(parts))


def _unpack_rows(a: np.ndarray) -> np.ndarray:
    """int32 ``[m, c]`` -> codes ``[8m, c]``: element ``8i + j`` is bits ``4j..4j+3`` of row ``i``."""
    a = np.asarray(a).astype(np.uint32)
    out = np.empty((a.shape[0], 8, a.shape[1]), dtype=np.uint8)
    for j in range(8):
        out[:, j, :] = (a >> (4 * j)) & 0xF
    return out.reshape(a.shape[0] * 8, a.shape[1])


def group_index(ck, p: Packed) -> np.ndarray:
    g = p.part("g_idx")
    if g is None:
        return np.arange(p.shape[1]) // p.group
    return np.asarray(ck.read(g)).astype(np.int64)


def decode_rows(ck, p: Packed, r0: int, r1: int) -> np.ndarray:
    """Logical rows ``r0..r1`` (output features) = columns of ``qweight``, ``scales`` and ``qzeros``."""
    codes = _unpack_rows(ck.read(p.stored)[:, r0:r1])  # [K, n]
    sname = p.scale
    scale = decode_float32(np.asarray(ck.read(sname)[:, r0:r1]), ck[sname].dtype)  # [G, n]
    z = p.part("zeros")
    if z is None:
        zero = np.full(scale.shape, 8, dtype=np.float32)
    else:
        c0 = r0 // 8
        zp = _unpack_rows(np.asarray(ck.read(z)[:, c0: -(-r1 // 8)]).T).T  # [G, 8 * cols]
        zero = zp[:, r0 - 8 * c0: r1 - 8 * c0].astype(np.float32) + np.float32(1)
    gi = group_index(ck, p)
    x = (codes.astype(np.float32) - zero[gi]) * scale[gi]
    return np.ascontiguousarray(x.T)


def scale_values(ck, p: Packed) -> list[tuple[str, np.ndarray]]:
    return [(p.scale, decode_float32(np.asarray(ck.read(p.scale)), ck[p.scale].dtype))]


def is_symmetric(ck, p: Packed) -> bool:
    """Every stored zero point is 7 (zero 8), what kt-kernel assumes."""
    z = p.part("zeros")
    return z is None or bool((np.asarray(ck.read(z)).view(np.uint32) == 0x77777777).all())


def encode(x: np.ndarray, group: int = 32) -> dict[str, tuple[np.ndarray, str]]:
    """float32 ``[N, K]`` -> symmetric GPTQ tensors (F16 scale amax/7 rounded up, zero 8, no act-order)."""
    n, k = x.shape
    w = x.T  # [K, N]
    amax = np.abs(w).reshape(k // group, group, n).max(axis=1) / np.float32(7)
    s16 = amax.astype(np.float16)
    s16 = np.where(s16.astype(np.float32) < amax, np.nextafter(s16, np.float16(np.inf)), s16)
    s16 = np.where(s16 > 0, s16, np.float16(1)).astype(np.float16)
    q = np.clip(np.rint(w / np.repeat(s16.astype(np.float32), group, axis=0)), -8, 7).astype(np.int64) + 8
    qw = np.zeros((k // 8, n), dtype=np.uint32)
    for j in range(8):
        qw |= (q[j::8].astype(np.uint32) << (4 * j))
    zeros = np.full((k // group, -(-n // 8)), 0x77777777, dtype=np.uint32)
    return {"qweight": (qw.view(np.int32), "I32"), "scales": (s16, "F16"), "qzeros": (zeros.view(np.int32), "I32"),
            "g_idx": ((np.arange(k) // group).astype(np.int32), "I32")}
