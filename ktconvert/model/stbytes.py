"""Byte-exact safetensors serialisation for files whose sha256 is recorded (tiny models, goldens).

The ``safetensors`` package is free to change its header spacing, key order or padding between releases;
this writer fixes all three (compact JSON, sorted keys, space padding to 8 bytes, data in key order), so a
file's hash depends only on the tensors. The result is an ordinary safetensors file any reader accepts.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np

_DTYPES = {
    np.dtype("<f4"): "F32",
    np.dtype("<f8"): "F64",
    np.dtype("<f2"): "F16",
    np.dtype("<i8"): "I64",
    np.dtype("<i4"): "I32",
    np.dtype("u1"): "U8",
}


def to_bytes(tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> bytes:
    """Serialise ``tensors`` (numpy arrays, little-endian) into safetensors bytes."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    chunks = []
    offset = 0
    for name in sorted(tensors):
        arr = np.ascontiguousarray(tensors[name])
        dtype = arr.dtype.newbyteorder("<") if arr.dtype.byteorder == ">" else arr.dtype
        code = _DTYPES.get(np.dtype(dtype))
        if code is None:
            raise ValueError(f"tensor {name!r}: dtype {arr.dtype} is not supported by this writer")
        data = arr.astype(dtype, copy=False).tobytes()
        header[name] = {"dtype": code, "shape": list(arr.shape), "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    head = json.dumps(header, sort_keys=True, separators=(",", ":")).encode("utf-8")
    head += b" " * (-len(head) % 8)
    return struct.pack("<Q", len(head)) + head + b"".join(chunks)


def write_file(path: str | os.PathLike, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    Path(path).write_bytes(to_bytes(tensors, metadata))
