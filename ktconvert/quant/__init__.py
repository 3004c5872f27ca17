"""ggml block quantizers and dequantizers, one registry keyed by ``gguf.GGMLQuantizationType``.

Conventions follow ``gguf.quants``: rows run along the last axis, quantized data is uint8 in *byte shape*
``(..., row_len // block_size * type_size)``, dequantized data is float32 in element shape.

* :func:`quantize` / :func:`quantize_parallel`: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K..Q6_K,
  byte-for-byte what ggml's reference path (``llama-quantize`` without an importance matrix) writes on
  x86-64. Compiled with numba (``_jit``: the C's scalar loops, fastmath off), chunked (bounded memory), and
  threaded over row slices without the GIL (``workers``).
* With an importance matrix (``imatrix=``): ggml's weighted searches (``quantize_row_*_impl``, ``_jit_imatrix``),
  and the IQ grid types (``IQ_GRID_TYPES``: ``_jit_iq``), byte-for-byte ``llama-quantize --imatrix``; the types
  of ``IMATRIX_REQUIRED`` are refused without one, as ggml does.
* :func:`dequantize`: those types plus every type the installed ``gguf`` package can decode (the IQ types
  included).
* Shape helpers: :func:`block_size`, :func:`type_size`, :func:`row_ok`, :func:`check_row`,
  :func:`byte_shape`, :func:`elem_shape`.

Every failure is a :class:`QuantError` (an ``InputError``, exit 3) raised before any work starts.
Importing this package is light: numba is imported by the first quantization, and each kernel is compiled
(or loaded from numba's on-disk cache) on its first call, so a process pays only for the types it uses.
"""

from __future__ import annotations

from ._api import bf16_to_float32, cpu_count, dequantizable, dequantize, quantize, quantize_parallel
from ._types import (
                     IMATRIX_REQUIRED,
                     IMATRIX_TYPES,
                     IQ_GRID,
                     IQ_GRID_TYPES,
                     QUANTIZABLE,
                     WRITABLE,
                     QType,
                     as_qtype,
                     block_size,
                     byte_shape,
                     check_row,
                     elem_shape,
                     row_ok,
                     type_size,
)
from .errors import QuantError

__all__ = [
    "IMATRIX_REQUIRED",
    "IMATRIX_TYPES",
    "IQ_GRID",
    "IQ_GRID_TYPES",
    "QType",
    "QUANTIZABLE",
    "WRITABLE",
    "QuantError",
    "as_qtype",
    "bf16_to_float32",
    "block_size",
    "byte_shape",
    "check_row",
    "cpu_count",
    "dequantizable",
    "dequantize",
    "elem_shape",
    "quantize",
    "quantize_parallel",
    "row_ok",
    "type_size",
]
