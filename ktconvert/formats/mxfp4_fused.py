"""MXFP4 fused experts, as gpt-oss releases (openai/gpt-oss-20b, -120b) ship them: one pair of tensors per expert
matrix of a layer, every expert stacked, stored output-major.

``X_blocks`` U8 ``[E, out, in/32, 16]``: E2M1 codes, two per byte, the low nibble first (32 codes per block);
``X_scales`` U8 (or F8_E8M0) ``[E, out, in/32]``: one UE8M0 exponent per block, ``2**(e - 127)``. Value =
``e2m1(code) * 2**(e - 127)``, exact in float32: the codes and scales of :mod:`ktconvert.formats.mxfp4`, 3-D.

The logical weight is ``X`` (the name without ``_blocks``) ``[E, in, out]``: the stored matrices transposed, which is
what transformers 5.23 dequantizes them to (``convert_moe_packed_tensors``) and the orientation the rest of
ktconvert reads fused experts in (gpt-oss' ``gate_up_proj [E, H, 2I]``, gate at even and up at odd columns, and
``down_proj [E, I, H]``). The orientation is the format's, never guessed from shapes. ``decode_rows`` reads flat
logical rows (``[E * in, out]``); ``decode_cols`` reads columns of one expert's slab, i.e. stored rows, which is
how conversion splits gate from up and transposes into llama.cpp's ``[E, out, in]`` without a transpose.
"""

from __future__ import annotations

import numpy as np

from ktconvert.formats.mxfp4 import GROUP, SCALE_DTYPES, encode as encode_2d, scale_float32
from ktconvert.formats.packed import E2M1, Packed, apply_groups, unpack_nibbles

FMT = "MXFP4_FUSED"
BLOCK_BYTES = GROUP // 2
FIX = "the scales belong to another tensor or release; re-download the checkpoint"
_TILE = 256  # stored rows decoded and transposed together by decode_rows (cache-sized pieces: 3-4x faster)


def match(tensors: dict, name: str, read_small=None) -> Packed | None:
    """``name`` is a fused MXFP4 weight when it is U8 and ends ``_blocks``, with ``NAME[:-7] + '_scales'`` beside."""
    if not name.endswith("_blocks") or tensors[name].dtype != "U8":
        return None
    base = name[: -len("_blocks")]
    sname = base + "_scales"
    b = tensors[name]
    shape = tuple(b.shape)
    ok = len(shape) == 4 and shape[3] == BLOCK_BYTES
    logical = (shape[0], shape[2] * GROUP, shape[1]) if ok else (0, 0, 0)
    p = Packed(FMT, base, name, logical, GROUP, (("codes", name), ("scale", sname)))
    if base in tensors:
        return p.refused(base, f"stored twice: as {base} and as MXFP4 blocks {name}",
                         "keep one of them (a dequantized copy saved beside the release?)")
    if sname not in tensors:
        return p.refused(name, f"MXFP4 blocks without their scales {sname}",
                         "a shard or the index is missing; re-download the checkpoint")
    if not ok:
        return p.refused(name, f"MXFP4 blocks shape {list(shape)}: expected [experts, rows, in/{GROUP}, "
                         f"{BLOCK_BYTES}] ({GROUP} codes, two per byte, per block)", FIX)
    s = tensors[sname]
    if s.dtype not in SCALE_DTYPES:
        return p.refused(sname, f"MXFP4 scales stored as {s.dtype}, expected U8 (UE8M0 exponents)", FIX)
    if tuple(s.shape) != shape[:3]:
        return p.refused(sname, f"scales shape {list(s.shape)} does not match blocks {name} {list(shape)}: "
                         f"MXFP4 needs {list(shape[:3])}", FIX)
    return p


def _decode_stored(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Stored ``[n, g, 16]`` blocks and ``[n, g]`` exponents -> float32 ``[n, 32 g]`` (stored orientation)."""
    n, g = scales.shape
    codes = unpack_nibbles(np.ascontiguousarray(blocks).reshape(n, g * BLOCK_BYTES))
    return apply_groups(E2M1[codes], scale_float32(scales), GROUP)


def decode_cols(ck, p: Packed, expert: int, c0: int, c1: int, step: int = 1) -> np.ndarray:
    """Columns ``c0:c1:step`` of expert ``expert``'s logical ``[in, out]`` slab, as rows ``[n, in]``: stored rows."""
    blocks = np.asarray(ck.read(p.stored)[expert, c0:c1:step])
    return _decode_stored(blocks, np.asarray(ck.read(p.scale)[expert, c0:c1:step]))


def decode_rows(ck, p: Packed, r0: int, r1: int) -> np.ndarray:
    """Flat logical rows ``r0..r1`` of ``[E * in, out]``: per expert, the stored blocks holding those input columns
    (whole groups of 32), decoded and transposed."""
    _, k, n = p.shape
    out = np.empty((r1 - r0, n), dtype=np.float32)
    r = r0
    while r < r1:
        e, a = divmod(r, k)
        b = min(k, a + (r1 - r))
        g0, g1 = a // GROUP, -(-b // GROUP)
        dst = out[r - r0: r - r0 + b - a]
        for s0 in range(0, n, _TILE):  # a tile of stored rows at a time: decoded, then its columns transposed in
            s1 = min(n, s0 + _TILE)
            x = _decode_stored(np.asarray(ck.read(p.stored)[e, s0:s1, g0:g1]),
                               np.asarray(ck.read(p.scale)[e, s0:s1, g0:g1]))
            dst[:, s0:s1] = x[:, a - g0 * GROUP: b - g0 * GROUP].T
        r += b - a
    return out


def scale_values(ck, p: Packed) -> list[tuple[str, np.ndarray]]:
    return [(p.scale, scale_float32(np.asarray(ck.read(p.scale))))]


def encode(x: np.ndarray) -> dict[str, tuple[np.ndarray, str]]:
    """float32 logical ``[E, in, out]`` -> ``{"blocks", "scales"}`` stored as the release does (U8 both), with
    :func:`ktconvert.formats.mxfp4.encode`'s rule per stored row."""
    e, k, n = x.shape
    parts = encode_2d(np.ascontiguousarray(x.transpose(0, 2, 1)).reshape(e * n, k))
    codes, scales = parts["weight"][0], parts["scale"][0]
    return {"blocks": (codes.view(np.uint8).reshape(e, n, k // GROUP, BLOCK_BYTES), "U8"),
            "scales": (scales.reshape(e, n, k // GROUP), "U8")}
