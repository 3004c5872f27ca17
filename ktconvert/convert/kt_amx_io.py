"""The work of one kt-amx unit: read one expert projection as float32, pack every part, return the group's bytes
(``numa.0.weight, numa.0.scale, numa.1.weight, ...``, the order :mod:`ktconvert.convert.kt_amx_plan` lays out)."""

from __future__ import annotations

import dataclasses

import numpy as np

from ktconvert.formats import kt_amx


def pack_group(ck, t, float_rows) -> np.ndarray:
    """Bytes of the group led by plan tensor ``t``; ``float_rows(ck, tensor, r0, r1)`` reads (and NaN-checks) rows."""
    method, proj, parts, rows, cols, nbytes = t.kt_pack
    m = kt_amx.method(method)
    mat = float_rows(ck, dataclasses.replace(t, shape=(rows, cols), kt_pack=None), 0, rows)
    out = np.empty(nbytes, dtype=np.uint8)
    pos = 0
    for w, s in kt_amx.pack_expert(mat, proj, m, parts):
        for a in (w, s):
            b = a.view(np.uint8)
            out[pos:pos + b.size] = b
            pos += b.size
    if pos != nbytes:
        raise AssertionError(f"{t.name}: packed {pos} bytes, plan says {nbytes}")
    return out
