"""GGUF output headers, computed before any tensor data exists.

A converter that knows every tensor's name, ``ne``, type and size up front can lay the whole file out at once:
header, KV pairs, tensor infos, and the aligned offset of every tensor. That is what lets ktconvert write
tensors out of order, from several processes, and resume an interrupted run: each tensor's place in the file
is fixed before the first byte of data is written.

KV pairs are handled as encoded bytes, so pairs copied from an input GGUF are carried over byte for byte
(:func:`raw_kv_pairs`) and new ones are encoded with gguf-py's value types (:func:`encode_kv`).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from gguf import GGUFValueType

GGUF_MAGIC = b"GGUF"
GGUF_VERSION = 3
DEFAULT_ALIGNMENT = 32

_FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor's data lives in an output GGUF: ``offset`` is absolute in the file."""

    name: str
    ne: tuple[int, ...]
    ggml_type: int
    nbytes: int
    offset: int


def _str(b: bytes | str) -> bytes:
    if isinstance(b, str):
        b = b.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _value(vtype: int, value, sub_type: int | None) -> bytes:
    if vtype in _FMT:
        return struct.pack(_FMT[vtype], value)
    if vtype == _STRING:
        return _str(value)
    if vtype == _ARRAY:
        if sub_type is None:
            raise ValueError("an array needs its element type")
        out = [struct.pack("<IQ", sub_type, len(value))]
        if sub_type in _FMT:
            out.append(struct.pack(f"<{len(value)}{_FMT[sub_type][1]}", *value))
        elif sub_type == _STRING:
            out.extend(_str(v) for v in value)
        else:
            raise ValueError("nested arrays are not allowed in GGUF")
        return b"".join(out)
    raise ValueError(f"unknown GGUF value type {vtype}")


def encode_kv(key: str, vtype: int, value, sub_type: int | None = None) -> bytes:
    """One KV pair as GGUF bytes (key, type, value); ``sub_type`` is an array's element type."""
    return _str(key) + struct.pack("<I", int(vtype)) + _value(int(vtype), value, None if sub_type is None else int(sub_type))


def kv_pairs_from_writer(writer) -> list[tuple[str, bytes]]:
    """Encode the KV pairs a ``gguf.GGUFWriter`` collected (its ``add_*`` helpers know each key's type)."""

    out = []
    for key, v in writer.kv_data[0].items():
        sub = v.sub_type
        if v.type == GGUFValueType.ARRAY and sub is None:
            sub = GGUFValueType.get_type(v.value[0]) if len(v.value) else GGUFValueType.UINT8
        out.append((key, encode_kv(key, v.type, v.value, sub)))
    return out


def raw_kv_pairs(path: str | Path) -> list[tuple[str, bytes]]:
    """Every KV pair of a GGUF file as its exact bytes, in file order.

    The file must already have passed :func:`ktconvert.formats.open_checkpoint` (which validates the header), so
    every length read here is known to fit; the checks below only guard against the file changing meanwhile.
    """
    out = []
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        if mm[:4] != GGUF_MAGIC:
            raise ValueError(f"{path}: not a GGUF file")
        _, _, n_kv = struct.unpack_from("<IQQ", mm, 4)
        pos = 24
        for _ in range(n_kv):
            start = pos
            (klen,) = struct.unpack_from("<Q", mm, pos)
            key = bytes(mm[pos + 8: pos + 8 + klen]).decode("utf-8", errors="replace")
            pos += 8 + klen
            (vtype,) = struct.unpack_from("<I", mm, pos)
            pos = _skip_value(mm, pos + 4, vtype)
            if pos > len(mm):
                raise ValueError(f"{path}: header changed while reading it")
            out.append((key, bytes(mm[start:pos])))
    return out


def _skip_value(mm, pos: int, vtype: int) -> int:
    if vtype in _FMT:
        return pos + struct.calcsize(_FMT[vtype])
    if vtype == _STRING:
        (n,) = struct.unpack_from("<Q", mm, pos)
        return pos + 8 + n
    if vtype == _ARRAY:
        etype, count = struct.unpack_from("<IQ", mm, pos)
        pos += 12
        if etype in _FMT:
            return pos + count * struct.calcsize(_FMT[etype])
        if etype == _STRING:
            for _ in range(count):
                (n,) = struct.unpack_from("<Q", mm, pos)
                pos += 8 + n
            return pos
    raise ValueError(f"unknown GGUF value type {vtype}")


def _pad(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def layout_gguf(kv: list[tuple[str, bytes]], tensors: list[tuple[str, tuple[int, ...], int, int]],
                alignment: int = DEFAULT_ALIGNMENT) -> tuple[bytes, list[TensorSlot], int]:
    """``(header bytes incl. padding, slots, file size)`` for ``tensors`` = ``[(name, ne, ggml type, nbytes)]``.

    Each tensor starts at a multiple of ``alignment`` and is padded to one, as gguf-py writes; the header is
    padded so data starts aligned. ``alignment`` must equal the ``general.alignment`` KV when there is one.
    """
    head = [GGUF_MAGIC, struct.pack("<IQQ", GGUF_VERSION, len(tensors), len(kv))]
    head.extend(b for _, b in kv)
    rel = 0
    rels = []
    for name, ne, ttype, nbytes in tensors:
        head.append(_str(name) + struct.pack("<I", len(ne)) + struct.pack(f"<{len(ne)}Q", *ne)
                    + struct.pack("<IQ", ttype, rel))
        rels.append(rel)
        rel += _pad(nbytes, alignment)
    header = b"".join(head)
    data_start = _pad(len(header), alignment)
    header += b"\0" * (data_start - len(header))
    slots = [TensorSlot(n, tuple(ne), t, nb, data_start + r) for (n, ne, t, nb), r in zip(tensors, rels)]
    return header, slots, data_start + rel
