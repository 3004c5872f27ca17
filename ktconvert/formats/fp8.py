"""FP8 block-scaled weights (DeepSeek-V3/R1, Kimi-K2, Qwen3-FP8, GLM-FP8 releases): recognition and exact
dequantization, without torch.

A release stores a weight ``W`` ``[N, K]`` as ``F8_E4M3`` codes plus ``W_scale_inv`` ``[ceil(N/bn), ceil(K/bk)]``
(F32 in DeepSeek's releases, BF16/F16 in Qwen3's), one scale per ``bn x bk`` block, the block size declared in
config.json's ``quantization_config.weight_block_size``. The value of an element is ``fp8(code) * scale`` of its
block, computed in float32 (one rounding: both factors are exact float32 numbers). A block cut short by the edge of
the matrix is still one block with its own scale. Everything here works on row ranges, so a caller never holds
more than the rows it asked for (plus the few scale rows covering them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ktconvert.diagnostics import ERROR, Diagnostic
from ktconvert.errors import InputError
from ktconvert.io.dtypes import decode_float32

FP8_DTYPE = "F8_E4M3"
SCALE_SUFFIX = "_scale_inv"
SCALE_DTYPES = ("F32", "BF16", "F16")
DEFAULT_BLOCK = (128, 128)
#: MXFP8 (MiniMax-M3): the same ``_scale_inv`` name, a UE8M0 exponent (F8_E8M0, or U8) per 1 x 32 block.
MX_SCALE_DTYPES = ("F8_E8M0", "U8")
MX_BLOCK = (1, 32)
#: FP8 per-channel (compressed-tensors float-quantized, GLM-4.7-FP8): ``NAME_scale`` ``[N, 1]`` or ``[N]``.
CHANNEL_SUFFIX = "_scale"


@dataclass(frozen=True)
class Fp8Weight:
    """One FP8 weight and its scale: ``shape`` is the logical ``[N, K]``, ``scale_shape`` the scale grid."""

    name: str
    scale: str
    shape: tuple[int, ...]
    scale_dtype: str
    scale_shape: tuple[int, ...]
    block: tuple[int, int]
    fmt: str = "FP8"  # FP8 (block-scaled), MXFP8 (UE8M0 scale per 1x32), FP8_PERCHANNEL (one scale per row)

    @property
    def group(self) -> int:
        return self.block[1]


def tensor_problem(tensor: str, message: str, fix: str) -> Diagnostic:
    """A tensor a release format cannot be read from (``where``), why, and the fix (every quantized format reports
    these: :class:`ktconvert.formats.quantized.QuantMap` ``problems``)."""
    return Diagnostic("", ERROR, message, fix, where=tensor)


@dataclass
class Fp8Map:
    """What a checkpoint holds in FP8: ``weights`` (weight name -> :class:`Fp8Weight`), ``scales`` (scale name ->
    weight name), the block size and where it came from, and the problems found (empty when usable)."""

    block: tuple[int, int]
    block_source: str
    weights: dict[str, Fp8Weight] = field(default_factory=dict)
    scales: dict[str, str] = field(default_factory=dict)
    problems: list[Diagnostic] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.weights or self.scales or self.problems)

    def summary(self) -> dict:
        dtypes: dict[str, int] = {}
        for w in self.weights.values():
            dtypes[w.scale_dtype] = dtypes.get(w.scale_dtype, 0) + 1
        return {"block": list(self.block), "block_source": self.block_source, "weights": len(self.weights),
                "scales": len(self.scales), "scale_dtypes": dtypes}


def quantization_config(config: dict | None) -> dict | None:
    """config.json's ``quantization_config`` (top level or inside ``text_config``), or ``None``."""
    if not isinstance(config, dict):
        return None
    for c in (config, config.get("text_config")):
        if isinstance(c, dict) and isinstance(c.get("quantization_config"), dict):
            return c["quantization_config"]
    return None


def block_size(config: dict | None, path: str | None = None) -> tuple[tuple[int, int], str]:
    """``((bn, bk), source)``: the declared ``weight_block_size``, or 128x128 (what every FP8 release uses and
    kt-kernel's FP8 method assumes) when the config declares none."""
    qc = quantization_config(config)
    if qc is None:
        return DEFAULT_BLOCK, "default (no quantization_config)"
    wbs = qc.get("weight_block_size")
    if wbs is None:
        return DEFAULT_BLOCK, f"default (quant_method {qc.get('quant_method')!r} declares no weight_block_size)"
    if (not isinstance(wbs, list) or len(wbs) != 2 or any(type(v) is not int or v <= 0 for v in wbs)):
        raise InputError(f"weight_block_size {wbs!r} is not two positive integers", path=path,
                         where="quantization_config.weight_block_size",
                         fix="FP8 releases declare [128, 128]; set it to the block the scales were made with")
    return (wbs[0], wbs[1]), "quantization_config.weight_block_size"


