"""Packed release formats (MXFP4, NVFP4, RAWINT4, GPTQ INT4): the record every format module fills in, and the
helpers they share (nibble unpacking, group expansion).

A packed weight is stored under another name or shape than the matrix it means (``X.weight_packed`` int32
``[N, K/8]``, ``X.qweight`` ``[K/8, N]``, ``X.weight`` int8 ``[N, K/2]``...). Its format module recognises it from
the tensor names, dtypes and shapes alone (:func:`match`), so the checkpoint can present the *logical* matrix
``X.weight`` ``[N, K]`` to layout detection, inspect and conversion; its codes and scales are read and decoded
together (:func:`ktconvert.formats.quantized.read_rows`). A malformed group of tensors is still recognised, with
a ``problem`` naming the tensor at fault, and left unpresented: inspect lists it, conversion refuses it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np


@dataclass(frozen=True)
class Packed:
    """One packed weight. ``name``: the logical weight (``X.weight``), ``shape`` its ``[N, K]`` (output rows, input
    columns); ``stored``: the tensor holding the codes; ``parts``: (role, tensor name) of every tensor read with it
    (``codes``, ``scale``, ``global``, ``zeros``, ``shape``, ``g_idx``); ``group``: input columns per scale."""

    fmt: str
    name: str
    stored: str
    shape: tuple[int, int]
    group: int
    parts: tuple[tuple[str, str], ...]
    problem: str = ""
    problem_tensor: str = ""
    fix: str = ""

    def part(self, role: str) -> str | None:
        return next((n for r, n in self.parts if r == role), None)

    def refused(self, tensor: str, msg: str, fix: str) -> "Packed":
        """This weight, recognised but unusable: ``msg`` about ``tensor`` (reported before anything is written)."""
        return replace(self, problem=msg, problem_tensor=tensor, fix=fix)

    @property
    def scale(self) -> str:
        return self.part("scale") or ""

    @property
    def companions(self) -> tuple[str, ...]:
        return tuple(n for r, n in self.parts if n != self.name)


def unpack_nibbles(raw: np.ndarray) -> np.ndarray:
    """uint8 ``[n, m]`` -> uint8 codes ``[n, 2m]``, the low nibble first (element ``2j`` is byte ``j``'s bits 0-3):
    the order of MXFP4, NVFP4 and compressed-tensors' int32 packing read as little-endian bytes."""
    raw = np.asarray(raw, dtype=np.uint8)
    out = np.empty((raw.shape[0], raw.shape[1] * 2), dtype=np.uint8)
    out[:, 0::2] = raw & 0x0F
    out[:, 1::2] = raw >> 4
    return out


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """The inverse of :func:`unpack_nibbles` (codes ``[n, 2m]`` in 0..15)."""
    codes = np.asarray(codes, dtype=np.uint8)
    return (codes[:, 0::2] & 0x0F) | ((codes[:, 1::2] & 0x0F) << 4)


def apply_groups(x: np.ndarray, scale: np.ndarray, group: int) -> np.ndarray:
    """``x[r, c] *= scale[r, c // group]`` in float32 (one rounding per element), in place; returns ``x``."""
    k = x.shape[1]
    x *= np.repeat(scale, group, axis=1)[:, :k]
    return x


# E2M1 (FP4) code -> value: sign bit 3, exponent bits 2-1, mantissa bit 0; the same in MXFP4 and NVFP4.
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                dtype=np.float32)


def encode_e2m1(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even float32 -> E2M1 codes (saturating at ±6), for writing tiny releases."""
    vals = E2M1[:8].astype(np.float64)
    a = np.minimum(np.abs(x.astype(np.float64)), 6.0)
    i = np.clip(np.searchsorted(vals, a), 1, 7)
    lo, hi = vals[i - 1], vals[i]
    pick_hi = (a - lo > hi - a) | ((a - lo == hi - a) & (i % 2 == 0))
    code = np.where(pick_hi, i, i - 1).astype(np.uint8)
    return np.where(np.signbit(x) & (code != 0), code | 8, code).astype(np.uint8)
