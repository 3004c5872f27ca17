"""MXFP4 (OCP microscaling FP4) as DeepSeek-V4-Flash ships its experts and kt-kernel's MXFP4 method reads them.

``X.weight`` I8 (or U8) ``[N, K/2]``: E2M1 codes, two per byte, the low nibble first; ``X.scale`` F8_E8M0 (or U8)
``[N, K/32]``: one power-of-two scale ``2**(e - 127)`` per 32 input columns. Value = ``e2m1(code) * scale``, exact in
float32 (a 2-significant-bit value times a power of two; code 0 of the scale is 2**-127, a float32 subnormal).
gpt-oss's fused ``*_blocks``/``*_scales`` tensors (the same codes and scales, every expert of a layer stacked) are
:mod:`ktconvert.formats.mxfp4_fused`.
"""

from __future__ import annotations

import numpy as np

from ktconvert.formats.packed import E2M1, Packed, apply_groups, encode_e2m1, pack_nibbles, unpack_nibbles
from ktconvert.io.dtypes import decode_float32

FMT = "MXFP4"
GROUP = 32
CODE_DTYPES = ("I8", "U8")
SCALE_DTYPES = ("F8_E8M0", "U8")
_FIX = "the scale belongs to another weight or release; re-download the checkpoint"


def match(tensors: dict, name: str, read_small=None) -> Packed | None:
    """``name`` is an MXFP4 weight when it is 2-D I8/U8 and ``NAME[:-len('weight')] + 'scale'`` exists beside it."""
    if not name.endswith(".weight") or tensors[name].dtype not in CODE_DTYPES or len(tensors[name].shape) != 2:
        return None
    sname = name[: -len("weight")] + "scale"
    if sname not in tensors:
        return None
    w, s = tensors[name], tensors[sname]
    n, k = w.shape[0], w.shape[1] * 2
    parts = (("codes", name), ("scale", sname))
    p = Packed(FMT, name, name, (n, k), GROUP, parts)
    if s.dtype not in SCALE_DTYPES:
        return p.refused(sname, f"MXFP4 scale stored as {s.dtype}, expected F8_E8M0 (UE8M0 exponents)", _FIX)
    if k % GROUP:
        return p.refused(name, f"{k} input columns do not fit whole MXFP4 groups of {GROUP}", _FIX)
    if tuple(s.shape) != (n, k // GROUP):
        return p.refused(sname, f"scale shape {list(s.shape)} does not match weight {name} "
                         f"[{n}, {k} (packed {k // 2})]: MXFP4 needs [{n}, {k // GROUP}]", _FIX)
    return p


def scale_float32(raw: np.ndarray) -> np.ndarray:
    return decode_float32(np.asarray(raw, dtype=np.uint8), "F8_E8M0")


def decode_rows(ck, p: Packed, r0: int, r1: int) -> np.ndarray:
    x = E2M1[unpack_nibbles(np.asarray(ck.read(p.stored)[r0:r1]).view(np.uint8))]
    return apply_groups(x, scale_float32(ck.read(p.scale)[r0:r1]), GROUP)


def scale_values(ck, p: Packed) -> list[tuple[str, np.ndarray]]:
    return [(p.scale, scale_float32(ck.read(p.scale)))]


def encode(x: np.ndarray) -> dict[str, tuple[np.ndarray, str]]:
    """float32 ``[N, K]`` -> the stored tensors (suffix -> (array, dtype)): the scale exponent of each group is
    ``floor(log2(amax)) - 2`` (OCP's rule: the group's largest value lands in E2M1's top binade), codes RNE."""
    n, k = x.shape
    g = np.abs(x).reshape(n, k // GROUP, GROUP).max(axis=2)
    e = np.where(g > 0, np.floor(np.log2(np.where(g > 0, g, 1))) - 2, -127)
    e = np.clip(e, -127, 127).astype(np.int32)
    scale = np.ldexp(np.float32(1), e).astype(np.float32)
    codes = encode_e2m1(x / np.repeat(scale, GROUP, axis=1))
    return {"weight": (pack_nibbles(codes).view(np.int8), "I8"), "scale": ((e + 127).astype(np.uint8), "F8_E8M0")}
