"""Parse and validate a GGUF header (v2/v3, little-endian) from untrusted bytes.

Layout: magic ``GGUF``, u32 version, u64 tensor count, u64 KV count, the KV pairs, the tensor infos (name, dims in
ggml ``ne`` order, type, offset relative to the aligned data section), padding to ``general.alignment``, data.

Why our own parser rather than ``gguf.GGUFReader``: the reader builds Python objects per array element (opening a
file with a 150k-token vocabulary took 5 s here), trusts counts and lengths before checking them against the file
size, and fails with assorted exceptions on hostile input. This one reads only what it has checked fits in the file,
keeps large arrays as lazy references, and raises only :class:`InputError`. Tests compare its result with
``GGUFReader`` on every GGUF file they write.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from ktconvert.errors import InputError
from ktconvert.formats.sniff import RESAVE_FIX, describe, sniff
from ktconvert.formats.spans import check_overlaps
from ktconvert.io.dtypes import ggml_block, ggml_is_known, ggml_type_name

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_TENSORS = 1 << 20
MAX_KV = 1 << 20
EAGER_ARRAY_LIMIT = 1024  # arrays up to this length are decoded while parsing; longer ones stay lazy

# Smallest possible encodings, used to bound counts by the file size before looping over them.
_MIN_KV_BYTES = 8 + 4 + 1  # empty key, type, 1-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # empty name, n_dims=0, type, offset

_SCALARS = {
    0: ("UINT8", "<B"),
    1: ("INT8", "<b"),
    2: ("UINT16", "<H"),
    3: ("INT16", "<h"),
    4: ("UINT32", "<I"),
    5: ("INT32", "<i"),
    6: ("FLOAT32", "<f"),
    7: ("BOOL", "<?"),
    10: ("UINT64", "<Q"),
    11: ("INT64", "<q"),
    12: ("FLOAT64", "<d"),
}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFArray:
    """A KV array. ``values`` is filled for short arrays; long ones (vocabularies) are read on demand."""

    element_type: str
    length: int
    offset: int  # absolute offset of the first element
    values: tuple | None = None


@dataclass(frozen=True)
class GGUFTensorSpec:
    name: str
    ne: tuple[int, ...]
    ggml_type: int
    begin: int  # absolute
    nbytes: int


@dataclass(frozen=True)
class GGUFHeader:
    version: int
    alignment: int
    data_start: int
    file_size: int
    kv: dict = field(default_factory=dict)
    tensors: tuple[GGUFTensorSpec, ...] = ()


class _Cursor:
    def __init__(self, buf, path: str):
        self.buf, self.path, self.pos, self.size = buf, path, 0, len(buf)

    def fail(self, msg: str, fix: str = "the file is truncated or corrupt; re-download or re-convert it", at=None):
        return InputError(msg, path=self.path, where=f"byte {self.pos if at is None else at}", fix=fix)

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise self.fail(f"{what} needs {n} bytes but only {self.size - self.pos} remain")

    def unpack(self, fmt: str, what: str):
        n = struct.calcsize(fmt)
        self.need(n, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return value

    def raw_string(self, what: str) -> bytes:
        n = self.unpack("<Q", f"{what} length")
        self.need(n, what)
        out = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return out

    def name(self, what: str) -> str:
        at = self.pos
        try:
            return self.raw_string(what).decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not UTF-8", at=at) from None


def parse_gguf_header(buf, path: str = "<buffer>") -> GGUFHeader:
    """Validate the header in ``buf`` (bytes or an mmap of the whole file); raise :class:`InputError` if unusable."""
    cur = _Cursor(buf, path)
    head = bytes(buf[:8])
    if head[:4] != MAGIC:
        kind = sniff(head)
        if kind in ("zip", "pickle"):
            raise InputError(f"this is {describe(kind)}, not GGUF", path=path, where="byte 0", fix=RESAVE_FIX)
        raise cur.fail(f"bad magic {head[:4]!r} (a GGUF file starts with b'GGUF')", fix="this is not a GGUF file")
    cur.pos = 4
    version = cur.unpack("<I", "version")
    if version not in SUPPORTED_VERSIONS:
        swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
        if swapped in SUPPORTED_VERSIONS:
            raise cur.fail(
                "big-endian GGUF is not supported",
                fix="convert it with gguf-convert-endian (from the gguf package) to little-endian",
                at=4,
            )
        raise cur.fail(
            f"unsupported GGUF version {version} (supported: {', '.join(map(str, SUPPORTED_VERSIONS))})",
            fix="version 1 files predate llama.cpp's current format; re-convert the model"
            if version < min(SUPPORTED_VERSIONS)
            else "the file is newer than this ktconvert, or corrupt; update ktconvert or re-convert",
            at=4,
        )
    n_tensors = cur.unpack("<Q", "tensor count")
    n_kv = cur.unpack("<Q", "KV count")
    room = cur.size - cur.pos
    if n_tensors > MAX_TENSORS or n_kv > MAX_KV or n_kv * _MIN_KV_BYTES + n_tensors * _MIN_TENSOR_INFO_BYTES > room:
        raise cur.fail(
            f"absurd counts: {n_tensors} tensors and {n_kv} KV pairs cannot fit in the {room} header bytes left",
            fix="the header is corrupt; re-download or re-convert the file",
            at=8,
        )

    kv: dict = {}
    for _ in range(n_kv):
        at = cur.pos
        key = cur.name("KV key")
        if key in kv:
            raise cur.fail(f"duplicate KV key {key!r}", fix="the file was written by a broken tool; re-convert it", at=at)
        kv[key] = _value(cur, key)

    alignment = DEFAULT_ALIGNMENT
    if "general.alignment" in kv:
        alignment = kv["general.alignment"]
        if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1) or alignment > 1 << 30:
            raise InputError(
                f"general.alignment {alignment!r} is not a power of two",
                path=path,
                where="general.alignment",
                fix="the header is corrupt; re-convert the file",
            )

    specs = []
    seen: set[str] = set()
    for _ in range(n_tensors):
        specs.append(_tensor_info(cur, seen, alignment))

    data_start = -(-cur.pos // alignment) * alignment
    tensors = []
    for name, ne, type_id, rel, nbytes, at in specs:
        begin = data_start + rel
        if begin + nbytes > cur.size:
            raise InputError(
                f"data ends at byte {begin + nbytes} but the file has {cur.size} bytes (truncated?)",
                path=path,
                where=f"tensor {name} @ byte {begin}",
                fix="the file is truncated; re-download it (or the missing split shard)",
            )
        tensors.append(GGUFTensorSpec(name, ne, type_id, begin, nbytes))
    check_overlaps(((t.begin, t.begin + t.nbytes, t.name) for t in tensors), path,
                   "the header is corrupt; re-convert the file")
    return GGUFHeader(version, alignment, data_start, cur.size, kv, tuple(tensors))


def _value(cur: _Cursor, key: str):
    at = cur.pos
    vtype = cur.unpack("<I", f"type of {key}")
    if vtype in _SCALARS:
        return cur.unpack(_SCALARS[vtype][1], f"value of {key}")
    if vtype == _STRING:
        return cur.raw_string(f"value of {key}").decode("utf-8", errors="replace")
    if vtype != _ARRAY:
        raise cur.fail(f"KV {key!r} has unknown value type {vtype}", fix="the header is corrupt; re-convert the file", at=at)
    etype = cur.unpack("<I", f"element type of {key}")
    count = cur.unpack("<Q", f"length of {key}")
    start = cur.pos
    if etype in _SCALARS:
        name, fmt = _SCALARS[etype]
        width = struct.calcsize(fmt)
        cur.need(count * width, f"array {key} of {count} {name}")
        values = None
        if count <= EAGER_ARRAY_LIMIT:
            values = struct.unpack_from(f"<{count}{fmt[1]}", cur.buf, start)
        cur.pos += count * width
        return GGUFArray(name, count, start, values)
    if etype == _STRING:
        cur.need(count * 8, f"array {key} of {count} strings")  # each string has at least its length prefix
        values = []
        for _ in range(count):
            s = cur.raw_string(f"element of {key}")
            if count <= EAGER_ARRAY_LIMIT:
                values.append(s.decode("utf-8", errors="replace"))
        return GGUFArray("STRING", count, start, tuple(values) if count <= EAGER_ARRAY_LIMIT else None)
    what = "nested arrays are not supported by llama.cpp" if etype == _ARRAY else f"unknown element type {etype}"
    raise cur.fail(f"KV {key!r}: {what}", fix="llama.cpp cannot load this file either; re-convert it", at=at)


def _tensor_info(cur: _Cursor, seen: set[str], alignment: int):
    at = cur.pos
    name = cur.name("tensor name")
    if name in seen:
        raise InputError(
            f"duplicate tensor name {name!r}",
            path=cur.path,
            where=f"tensor {name} @ byte {at}",
            fix="the file was written by a broken tool; re-convert it",
        )
    seen.add(name)

    def bad(msg: str) -> InputError:
        return InputError(msg, path=cur.path, where=f"tensor {name} @ byte {at}", fix="the header is corrupt")

    n_dims = cur.unpack("<I", f"dimension count of {name}")
    if n_dims > MAX_DIMS:
        raise bad(f"{n_dims} dimensions (ggml allows at most {MAX_DIMS})")
    ne = tuple(cur.unpack("<Q", f"dimension of {name}") for _ in range(n_dims))
    type_id = cur.unpack("<I", f"type of {name}")
    rel = cur.unpack("<Q", f"offset of {name}")
    if not ggml_is_known(type_id):
        raise bad(f"unknown ggml type {type_id}")
    block, size = ggml_block(type_id)
    n = 1
    for d in ne:
        n *= d
        if n > cur.size * block:  # cannot fit; stop before the product grows without bound
            raise bad(f"ne {list(ne)} of {ggml_type_name(type_id)} needs more bytes than the file holds")
    row = ne[0] if ne else 1
    if row % block:
        raise bad(
            f"row length ne0={row} is not a multiple of the {ggml_type_name(type_id)} block size {block}"
        )
    if rel % alignment:
        raise bad(f"data offset {rel} is not a multiple of the alignment {alignment}")
    return name, ne, type_id, rel, n // block * size, at


def read_array(buf, arr: GGUFArray) -> list:
    """All values of a KV array, read from ``buf`` (the file's bytes or mmap) at the offset the parser recorded."""
    if arr.values is not None:
        return list(arr.values)
    if arr.element_type == "STRING":
        out, pos = [], arr.offset
        for _ in range(arr.length):
            (n,) = struct.unpack_from("<Q", buf, pos)
            out.append(bytes(buf[pos + 8 : pos + 8 + n]).decode("utf-8", errors="replace"))
            pos += 8 + n
        return out
    fmt = next(f for name, f in _SCALARS.values() if name == arr.element_type)
    return list(struct.unpack_from(f"<{arr.length}{fmt[1]}", buf, arr.offset))
