"""kt-kernel's AMXINT8 / AMXINT4 expert format (``kt-amx``): packing (compiled), unpacking and dequantization.

kt-kernel's fastest CPU methods read per-row quantized, tile-packed experts from safetensors tensors named
``blk.L.ffn_{gate,up,down}_exps.E.numa.N.{weight,scale}``. Upstream can only make them by running the compiled
kernel over whole layers; this module computes the same bytes from one matrix at a time (numpy, and a numba
kernel for the packing itself: :mod:`ktconvert.quant._jit_kt_amx`), so a conversion needs neither kt-kernel nor
more memory than one expert. Every constant and rounding step below is
the kernel's (see ``docs/formats/kt-amx.md``): a packing that differs in one byte loads fine and gives
silently wrong output, so the tests compare against kt-kernel's own compiled packer byte for byte.

Per (layer, expert, projection, part):

* the part's matrix ``W`` (``n`` output rows by ``k`` inputs) holds bf16 values; gate/up part ``N`` is rows
  ``[N*I/P, (N+1)*I/P)`` of ``[I, H]``, down part ``N`` is columns ``[N*I/P, (N+1)*I/P)`` of ``[H, I]``;
* ``scale`` is one float32 per row: INT8 ``amax * fl32(1/127)``, INT4 ``fl32(amax / 112)``;
* ``q = rint(fl32(x * fl32(1/d)))`` saturated to int8; INT4 rounds ``q`` to a multiple of 16 (half away from
  zero) and keeps ``q/16`` as a 4-bit two's complement code;
* the bytes are laid out in 32-row x 64-byte tiles, row blocks (64 rows INT8, 128 INT4) outermost, then K blocks
  of 3584 columns, then 32-row groups, then tiles; INT4 puts column ``c`` in the low and ``c+64`` in the high
  nibble; every 16-row half tile is transposed as a 16 x 16 matrix of 4-byte words (the VNNI B-tile order).

The dequantized value of an entry is ``q * scale`` in float32 (INT4: ``q`` = code * 16).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ktconvert.errors import InputError

METHODS = ("AMXINT8", "AMXINT4")
PROJECTIONS = ("gate", "up", "down")
K_BLOCK = 3584  # columns per K block (both methods)
TILE_ROWS = 32
TILE_BYTES = 64  # bytes per tile row
_FLT_MIN = np.float32(np.finfo(np.float32).tiny)
_INV127 = np.float32(1) / np.float32(127)  # the float32 reciprocal the kernel multiplies by
_F112 = np.float32(112)

NAME_RE = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.(\d+)\.numa\.(\d+)\.(weight|scale)$")


@dataclass(frozen=True)
class Method:
    """Constants of one method: ``bits`` per weight, ``row_block`` rows per row block, ``k_align`` the column
    multiple a part's ``k`` must have (one tile's width in weights)."""

    name: str
    bits: int
    row_block: int
    k_align: int

    @property
    def tag(self) -> str:
        return "INT8" if self.bits == 8 else "INT4"

    def weight_bytes(self, n: int, k: int) -> int:
        return n * k * self.bits // 8


INT8 = Method("AMXINT8", 8, 64, 64)
INT4 = Method("AMXINT4", 4, 128, 128)


def method(name: str) -> Method:
    """``"AMXINT8"``/``"AMXINT4"`` (also ``int8``/``int4``, any case) -> :class:`Method`."""
    key = str(name).upper()
    key = {"INT8": "AMXINT8", "INT4": "AMXINT4"}.get(key, key)
    if key == "AMXINT8":
        return INT8
    if key == "AMXINT4":
        return INT4
    raise InputError(f"unknown kt-amx method {name!r}", fix="use AMXINT8 or AMXINT4")


def tensor_name(layer: int, proj: str, expert: int, part: int, kind: str) -> str:
    """``blk.L.ffn_{proj}_exps.E.numa.N.{weight|scale}``: the name kt-kernel's loader looks up."""
    return f"blk.{layer}.ffn_{proj}_exps.{expert}.numa.{part}.{kind}"


def part_shape(proj: str, hidden: int, inter: int, parts: int) -> tuple[int, int]:
    """``(n, k)`` of one part's matrix: gate/up ``[I/P, H]``, down ``[H, I/P]``."""
    ip = inter // parts
    return (hidden, ip) if proj == "down" else (ip, hidden)


