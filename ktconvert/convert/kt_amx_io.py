"""The work of one kt-amx unit: read one expert projection as float32, pack every part, return the group's bytes
(``numa.0.weight, numa.0.scale, numa.1.weight, ...``, the order :mod:`ktconvert.convert.kt_amx_plan` lays out)."""

from __future__ import annotations

import dataclasses

import numpy as np

from ktconvert.formats import kt_amx
from ktconvert.convert.items import Item, Segment
from ktconvert.errors import InputError


def pack_group(ck, t, float_rows, bf16_rows=None, into: np.ndarray | None = None) -> list[np.ndarray]:
    """The group led by plan tensor ``t`` as its parts' arrays in file order (``weight, scale`` per part), to be
    written end to end; ``float_rows(ck, tensor, r0, r1)`` reads (and NaN-checks) rows as float32;
    ``bf16_rows(ck, tensor, r0, r1)``, when given, reads them as their stored bf16 bits where the source is plain
    BF16 rows (``None`` otherwise), which the packer reads directly: no float32 copy of the matrix. ``into``: uint8
    memory of at least the group's bytes the arrays are laid in, one after the other (else new arrays)."""
    method, proj, parts, rows, cols, nbytes = t.kt_pack
    m = kt_amx.method(method)
    whole = dataclasses.replace(t, shape=(rows, cols), kt_pack=None)
    packed = None
    if bf16_rows is not None and not any(seg.lora for seg in t.segments):
        bits = bf16_rows(ck, whole, 0, rows)
        packed = kt_amx.pack_expert(bits, proj, m, parts, into=into) if bits is not None else None
    if packed is None:  # another source, or a NaN/Inf: the float32 reader reports where
        mat = float_rows(ck, whole, 0, rows)
        merged = any(seg.lora for seg in t.segments)  # a merged LoRA leaves bf16 values: round them as upstream would
        packed = kt_amx.pack_expert(mat, proj, m, parts, is_bf16=t.src_dtype == "BF16" and not merged, into=into)
    out = [a for pair in packed for a in pair]
    if sum(a.nbytes for a in out) != nbytes:
        raise AssertionError(f"{t.name}: packed {sum(a.nbytes for a in out)} bytes, plan says {nbytes}")
    return out


# --- kt-amx as input ---------------------------------------------------------------------------------------------


def expert_items(ly, nm) -> list:
    """A kt-amx layer's experts as the stacked llama.cpp-order items every other layout becomes: one segment per
    expert (all its parts), decoded by :func:`dequant_rows`."""

    L, E, I, H, P, method = ly.layer, ly.n_experts, ly.intermediate, ly.hidden, ly.numa_parts, ly.quant
    out = []
    for p in kt_amx.PROJECTIONS:
        rows, cols = (H, I) if p == "down" else (I, H)
        segs = tuple(Segment(e * rows, rows, kt_amx.tensor_name(L, p, e, 0, "weight"), op="kt-amx", parts=P,
                             method=method) for e in range(E))
        out.append(Item(nm.expert_name("gguf-merged", p, L), nm.expert_name("hf-split", p, L, expert="*"),
                        (E, rows, cols), segs, method, "experts", L, p))
    return out


def _part(ck, name: str, m: kt_amx.Method) -> tuple[np.ndarray, np.ndarray, int, int]:
    """``(weight, scale, n, k)`` of one part, sizes checked against each other."""

    scale_name = name[: -len("weight")] + "scale"
    w, s = ck.read(name), ck.read(scale_name)
    n = s.size
    if n == 0 or (w.size * 8) % (m.bits * n):
        raise InputError(f"{w.size} weight bytes cannot hold {n} rows of {m.name}", where=f"tensor {name}",
                         fix=f"its scale {scale_name} and weight disagree; reconvert this expert")
    k = w.size * 8 // (m.bits * n)
    bad = np.flatnonzero(~np.isfinite(s))
    if bad.size:
        raise InputError(f"non-finite scale {s[bad[0]]} at row {int(bad[0])} ({bad.size} in all)",
                         where=f"tensor {scale_name}",
                         fix="the directory is corrupt; reconvert this layer from the original checkpoint")
    return w, s, n, k


def dequant_rows(ck, seg, first: int, count: int) -> np.ndarray:
    """Rows ``first .. first+count`` (within the segment) of one kt-amx expert projection, dequantized to float32."""
    L, proj, e, _, _ = kt_amx.parse_name(seg.source)
    m = kt_amx.method(seg.method)
    lo, hi = seg.src_row + first, seg.src_row + first + count
    names = [kt_amx.tensor_name(L, proj, e, n, "weight") for n in range(seg.parts)]
    if proj == "down":  # every part holds all H rows (a band of columns)
        mats = []
        for name in names:
            w, s, n, k = _part(ck, name, m)
            mats.append(kt_amx.dequantize_matrix(w, s, n, k, m)[lo:hi])
        return np.concatenate(mats, axis=1)
    out, row0 = [], 0
    for name in names:
        w, s, n, k = _part(ck, name, m)
        a, b = max(lo, row0), min(hi, row0 + n)
        if a < b:
            out.append(kt_amx.dequantize_matrix(w, s, n, k, m)[a - row0:b - row0])
        row0 += n
    return np.concatenate(out, axis=0)


def nonexpert_item(name: str, nm, ck):
    """An Item for a non-expert tensor as upstream's converter copies it into a kt-amx directory (``model.layers.``
    -> ``blk.``, other ``model.`` stripped), or ``None`` when no naming map knows it under its HF name."""

    if name.startswith("blk."):
        hf = "model.layers." + name[len("blk."):]
    elif name.startswith("lm_head."):
        hf = name
    else:
        hf = "model." + name
    mt = nm.lookup(hf)
    if mt is None or mt.group in ("experts", "expert_scales"):
        return None
    info = ck[name]
    shape = tuple(info.shape or (1,))
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    return Item(mt.gguf_name, mt.hf_name, shape, (Segment(0, rows, name),), info.dtype, mt.group, mt.layer)
