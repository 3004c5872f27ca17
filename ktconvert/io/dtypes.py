"""Storage types of both containers, and decoding them to float32 without torch.

Safetensors names its dtypes with strings (``"BF16"``, ``"F8_E4M3"``); GGUF with ggml type ids. Numpy has no
bfloat16, float8 or float4/6, so those are handed out as raw bits (``uint16`` for BF16, ``uint8`` otherwise) and
tagged by name; :func:`decode_float32` turns any of them into float32 when a caller really needs numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants


@dataclass(frozen=True)
class SafetensorsDtype:
    """One safetensors dtype: its size in bits, the numpy dtype of a raw view, and whether numpy knows it natively."""

    name: str
    bits: int
    raw: np.dtype  # dtype of the array read() hands out
    native: bool  # True when ``raw`` *is* the value type (not just its bits)
    is_float: bool


def _st(name: str, bits: int, raw: str, native: bool, is_float: bool) -> SafetensorsDtype:
    return SafetensorsDtype(name, bits, np.dtype(raw), native, is_float)


SAFETENSORS_DTYPES: dict[str, SafetensorsDtype] = {
    d.name: d
    for d in (
        _st("BOOL", 8, "bool", True, False),
        _st("U8", 8, "<u1", True, False),
        _st("I8", 8, "<i1", True, False),
        _st("U16", 16, "<u2", True, False),
        _st("I16", 16, "<i2", True, False),
        _st("U32", 32, "<u4", True, False),
        _st("I32", 32, "<i4", True, False),
        _st("U64", 64, "<u8", True, False),
        _st("I64", 64, "<i8", True, False),
        _st("F16", 16, "<f2", True, True),
        _st("F32", 32, "<f4", True, True),
        _st("F64", 64, "<f8", True, True),
        _st("C64", 64, "<c8", True, False),
        _st("BF16", 16, "<u2", False, True),
        _st("F8_E4M3", 8, "<u1", False, True),
        _st("F8_E5M2", 8, "<u1", False, True),
        _st("F8_E4M3FNUZ", 8, "<u1", False, True),
        _st("F8_E5M2FNUZ", 8, "<u1", False, True),
        _st("F8_E8M0", 8, "<u1", False, True),
        # Sub-byte types are packed; they are handed out as a flat byte array.
        _st("F4", 4, "<u1", False, True),
        _st("F6_E2M3", 6, "<u1", False, True),
        _st("F6_E3M2", 6, "<u1", False, True),
    )
}

FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")
#: Safetensors integer dtypes of index tables (DeepSeek-V4's tid2eid), which a GGUF stores as llama.cpp's I32
INT_DTYPES = ("I8", "U8", "I16", "U16", "I32", "U32", "I64", "U64")
"""Safetensors float dtypes every reader decodes exactly (float8/4/6 need their format's scales first)."""

DTYPE_BYTES: dict[str, int] = {d.name: d.bits // 8 for d in SAFETENSORS_DTYPES.values() if d.bits % 8 == 0}

# torch's names for the safetensors dtypes torch computes in (by name, so this module stays torch-free)
TORCH_NAMES: dict[str, str] = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64",
                               "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
COMPUTE_DTYPES = ("F32", "F16", "BF16", "F64")  # what the reference model can compute in


def st_dtype_of(dtype: np.dtype) -> str:
    """The safetensors name of a numpy dtype that is its own value type (little-endian)."""
    dt = np.dtype(dtype).newbyteorder("<") if np.dtype(dtype).byteorder == ">" else np.dtype(dtype)
    for d in SAFETENSORS_DTYPES.values():
        if d.native and d.raw == dt:
            return d.name
    raise ValueError(f"numpy dtype {dtype} has no safetensors name")


def raw_view(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Bytes (or any view) of safetensors data seen as the raw element dtype ``read()`` hands out."""
    return np.asarray(raw).view(SAFETENSORS_DTYPES[dtype].raw)


# ggml types whose data numpy can view with a real element dtype (everything else is bytes, or BF16 bits).
_GGML_NATIVE = {
    GGMLQuantizationType.F32: np.dtype("<f4"),
    GGMLQuantizationType.F16: np.dtype("<f2"),
    GGMLQuantizationType.F64: np.dtype("<f8"),
    GGMLQuantizationType.I8: np.dtype("<i1"),
    GGMLQuantizationType.I16: np.dtype("<i2"),
    GGMLQuantizationType.I32: np.dtype("<i4"),
    GGMLQuantizationType.I64: np.dtype("<i8"),
    GGMLQuantizationType.BF16: np.dtype("<u2"),  # raw bits, like safetensors BF16
}


def ggml_type_name(type_id: int) -> str:
    return GGMLQuantizationType(type_id).name


def ggml_block(type_id: int) -> tuple[int, int]:
    """``(elements per block, bytes per block)`` of a ggml type."""
    return GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]


def ggml_is_known(type_id: int) -> bool:
    try:
        return GGMLQuantizationType(type_id) in GGML_QUANT_SIZES
    except ValueError:
        return False


def ggml_nbytes(ne: tuple[int, ...], type_id: int) -> int:
    block, size = ggml_block(type_id)
    n = 1
    for d in ne:
        n *= d
    return n // block * size


def ggml_view_dtype_and_shape(ne: tuple[int, ...], type_id: int) -> tuple[np.dtype, tuple[int, ...]]:
    """How a GGUF tensor's bytes are viewed: element dtype and numpy shape, or bytes with the last axis in bytes."""
    np_shape = tuple(reversed(ne))
    native = _GGML_NATIVE.get(GGMLQuantizationType(type_id))
    if native is not None:
        return native, np_shape
    block, size = ggml_block(type_id)
    if not np_shape:
        return np.dtype("<u1"), ()
    return np.dtype("<u1"), (*np_shape[:-1], np_shape[-1] // block * size)


# --- minifloat decoding -------------------------------------------------------------------------------------------


@lru_cache(maxsize=None)
def _minifloat_table(name: str) -> np.ndarray:
    """float32 value of every 8-bit code of a float8 format (the formats differ only in bias and special codes)."""
    codes = np.arange(256, dtype=np.int64)
    if name == "F8_E8M0":  # unsigned power of two; 0xFF is NaN
        out = np.full(256, np.nan, dtype=np.float32)
        out[:255] = np.ldexp(np.ones(255), (codes[:255] - 127).astype(np.int32))
        return out
    exp_bits, man_bits, bias = {
        "F8_E4M3": (4, 3, 7),
        "F8_E5M2": (5, 2, 15),
        "F8_E4M3FNUZ": (4, 3, 8),
        "F8_E5M2FNUZ": (5, 2, 16),
    }[name]
    sign = np.where(codes >> 7, -1.0, 1.0)
    exp = (codes >> man_bits) & ((1 << exp_bits) - 1)
    man = codes & ((1 << man_bits) - 1)
    frac = man / float(1 << man_bits)
    val = np.where(exp == 0, frac * 2.0 ** (1 - bias), (1.0 + frac) * np.exp2(exp - bias))
    out = (sign * val).astype(np.float32)
    max_exp = (1 << exp_bits) - 1
    if name == "F8_E5M2":  # IEEE-like: all-ones exponent is Inf (mantissa 0) or NaN
        out[(exp == max_exp) & (man == 0)] = np.copysign(np.inf, sign[(exp == max_exp) & (man == 0)])
        out[(exp == max_exp) & (man != 0)] = np.nan
    elif name == "F8_E4M3":  # "FN": no Inf; only S.1111.111 is NaN
        out[(exp == max_exp) & (man == (1 << man_bits) - 1)] = np.nan
    else:  # "FNUZ": no Inf, no negative zero; 0x80 is the single NaN
        out[0x80] = np.nan
    return out


def decode_float32(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Decode raw safetensors data of a float dtype (or any native numeric dtype) to a float32 copy.

    Sub-byte types (F4, F6_*) are not decoded: they have no single element layout and raise ``ValueError``.
    """
    info = SAFETENSORS_DTYPES[dtype]
    if info.native:
        return np.asarray(raw, dtype=np.float32)
    if dtype == "BF16":
        return (np.asarray(raw, dtype=np.uint32) << 16).view(np.float32)
    if dtype.startswith("F8_"):
        return _minifloat_table(dtype)[np.asarray(raw)]
    raise ValueError(f"cannot decode {dtype} to float32")


def ggml_decode_float32(raw: np.ndarray, type_id: int) -> np.ndarray:
    """Decode a GGUF tensor view (as handed out by the reader) to a float32 copy; ``NotImplementedError`` if gguf cannot."""
    t = GGMLQuantizationType(type_id)
    if t == GGMLQuantizationType.BF16:
        return (np.asarray(raw, dtype=np.uint32) << 16).view(np.float32)
    if t in _GGML_NATIVE:
        return np.asarray(raw, dtype=np.float32)

    return quants.dequantize(np.asarray(raw), t)
