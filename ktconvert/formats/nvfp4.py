"""NVFP4: E2M1 codes with an E4M3 scale per 16 input columns and a float32 per-tensor scale (Qwen3.5-MoE releases).

Two spellings, recognised from the tensor names:
- ModelOpt (what kt-kernel's NVFP4 method reads): ``X.weight`` U8 ``[N, K/2]``, ``X.weight_scale`` F8_E4M3
  ``[N, K/16]``, ``X.weight_scale_2`` F32 (one value). Value = ``e2m1 * fl32(e4m3 * scale_2)``.
- compressed-tensors ``nvfp4-pack-quantized``: ``X.weight_packed`` U8, ``X.weight_scale`` F8_E4M3,
  ``X.weight_global_scale`` F32 (one value, the reciprocal). Value = ``e2m1 * fl32(e4m3 / global_scale)``.
ModelOpt's W4A4 releases (``quant_algo`` NVFP4) also store ``X.input_scale`` F32 (one value), the static scale of the
activations a W4A4 kernel quantizes (compressed-tensors: ``X.input_global_scale``). It is read as a companion of its
weight (role ``activation``) and never used: the weight's values do not depend on it.
Both references fold the two scales first (one float32 rounding), then multiply by the code (a second rounding: the
float32 folded scale times a 2-bit value is not always exact). kt-kernel folds the same product but rounds it to
BF16 before the kernel uses it, so the kernel is not exact where the format is.
"""

from __future__ import annotations

import numpy as np

from ktconvert.formats.packed import E2M1, Packed, apply_groups, encode_e2m1, pack_nibbles, unpack_nibbles
from ktconvert.io.dtypes import decode_float32

FMT = "NVFP4"
GROUP = 16


def match(tensors: dict, name: str, read_small=None) -> Packed | None:
    if name.endswith(".weight"):
        base, glob, role = name, name + "_scale_2", "global"
    elif name.endswith(".weight_packed"):
        base, role = name[: -len("_packed")], "global_inv"
        glob = base + "_global_scale"
    else:
        return None
    sname = base + "_scale"
    w = tensors[name]
    if w.dtype != "U8" or len(w.shape) != 2 or sname not in tensors or tensors[sname].dtype != "F8_E4M3":
        return None
    n, k = w.shape[0], w.shape[1] * 2
    p = Packed(FMT, base, name, (n, k), GROUP, (("codes", name), ("scale", sname), (role, glob)))
    fix = "the scale belongs to another weight or release; re-download the checkpoint"
    s = tensors[sname]
    if glob not in tensors:
        return p.refused(name, f"NVFP4 weight has no per-tensor scale {glob}", "a shard is missing; re-download")
    if tensors[glob].dtype != "F32" or tensors[glob].n_elements != 1:
        return p.refused(glob, f"per-tensor scale is {tensors[glob].dtype} {list(tensors[glob].shape)}, "
                         "expected one F32", fix)
    act = base[: -len("weight")] + ("input_scale" if role == "global" else "input_global_scale")
    if act in tensors:
        p = Packed(FMT, base, name, (n, k), GROUP, (*p.parts, ("activation", act)))
        if tensors[act].dtype != "F32" or tensors[act].n_elements != 1:
            return p.refused(act, f"activation scale is {tensors[act].dtype} {list(tensors[act].shape)}, expected "
                             "one F32", fix)
    if k % GROUP:
        return p.refused(name, f"{k} input columns do not fit whole NVFP4 groups of {GROUP}", fix)
    if tuple(s.shape) != (n, k // GROUP):
        return p.refused(sname, f"scale shape {list(s.shape)} does not match weight {name} [{n}, {k} (packed {k // 2})]"
                         f": NVFP4 needs [{n}, {k // GROUP}]", fix)
    return p


def folded_scale(ck, p: Packed, r0: int, r1: int) -> np.ndarray:
    """The per-group float32 scale of rows ``r0..r1``: the E4M3 scale times (ModelOpt) or divided by
    (compressed-tensors) the per-tensor float32 scale, rounded once to float32."""
    s = decode_float32(np.asarray(ck.read(p.scale)[r0:r1]), "F8_E4M3")
    g = p.part("global")
    if g is not None:
        return s * np.float32(np.asarray(ck.read(g)).reshape(-1)[0])
    return s / np.float32(np.asarray(ck.read(p.part("global_inv"))).reshape(-1)[0])


def decode_rows(ck, p: Packed, r0: int, r1: int) -> np.ndarray:
    x = E2M1[unpack_nibbles(np.asarray(ck.read(p.stored)[r0:r1]))]
    return apply_groups(x, folded_scale(ck, p, r0, r1), GROUP)


def scale_values(ck, p: Packed) -> list[tuple[str, np.ndarray]]:
    gname = p.part("global") or p.part("global_inv")
    return [(p.scale, decode_float32(np.asarray(ck.read(p.scale)), "F8_E4M3")),
            (gname, np.asarray(ck.read(gname), dtype=np.float32).reshape(-1))]


def encode(x: np.ndarray, modelopt: bool = True) -> dict[str, tuple[np.ndarray, str]]:
    """float32 ``[N, K]`` -> stored tensors: per-tensor scale amax/(6*448), E4M3 group scales of amax/6 over it
    (ModelOpt's recipe), RNE E2M1 codes of x over the folded scale."""
    from ktconvert.formats.fp8 import encode_e4m3

    n, k = x.shape
    amax = float(np.abs(x).max()) or 1.0
    gscale = np.float32(amax / (6.0 * 448.0))
    g = np.abs(x).reshape(n, k // GROUP, GROUP).max(axis=2) / np.float32(6.0)
    g = np.where(g > 0, g, gscale)  # an all-zero group keeps a non-zero scale (its codes are 0)
    scodes = encode_e4m3((g / gscale).astype(np.float32))
    s = decode_float32(scodes, "F8_E4M3") * gscale
    safe = np.where(s > 0, s, np.float32(1))
    codes = encode_e2m1(x / np.repeat(safe, GROUP, axis=1))
    out = {("weight" if modelopt else "weight_packed"): (pack_nibbles(codes), "U8"), "weight_scale": (scodes, "F8_E4M3")}
    if modelopt:
        out["weight_scale_2"] = (np.array(gscale, dtype=np.float32), "F32")
    else:
        out["weight_global_scale"] = (np.array([1 / gscale], dtype=np.float32), "F32")
    return out