def scale_grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    return math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])


def analyze_fp8(ck, config: dict | None = None) -> Fp8Map:
    """Pair every FP8 weight of ``ck`` with its scale and check both against the block size; problems are listed,
    never raised (``inspect`` shows them all; :func:`require_fp8` turns the first into an error). Tensors read with
    a packed weight (``ck.packed_parts``: an NVFP4 E4M3 scale, an MXFP4 E8M0 scale) are not FP8 weights."""
    skip = getattr(ck, "packed_parts", frozenset())
    if ck.container != "safetensors" or not any((ck[n].dtype.startswith("F8_") or n.endswith(SCALE_SUFFIX))
                                                and n not in skip for n in ck):
        return Fp8Map(DEFAULT_BLOCK, "none (no FP8 tensors)")  # a config's quantization_config alone is not read
    if config is None:
        config = ck.config
    path = str(ck.config_path) if getattr(ck, "config_path", None) else str(ck.path)
    block, source = block_size(config, path)
    fm = Fp8Map(block, source)
    names = set(ck)
    for name in ck:
        info = ck[name]
        if name in skip:
            continue
        if info.dtype.startswith("F8_") and not name.endswith(SCALE_SUFFIX):
            scale = name + SCALE_SUFFIX
            if info.dtype != FP8_DTYPE:
                fm.problems.append(tensor_problem(name, f"{info.dtype} weights are not supported (only {FP8_DTYPE})",
                                              "convert from a BF16 or F8_E4M3 block-scaled release"))
                continue
            fmt, wblock = "FP8", block
            if scale not in names and name + CHANNEL_SUFFIX in names:
                scale = name + CHANNEL_SUFFIX
                sh = tuple(ck[scale].shape)
                if len(info.shape) == 2 and sh in ((info.shape[0], 1), (info.shape[0],)):
                    fmt, wblock = "FP8_PERCHANNEL", (1, info.shape[1])
            if scale not in names:
                fm.problems.append(tensor_problem(name, f"FP8 weight has no scale tensor {scale} (nor {name}"
                                              f"{CHANNEL_SUFFIX})", "a shard or the index is missing; re-download "
                                              "the checkpoint"))
                continue
            sinfo = ck[scale]
            fm.scales[scale] = name
            if len(info.shape) != 2:
                fm.problems.append(tensor_problem(name, f"FP8 weight of {len(info.shape)} dims {list(info.shape)}; "
                                              "only 2-D block-scaled matrices are supported",
                                              "convert from the per-expert (hf-split) release"))
                continue
            if scale.endswith(SCALE_SUFFIX) and sinfo.dtype in MX_SCALE_DTYPES:
                fmt, wblock = "MXFP8", MX_BLOCK
            elif sinfo.dtype not in SCALE_DTYPES:
                fm.problems.append(tensor_problem(scale, f"scale stored as {sinfo.dtype}, expected one of "
                                              f"{', '.join(SCALE_DTYPES + MX_SCALE_DTYPES)}",
                                              "re-download the checkpoint"))
                continue
            fm.weights[name] = Fp8Weight(name, scale, tuple(info.shape), sinfo.dtype, tuple(sinfo.shape), wblock, fmt)
        elif name.endswith(SCALE_SUFFIX):
            base = name[: -len(SCALE_SUFFIX)]
            if base not in names or not ck[base].dtype.startswith("F8_"):
                what = "does not exist" if base not in names else f"is {ck[base].dtype}, not FP8"
                fm.scales[name] = base
                fm.problems.append(tensor_problem(name, f"scale of {base}, which {what}",
                                              "the weights and scales come from different releases; re-download"))
    _check_shapes(fm)
    return fm


def _fits(w: Fp8Weight, block: tuple[int, int]) -> bool:
    if w.fmt == "FP8_PERCHANNEL":
        return True  # recognised from its [N, 1] / [N] shape
    if w.fmt == "MXFP8" and w.shape[1] % MX_BLOCK[1]:
        return False
    return len(w.scale_shape) == 2 and tuple(w.scale_shape) == scale_grid(w.shape, block)