def alignment_problem(m: Method, hidden: int, inter: int, parts: int) -> str | None:
    """Why ``H``/``I``/``P`` cannot be packed for method ``m`` (the kernel throws, or worse), or ``None``.

    Every part has ``n`` = one of ``H``, ``I/P`` and ``k`` = the other, so both must be multiples of 32 (row
    groups) and of the tile width (64 INT8, 128 INT4), and ``P`` must divide ``I``.
    """
    if parts < 1:
        return f"threadpool count {parts} must be at least 1"
    if inter % parts:
        return f"I={inter} is not divisible by the threadpool count {parts}"
    ip = inter // parts
    bad = [f"{what}={v}" for what, v in (("H", hidden), ("I/P", ip)) if v <= 0 or v % m.k_align]
    if bad:
        return (f"{' and '.join(bad)} not a multiple of {m.k_align}: {m.name} packs {m.k_align}-column tiles "
                f"(H and I/threadpool-count must both be multiples of {m.k_align})")
    return None


def check_alignment(m: Method, hidden: int, inter: int, parts: int, *, path: str | None = None,
                    where: str | None = None) -> None:
    """Raise :class:`InputError` (with what to do) when :func:`alignment_problem` finds one."""
    why = alignment_problem(m, hidden, inter, parts)
    if why is None:
        return
    ok = [p for p in (1, 2, 4, 8) if alignment_problem(m, hidden, inter, p) is None]
    other = INT8 if m is INT4 else INT4
    hints = []
    if ok and parts not in ok:
        hints.append(f"use --threadpool-count {ok[-1]}")
    if alignment_problem(other, hidden, inter, parts) is None:
        hints.append(f"use --type {other.name}")
    hints.append("or use a GGUF type (LLAMAFILE method) for this model")
    raise InputError(why, path=path, where=where, fix=", ".join(hints))


# --- quantization ------------------------------------------------------------------------------------------------


