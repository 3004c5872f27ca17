"""ggml type facts and the shape arithmetic every caller needs (no numerics, no heavy imports)."""

from __future__ import annotations

from typing import Sequence

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from .errors import QuantError

QType = GGMLQuantizationType

#: The IQ types whose levels are points of a fixed grid (``_jit_iq``), in the order users read them; ggml's
#: searches for them take an importance matrix.
IQ_GRID: tuple[str, ...] = ("IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M")
#: Names of the types :func:`ktconvert.quant.quantize` produces, bit-exact with ggml's quantizers: what a
#: recipe or ``--type`` may name, in the order users read them.
WRITABLE: tuple[str, ...] = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                             "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", *IQ_GRID)
#: Types the library quantizes: every one it writes (the non-linear 4-bit types included: llama-quantize writes them
#: with or without an importance matrix).
QUANTIZABLE: frozenset[QType] = frozenset(QType[name] for name in WRITABLE)
IQ_GRID_TYPES: frozenset[QType] = frozenset(QType[name] for name in IQ_GRID)
#: Types whose ggml quantizer takes an importance matrix (``quantize_row_*_impl``, ``quantize_iq*``); the others
#: (Q8_0, F32, F16, BF16) ignore one, as ``ggml_quantize_chunk`` does.
IMATRIX_TYPES: frozenset[QType] = frozenset(QType[name] for name in (
    "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")) | IQ_GRID_TYPES
#: Types ggml refuses to quantize without an importance matrix (``ggml_quantize_requires_imatrix``: its
#: ``ggml_quantize_chunk`` aborts on a NULL one); :func:`ktconvert.quant.quantize` raises instead.
IMATRIX_REQUIRED: frozenset[QType] = frozenset(QType[name] for name in ("IQ2_XXS", "IQ2_XS", "IQ1_S"))


def as_qtype(qtype: QType | int | str) -> QType:
    """Accept the enum, its integer id or its name (``"Q4_K"``, ``"q4_k"``)."""
    if isinstance(qtype, QType):
        return qtype
    try:
        if isinstance(qtype, str):
            return QType[qtype.upper()]
        return QType(int(qtype))
    except (KeyError, ValueError, TypeError):
        raise QuantError(f"unknown ggml type {qtype!r}",
                         fix="use a ggml type name such as Q4_K, Q8_0 or F16") from None


def block_size(qtype: QType | int | str) -> int:
    """Elements per block (1 for F32/F16/BF16, 32 for Q8_0/Q4_0..., 256 for K-quants)."""
    return GGML_QUANT_SIZES[as_qtype(qtype)][0]


def type_size(qtype: QType | int | str) -> int:
    """Bytes per block."""
    return GGML_QUANT_SIZES[as_qtype(qtype)][1]


def row_ok(row_len: int, qtype: QType | int | str) -> bool:
    """Whether rows of ``row_len`` elements can be stored as ``qtype`` (a positive multiple of its block)."""
    return row_len > 0 and row_len % block_size(qtype) == 0


def _suggest(row_len: int) -> str:
    if row_len > 0 and row_len % 32 == 0:
        return "use a 32-element type such as Q8_0, Q5_0 or Q4_0 for this tensor, or keep it in F16"
    return "keep this tensor in F16, BF16 or F32"


def check_row(row_len: int, qtype: QType | int | str, *, name: str | None = None) -> None:
    """Raise :class:`QuantError` (one line: type, row length, fix) unless ``row_ok``."""
    qt = as_qtype(qtype)
    if not row_ok(row_len, qt):
        bs = block_size(qt)
        raise QuantError(f"{qt.name} cannot hold rows of {row_len} elements: rows must be a positive "
                         f"multiple of its {bs}-element block", where=name, fix=_suggest(row_len))


def byte_shape(shape: Sequence[int], qtype: QType | int | str) -> tuple[int, ...]:
    """Element shape -> shape of the quantized uint8 array (last axis in bytes)."""
    qt = as_qtype(qtype)
    if len(shape) == 0:
        raise QuantError(f"{qt.name} needs at least one axis; got a scalar", fix="reshape it to (1,) first")
    check_row(int(shape[-1]), qt)
    bs, ts = GGML_QUANT_SIZES[qt]
    return (*map(int, shape[:-1]), int(shape[-1]) // bs * ts)


def elem_shape(shape: Sequence[int], qtype: QType | int | str) -> tuple[int, ...]:
    """Quantized uint8 shape (last axis in bytes) -> element shape."""
    qt = as_qtype(qtype)
    bs, ts = GGML_QUANT_SIZES[qt]
    if len(shape) == 0 or int(shape[-1]) % ts != 0 or int(shape[-1]) == 0:
        last = shape[-1] if len(shape) else "no axis"
        raise QuantError(f"{qt.name} data must have a last axis of whole {ts}-byte blocks; got {last}",
                         fix="pass the tensor's bytes with rows along the last axis, as GGUFReader returns them")
    return (*map(int, shape[:-1]), int(shape[-1]) // ts * bs)