def _check_shapes(fm: Fp8Map) -> None:
    for w in [w for w in fm.weights.values() if w.fmt == "MXFP8" and not _fits(w, MX_BLOCK)]:
        fm.problems.append(tensor_problem(
            w.scale, f"MXFP8 scale shape {list(w.scale_shape)} does not match weight {w.name} {list(w.shape)}: "
            f"groups of 32 need {list(scale_grid(w.shape, MX_BLOCK))}" + (" and K a multiple of 32"
                                                                          if w.shape[1] % 32 else ""),
            "the scale belongs to another weight or release; re-download the checkpoint"))
    wrong = [w for w in fm.weights.values() if w.fmt == "FP8" and not _fits(w, fm.block)]
    if not wrong:
        return
    declared = f"weight_block_size {list(fm.block)} ({fm.block_source})"
    if len(wrong) == sum(w.fmt == "FP8" for w in fm.weights.values()):  # every weight disagrees: the declared block is wrong, not the scales
        other = _block_from_scales(wrong)
        if other is not None:
            w = wrong[0]
            fm.problems.append(tensor_problem(
                w.name, f"{declared} does not fit the weights: {w.name} {list(w.shape)} has scales "
                f"{list(w.scale_shape)}, and every FP8 weight here fits a {list(other)} block",
                f"set quantization_config.weight_block_size to {list(other)} in config.json"))
            return
    for w in wrong:
        fm.problems.append(tensor_problem(
            w.scale, f"scale shape {list(w.scale_shape)} does not match weight {w.name} {list(w.shape)}: "
            f"{declared} needs {list(scale_grid(w.shape, fm.block)) if len(w.shape) == 2 else '?'}",
            "the scale belongs to another weight or release; re-download the checkpoint"))


