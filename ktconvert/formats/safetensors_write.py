"""safetensors output headers computed up front, and a streaming writer that never holds a whole tensor set.

The header of a safetensors file lists every tensor's byte range, so a writer that knows the tensors' dtypes
and shapes can write the header first and then the data piece by piece, in any order. The ``safetensors``
package's own writers need every tensor in memory at once; these do not.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from ktconvert.io.dtypes import st_dtype_of


@dataclass(frozen=True)
class StSlot:
    """Where one tensor's data lives in an output safetensors file: ``offset`` is absolute."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    offset: int


def layout_safetensors(tensors: list[tuple[str, str, tuple[int, ...], int]], metadata: dict[str, str] | None = None,
                       *, sort_keys: bool = False) -> tuple[bytes, list[StSlot], int]:
    """``(header bytes, slots, file size)`` for ``[(name, dtype, shape, nbytes)]`` laid out back to back.

    The JSON header is padded with spaces to a multiple of 8 bytes, as the ``safetensors`` package writes it;
    ``sort_keys`` sorts every JSON key (the canonical form :func:`to_bytes` writes).
    """
    head: dict = {}
    if metadata:
        head["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    rel = 0
    rels = []
    for name, dtype, shape, nbytes in tensors:
        head[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [rel, rel + nbytes]}
        rels.append(rel)
        rel += nbytes
    text = json.dumps(head, separators=(",", ":"), sort_keys=sort_keys).encode("utf-8")
    text += b" " * (-len(text) % 8)
    header = struct.pack("<Q", len(text)) + text
    slots = [StSlot(n, d, tuple(s), nb, len(header) + r) for (n, d, s, nb), r in zip(tensors, rels)]
    return header, slots, len(header) + rel


#: The ``safetensors`` package's dtype enum order; its ``save_file`` lays tensors out by dtype (this order, reversed),
#: then by name. An output meant to be byte-equal to one written by ``save_file`` uses :func:`save_file_order`.
_ST_DTYPE_ORDER = ("BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "I16", "U16",
                   "F16", "BF16", "I32", "U32", "F32", "C64", "F64", "I64", "U64")


def save_file_order(tensors: list) -> list:
    """``tensors`` (tuples whose first two fields are name and dtype) in the order ``safetensors.save_file`` writes."""
    return sorted(tensors, key=lambda t: (-_ST_DTYPE_ORDER.index(t[1]), t[0]))


def write_safetensors(path: str | Path, tensors: Iterable[tuple[str, str, tuple[int, ...], int,
                                                                   Callable[[], Iterable[bytes]]]],
                      metadata: dict[str, str] | None = None) -> int:
    """Write ``[(name, dtype, shape, nbytes, chunks)]`` to ``path``; ``chunks()`` yields the tensor's bytes in
    pieces (e.g. one expert at a time), so memory stays at one piece. Returns the file size; the caller
    provides atomicity (write into a temporary directory, then rename)."""
    tensors = list(tensors)
    header, slots, size = layout_safetensors([(n, d, s, nb) for n, d, s, nb, _ in tensors], metadata)
    with open(path, "wb") as fh:
        fh.write(header)
        for (name, _, _, nbytes, chunks), slot in zip(tensors, slots):
            written = 0
            for piece in chunks():
                fh.write(piece)
                written += len(piece)
            if written != nbytes:
                raise ValueError(f"{name}: wrote {written} bytes, header says {nbytes}")
        fh.flush()
        os.fsync(fh.fileno())
    return size


def to_bytes(tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None,
             dtypes: dict[str, str] | None = None) -> bytes:
    """Byte-exact safetensors for files whose sha256 is recorded (tiny models, goldens).

    The ``safetensors`` package is free to change its header spacing, key order or padding between releases;
    this form fixes all three (compact JSON, sorted keys, space padding to 8 bytes, data in name order), so a
    file's hash depends only on the tensors. The result is an ordinary safetensors file any reader accepts.
    ``dtypes`` names the stored type of arrays that hold raw bits (``F8_E4M3`` codes as uint8, BF16 as uint16).
    """
    names = sorted(tensors)
    arrays = [np.ascontiguousarray(tensors[n]) for n in names]
    try:
        specs = [(n, (dtypes or {}).get(n) or st_dtype_of(a.dtype), a.shape, a.nbytes) for n, a in zip(names, arrays)]
    except ValueError as exc:
        raise ValueError(f"{exc} (writing {names})") from None
    header, _, _ = layout_safetensors(specs, metadata, sort_keys=True)
    return header + b"".join(a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes() for a in arrays)