def to_bf16_f32(x: np.ndarray) -> np.ndarray:
    """float32 rounded to bf16 (nearest, ties to even, as torch's ``.to(torch.bfloat16)``) and back to float32:
    the values upstream's converter hands the kernel."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    r = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return r.view(np.float32)


def _flush(x: np.ndarray) -> np.ndarray:
    """Subnormals to zero: the kernel runs with FTZ/DAZ set."""
    return np.where(np.abs(x) < _FLT_MIN, np.float32(0), x).astype(np.float32, copy=False)


def quantize_rows(w: np.ndarray, m: Method) -> tuple[np.ndarray, np.ndarray]:
    """``(q, d)``: int8 values (INT4: multiples of 16) and float32 per-row scales of the bf16-valued ``w``.

    The kernel runs with flush-to-zero and denormals-are-zero: a subnormal scale is 0 (so is its row), and a
    subnormal input counts as 0. The latter can only change a code where ``1/d`` is huge, i.e. in rows whose
    amax is below 1e-30; only those rows are flushed (exactly what DAZ does, without a pass over every row).
    """
    x = np.asarray(w, dtype=np.float32)
    if x.shape[1] == 0:
        return np.zeros(x.shape, np.int8), np.zeros(x.shape[0], np.float32)
    amax = np.maximum(x.max(axis=1), -x.min(axis=1))
    d = _flush(amax * _INV127 if m.bits == 8 else amax / _F112)
    with np.errstate(divide="ignore"):
        r = np.where(d != 0, np.float32(1) / np.where(d != 0, d, np.float32(1)), np.float32(0)).astype(np.float32)
    small = amax < np.float32(1e-30)
    if small.any():
        x = x.copy()
        x[small] = _flush(x[small])
    y = x * r[:, None]
    np.rint(y, out=y)
    np.clip(y, -128, 127, out=y)
    if m.bits == 4:  # to a multiple of 16, half away from zero: (|q| + 8) & 0xF0, sign restored
        t = np.abs(y)
        t += 8
        t *= np.float32(1 / 16)
        np.floor(t, out=t)
        t *= 16
        np.copysign(t, y, out=y)
    return y.astype(np.int8), d.astype(np.float32)


def _untile(flat: np.ndarray, n: int, kbytes: int, nb: int, kb: int) -> np.ndarray:
    """Inverse of the packer's tile order (:mod:`ktconvert.quant._jit_kt_amx`; row blocks of ``nb`` rows, K blocks
    of ``kb`` bytes, 32-row groups, 64-byte tiles, half tiles word-transposed): the ``n x kbytes`` uint8 matrix."""
    src = np.asarray(flat).view(np.uint8).reshape(-1)
    b = np.empty((n, kbytes), dtype=np.uint8)
    full = n // nb * nb
    for r0, r1 in ((0, full), (full, n)):
        rows = r1 - r0
        if rows == 0:
            continue
        nbs = min(nb, rows)
        R = rows // nbs
        part = src[r0 * kbytes: r1 * kbytes].reshape(R, nbs * kbytes)
        dst = b[r0:r1].reshape(R, nbs, kbytes)
        for kb0 in range(0, kbytes, kb):
            kbs = min(kb, kbytes - kb0)
            s = part[:, kb0 * nbs:(kb0 + kbs) * nbs].reshape(R, nbs // 32, kbs // TILE_BYTES, 2, 16, 16, 4)
            dst[:, :, kb0:kb0 + kbs] = s.transpose(0, 1, 3, 5, 2, 4, 6).reshape(R, nbs, kbs)
    return b


def _unnibble(b: np.ndarray) -> np.ndarray:
    """Bytes -> INT4 values as int8 multiples of 16 (code * 16)."""
    n, kb = b.shape
    c = b.reshape(n, kb // 64, 64)
    lo = (c << np.uint8(4)).view(np.int8)
    hi = (c & np.uint8(0xF0)).view(np.int8)
    return np.stack([lo, hi], axis=2).reshape(n, kb * 2)


def pack_matrix(w: np.ndarray, m: Method) -> tuple[np.ndarray, np.ndarray]:
    """``(weight, scale)`` of one part: flat int8 packed bytes and float32 row scales, exactly as kt-kernel.

    ``w`` is ``n x k`` float32 holding bf16 values (round with :func:`to_bf16_f32` first); ``n % 32 == 0`` and
    ``k`` a multiple of the method's tile width (checked by the caller through :func:`check_alignment`).
    """
    return _pack(np.ascontiguousarray(w, dtype=np.float32), 0, 0, *w.shape, m)


def _pack(src: np.ndarray, r0: int, c0: int, n: int, k: int, m: Method, into: np.ndarray | None = None
          ) -> tuple[np.ndarray, np.ndarray] | None:
    """Rows ``r0..r0+n``, columns ``c0..c0+k`` of ``src`` (C-contiguous float32 holding bf16 values, or the bf16
    bits as uint16) packed by the compiled packer (:mod:`ktconvert.quant._jit_kt_amx`: the arithmetic of
    :func:`quantize_rows`, the layout :func:`unpack_matrix` inverts); ``None`` when a row holds a NaN or an
    infinity. ``into``: uint8 memory of the weight's and the scale's bytes end to end (the two arrays are views of
    it), else new arrays."""
    from ktconvert.quant._jit_kt_amx import pack_part

    if n % TILE_ROWS or k % m.k_align:
        raise ValueError(f"{m.name} cannot pack a {n} x {k} matrix (rows % 32, columns % {m.k_align})")
    wb = m.weight_bytes(n, k)
    if into is None:
        weight, scale = np.empty(wb, dtype=np.int8), np.empty(n, dtype=np.float32)
    else:
        weight, scale = into[:wb].view(np.int8), into[wb: wb + 4 * n].view(np.float32)
    bits, shift = (src, 16) if src.dtype == np.uint16 else (src.view(np.uint32), 0)
    if pack_part(bits, shift, r0, c0, n, k, m.bits, weight.view(np.uint32), scale) >= 0:
        return None
    return weight, scale


def unpack_matrix(weight: np.ndarray, n: int, k: int, m: Method) -> np.ndarray:
    """The ``n x k`` int8 values (INT4: code * 16) of one part's packed bytes."""
    if m.bits == 8:
        return _untile(weight, n, k, m.row_block, K_BLOCK).view(np.int8)
    return _unnibble(_untile(weight, n, k // 2, m.row_block, K_BLOCK // 2))


def dequantize_matrix(weight: np.ndarray, scale: np.ndarray, n: int, k: int, m: Method) -> np.ndarray:
    """float32 ``n x k``: ``q * scale`` row by row."""
    q = unpack_matrix(weight, n, k, m)
    return q.astype(np.float32) * np.asarray(scale, dtype=np.float32).reshape(n, 1)


def dequantize_values(w: np.ndarray, m: Method) -> np.ndarray:
    """What packing then dequantizing ``w`` (bf16-valued float32) gives, without the layout: for round-trip tests."""
    q, d = quantize_rows(w, m)
    return q.astype(np.float32) * d[:, None]


# --- whole experts -----------------------------------------------------------------------------------------------


def part_span(shape: tuple[int, int], proj: str, part: int, parts: int) -> tuple[int, int, int, int]:
    """Where part ``part`` of an expert's ``[I, H]`` (gate/up: rows) or ``[H, I]`` (down: columns) matrix is:
    ``(first row, first column, rows, columns)``."""
    rows, cols = shape
    if proj == "down":
        ip = cols // parts
        return 0, part * ip, rows, ip
    ip = rows // parts
    return part * ip, 0, ip, cols


def part_of(mat: np.ndarray, proj: str, part: int, parts: int) -> np.ndarray:
    """Part ``part`` of an expert's ``[I, H]`` (gate/up: rows) or ``[H, I]`` (down: columns) matrix."""
    r0, c0, n, k = part_span(mat.shape, proj, part, parts)
    return mat[r0:r0 + n, c0:c0 + k]


def pack_expert(mat: np.ndarray, proj: str, m: Method, parts: int, *, is_bf16: bool = False,
                into: np.ndarray | None = None) -> list[tuple[np.ndarray, np.ndarray]] | None:
    """``[(weight, scale)]`` per part of one expert's projection: float32 input, rounded to bf16 here unless
    ``is_bf16`` says its values already are bf16, or the stored bf16 bits (uint16: no float32 copy is made).
    ``None`` when the matrix holds a NaN or an infinity (the float32 path's reader reports where). ``into``: uint8
    memory the arrays are laid in, end to end in that order, as long as they are at least (a buffer reused from one
    expert to the next: no fresh pages per expert)."""
    if mat.dtype == np.uint16:
        x = np.ascontiguousarray(mat)
    else:
        x = np.ascontiguousarray(mat, dtype=np.float32) if is_bf16 else to_bf16_f32(mat)
    out, at = [], 0
    for p in range(parts):
        r0, c0, n, k = part_span(x.shape, proj, p, parts)
        packed = _pack(x, r0, c0, n, k, m, None if into is None else into[at:])
        if packed is None:
            return None
        at += packed[0].nbytes + packed[1].nbytes
        out.append(packed)
    return out


def unpack_expert(blobs: list[tuple[np.ndarray, np.ndarray]], proj: str, hidden: int, inter: int,
                  m: Method) -> np.ndarray:
    """Dequantized float32 ``[I, H]`` (gate/up) or ``[H, I]`` (down) from the parts' ``(weight, scale)``."""
    parts = len(blobs)
    n, k = part_shape(proj, hidden, inter, parts)
    mats = [dequantize_matrix(w, s, n, k, m) for w, s in blobs]
    return np.concatenate(mats, axis=1 if proj == "down" else 0)


class KtAmxName(NamedTuple):
    layer: int
    proj: str  # gate | up | down
    expert: int
    part: int  # numa part, one per threadpool
    kind: str  # weight | scale


def _num(s: str) -> bool:
    return s.isascii() and s.isdigit()


def parse_name(name: str) -> KtAmxName | None:
    """``(layer, proj, expert, part, kind)`` of a kt-amx tensor name (exactly :data:`NAME_RE`), else ``None``.
    Split, not the regex: a DeepSeek-V3-sized directory has 180k names and preflight must stay fast."""
    p = name.split(".")
    if len(p) != 7 or p[0] != "blk" or p[4] != "numa" or p[6] not in ("weight", "scale"):
        return None
    proj = p[2][4:-5] if p[2].startswith("ffn_") and p[2].endswith("_exps") else ""
    if proj not in PROJECTIONS or not (_num(p[1]) and _num(p[3]) and _num(p[5])):
        return None
    return KtAmxName(int(p[1]), proj, int(p[3]), int(p[5]), p[6])


__all__ = [
    "INT4", "INT8", "K_BLOCK", "KtAmxName", "METHODS", "Method", "PROJECTIONS", "alignment_problem", "check_alignment",
    "dequantize_matrix", "dequantize_values", "method", "pack_expert", "pack_matrix", "parse_name", "part_of",
    "part_shape", "quantize_rows", "tensor_name", "to_bf16_f32", "unpack_expert", "unpack_matrix",
]


def scan_dequantized(ck, name: str) -> np.ndarray | None:
    """One part's weight blob dequantized for ``inspect --scan``, its method told by its size against the scale
    lengths (a gate/up part's ``k`` is the down scale's length H, a down part's the gate scale's length I/P);
    ``None`` when the sizes fit no method (layout detection reports that)."""
    parsed = parse_name(name)
    if parsed is None:
        return None
    L, proj, e, part, _ = parsed
    other = tensor_name(L, "gate" if proj == "down" else "down", e, part, "scale")
    own = tensor_name(L, proj, e, part, "scale")
    try:
        n, k, size = ck[own].n_elements, ck[other].n_elements, ck[name].nbytes
    except KeyError:
        return None
    m = {8: INT8, 4: INT4}.get(size * 8 // (n * k) if n * k and (size * 8) % (n * k) == 0 else 0)
    if m is None or n % TILE_ROWS or k % m.k_align:
        return None
    return dequantize_matrix(ck.read(name), ck.read(own), n, k, m)