def _block_from_scales(weights: list[Fp8Weight]) -> tuple[int, int] | None:
    """The block every weight's scale grid agrees with, if one exists: per axis, ``ceil(n / b) == g`` holds for
    ``b`` in ``[ceil(n / g), floor((n - 1) / (g - 1))]``; the intervals of all weights are intersected and a
    multiple of 16 preferred (what releases use)."""
    out = []
    for axis in (0, 1):
        lo, hi = 1, 1 << 62
        for w in weights:
            if len(w.scale_shape) != 2 or w.scale_shape[axis] < 1:
                return None
            n, g = w.shape[axis], w.scale_shape[axis]
            lo = max(lo, math.ceil(n / g))
            hi = min(hi, (n - 1) // (g - 1) if g > 1 else 1 << 62)
        if lo > hi:
            return None
        pick = next((b for b in range(math.ceil(lo / 16) * 16, min(hi, lo + 4096) + 1, 16)), lo)
        out.append(128 if lo <= 128 <= hi else pick)
    return out[0], out[1]


def require_fp8(ck, config: dict | None = None, path: str | None = None) -> Fp8Map:
    """:func:`analyze_fp8`, raising the first problem as :class:`InputError` (before anything is written)."""
    fm = analyze_fp8(ck, config)
    if fm.problems:
        raise InputError.first_of([(p.message, f"tensor {p.where}", p.fix) for p in fm.problems],
                                  path or str(ck.path), "FP8 ")
    return fm


# --- dequantization -------------------------------------------------------------------------------------------------


def dequantize(codes: np.ndarray, scale: np.ndarray, block: tuple[int, int], rows: np.ndarray | int = 0) -> np.ndarray:
    """Exact float32 values of FP8 rows. ``codes``: uint8 ``[n, K]``; ``scale``: float32 scale rows whose first row
    is the block of weight row ``rows`` (an int: ``n`` consecutive rows from there) or ``scale`` is the whole grid
    and ``rows`` the weight row of each code row (an int array, any order)."""
    bn, bk = block
    codes = np.asarray(codes)
    n, k = codes.shape
    x = decode_float32(codes, FP8_DTYPE)
    if bn == 1:  # one scale row per weight row (MXFP8, per-channel): one vectorized multiply
        sel = scale[: n] if isinstance(rows, (int, np.integer)) else scale[np.asarray(rows)]
        x *= np.repeat(sel.reshape(n, -1), bk, axis=1)[:, :k]
        return x
    if isinstance(rows, (int, np.integer)):
        first = int(rows)
        base = first // bn
        r = 0
        while r < n:  # one block row at a time: the expanded scale row is K floats, not n x K
            bi = (first + r) // bn
            end = min(n, (bi + 1) * bn - first)
            x[r:end] *= np.repeat(scale[bi - base], bk)[:k]
            r = end
        return x
    bidx = np.asarray(rows) // bn
    for bi in np.unique(bidx):
        sel = bidx == bi
        x[sel] *= np.repeat(scale[bi], bk)[:k]
    return x


def weight(ck, name: str, scale: str, block, fmt: str = "FP8") -> Fp8Weight:
    """The :class:`Fp8Weight` of ``name`` in ``ck`` (for callers holding only names, e.g. a plan's segment)."""
    return Fp8Weight(name, scale, tuple(ck[name].shape), ck[scale].dtype, tuple(ck[scale].shape), tuple(block), fmt)


def _scale_dtype(w: Fp8Weight) -> str:
    return "F8_E8M0" if w.scale_dtype in MX_SCALE_DTYPES else w.scale_dtype


def _scale_rows(ck, w: Fp8Weight, b0: int, b1: int) -> np.ndarray:
    return decode_float32(np.asarray(ck.read(w.scale)[b0:b1]), _scale_dtype(w)).reshape(b1 - b0, -1)


def read_rows(ck, w: Fp8Weight, r0: int, r1: int) -> np.ndarray:
    """Rows ``r0..r1`` of ``w`` dequantized to float32, reading only those codes and their scale rows."""
    bn = w.block[0]
    scale = _scale_rows(ck, w, r0 // bn, math.ceil(r1 / bn))
    return dequantize(ck.read(w.name)[r0:r1], scale, w.block, r0)


def read_row_ids(ck, w: Fp8Weight, ids: np.ndarray) -> np.ndarray:
    """The rows ``ids`` (any order) of ``w`` dequantized to float32."""
    scale = _scale_rows(ck, w, 0, w.scale_shape[0])
    return dequantize(np.asarray(ck.read(w.name))[ids], scale, w.block, np.asarray(ids))


def read_float32(ck, w: Fp8Weight) -> np.ndarray:
    """The whole weight dequantized (for callers that load whole tensors anyway: reference models, scans)."""
    return read_rows(ck, w, 0, w.shape[0])


def check_scale(ck, w: Fp8Weight) -> list[tuple[str, int]]:
    """``(kind, count)`` for the scale's bad values: ``nan``, ``inf``, ``zero`` (the block decodes to zeros
    whatever its codes) and ``negative`` (sign-flipped weights; a scale is a magnitude)."""
    s = decode_float32(np.asarray(ck.read(w.scale)), _scale_dtype(w))
    out = []
    for kind, mask in (("nan", np.isnan(s)), ("inf", np.isinf(s)), ("zero", s == 0), ("negative", s < 0)):
        c = int(np.count_nonzero(mask))
        if c:
            out.append((kind, c))
    return out


# --- quantization (tiny models, tests) ------------------------------------------------------------------------------


def quantize(x: np.ndarray, block: tuple[int, int], scale_dtype: str = "F32") -> tuple[np.ndarray, np.ndarray]:
    """float32 ``[N, K]`` -> (F8_E4M3 codes ``uint8``, float32 scale grid rounded to ``scale_dtype``'s precision):
    scale = amax/448 per block, codes the round-to-nearest-even E4M3 of ``x / scale`` (how the releases were made);
    for writing tiny FP8 models and test inputs, not on any conversion path."""
    n, k = x.shape
    bn, bk = block
    gn, gk = scale_grid(x.shape, block)
    pad = np.zeros((gn * bn, gk * bk), np.float32)
    pad[:n, :k] = x
    amax = np.abs(pad.reshape(gn, bn, gk, bk)).max(axis=(1, 3))
    scale = np.where(amax > 0, amax / np.float32(448.0), np.float32(1.0)).astype(np.float32)
    if scale_dtype == "BF16":
        scale = ((scale.view(np.uint32) + 0x7FFF + ((scale.view(np.uint32) >> 16) & 1)) & 0xFFFF0000).view(np.float32)
    elif scale_dtype == "F16":
        scale = scale.astype(np.float16).astype(np.float32)
    full = np.repeat(np.repeat(scale, bn, axis=0), bk, axis=1)[:n, :k]
    return encode_e4m3(x / full), scale


def encode_e4m3(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even float32 -> E4M3FN codes (saturating at ±448), by nearest value in the code table."""
    table = decode_float32(np.arange(256, dtype=np.uint8), FP8_DTYPE)
    pos = np.arange(0, 0x7F, dtype=np.uint8)  # non-negative finite codes, ascending values
    vals = table[pos].astype(np.float64)
    a = np.minimum(np.abs(x.astype(np.float64)), 448.0)
    i = np.clip(np.searchsorted(vals, a), 1, len(vals) - 1)
    lo, hi = vals[i - 1], vals[i]
    pick_hi = (a - lo > hi - a) | ((a - lo == hi - a) & (pos[i] % 2 == 0))
    code = np.where(pick_hi, pos[i], pos[i - 1]).astype(np.uint8)
    code = np.where(a <= 0, 0, code).astype(np.uint8)
    return np.where(np.signbit(x) & (code != 0), code | 0x80, code).astype(np.uint8)


def to_bits(scale: np.ndarray, dtype: str) -> np.ndarray:
    """Scale grid as stored: F32 as is, BF16 as its upper 16 bits (exact after :func:`quantize`), F16 as float16."""
    if dtype == "F32":
        return scale.astype(np.float32)
    if dtype == "BF16":
        return (scale.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return scale.astype(np.float16)
