"""Parse and validate a safetensors header from untrusted bytes.

Layout: 8-byte little-endian header length N, N bytes of JSON ``{name: {dtype, shape, data_offsets}, "__metadata__":
{str: str}}``, then the data; ``data_offsets`` are relative to the end of the header. Every length is checked against
the file size before anything of that length is read or allocated, so a hostile length field costs nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ktconvert.errors import InputError
from ktconvert.formats.sniff import RESAVE_FIX, describe, sniff
from ktconvert.formats.spans import check_overlaps
from ktconvert.io.dtypes import SAFETENSORS_DTYPES

# The reference implementation refuses headers above 100 MB; real ones are well under 10 MB.
MAX_HEADER_BYTES = 100_000_000


@dataclass(frozen=True, slots=True)  # one per tensor: 10^6 of them in the largest headers
class SafetensorsEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int


@dataclass(frozen=True)
class SafetensorsHeader:
    """``uncovered`` lists byte ranges of the data section that belong to no tensor: readable, but the safetensors
    library (and so transformers) refuses such files ("invalid offset" / "file not fully covered")."""

    entries: tuple[SafetensorsEntry, ...]
    metadata: dict[str, str]
    data_start: int
    file_size: int
    uncovered: tuple[tuple[int, int], ...] = ()


def _collect_duplicates(found: list[str]):
    """A json object hook that keeps the first value of a repeated key and remembers the key."""

    def hook(pairs):
        out = dict(pairs)
        if len(out) == len(pairs):  # no repeated key: the common case, at C speed (it runs once per tensor)
            return out
        out = {}
        for key, value in pairs:
            if key in out:
                found.append(key)
            else:
                out[key] = value
        return out

    return hook


def parse_safetensors_header(buf, path: str = "<buffer>") -> SafetensorsHeader:
    """Validate the header in ``buf`` (bytes or an mmap of the whole file) and return its entries.

    Raises :class:`InputError` for everything that is not a well-formed safetensors file whose tensors lie inside
    the file without overlapping.
    """
    size = len(buf)
    head = bytes(buf[:16])
    kind = sniff(head)
    if kind in ("zip", "pickle"):
        raise InputError(f"this is {describe(kind)}, not safetensors", path=path, where="byte 0", fix=RESAVE_FIX)
    if kind == "gguf":
        raise InputError("this is a GGUF file, not safetensors", path=path, where="byte 0", fix="name it *.gguf")
    if size < 8:
        raise InputError(
            f"file is {size} bytes; a safetensors file starts with an 8-byte header length",
            path=path,
            fix="the file is truncated or not safetensors; re-download or re-export it",
        )
    n = int.from_bytes(head[:8], "little")
    if n > size - 8:
        raise InputError(
            f"header length {n} is larger than the rest of the file ({size - 8} bytes)",
            path=path,
            where="byte 0",
            fix="the file is truncated or not safetensors; re-download or re-export it",
        )
    if n > MAX_HEADER_BYTES:
        raise InputError(
            f"header length {n} is absurd (limit {MAX_HEADER_BYTES} bytes)",
            path=path,
            where="byte 0",
            fix="this is not a safetensors file; check what wrote it",
        )
    data_start = 8 + n
    raw = bytes(buf[8:data_start])
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(
            "header is not UTF-8 text", path=path, where=f"byte {8 + exc.start}", fix="the file is corrupt"
        ) from None
    duplicates: list[str] = []
    try:
        obj = json.loads(text, object_pairs_hook=_collect_duplicates(duplicates))
    except json.JSONDecodeError as exc:
        raise InputError(
            f"header is not valid JSON: {exc.msg}", path=path, where=f"byte {8 + exc.pos}", fix="the file is corrupt"
        ) from None
    except (ValueError, RecursionError) as exc:  # absurd numbers or nesting inside otherwise valid JSON
        raise InputError(
            f"header JSON cannot be used: {type(exc).__name__}", path=path, where="byte 8", fix="the file is corrupt"
        ) from None
    if not isinstance(obj, dict):
        raise InputError("header JSON is not an object", path=path, where="byte 8", fix="the file is corrupt")
    if duplicates:
        key = duplicates[0]
        what = "tensor name" if key in obj else "key"
        raise InputError(
            f"duplicate {what} {key!r} in the header: readers disagree on which copy wins",
            path=path,
            where=f"tensor {key}" if key in obj else "byte 8",
            fix="the file was written by a broken tool; re-export it",
        )

    metadata = obj.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise InputError(
            "__metadata__ must map strings to strings", path=path, where="__metadata__", fix="re-export the file"
        )

    data_len = size - data_start
    entries = [_entry(name, spec, data_start, data_len, path) for name, spec in obj.items()]
    check_overlaps(((e.begin, e.end, e.name) for e in entries), path, "the header is corrupt; re-export the file")
    return SafetensorsHeader(tuple(entries), dict(metadata), data_start, size, _uncovered(entries, data_start, size))


def _entry(name: str, spec, data_start: int, data_len: int, path: str) -> SafetensorsEntry:
    def bad(msg: str) -> InputError:
        return InputError(msg, path=path, where=f"tensor {name}", fix="the header is corrupt; re-export the file")

    if not isinstance(spec, dict):
        raise bad("tensor entry is not an object")
    dtype, shape, offsets = spec.get("dtype"), spec.get("shape"), spec.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in SAFETENSORS_DTYPES:
        raise bad(f"unknown dtype {dtype!r} (known: {', '.join(SAFETENSORS_DTYPES)})")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise bad(f"shape {shape!r} is not a list of non-negative integers")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(type(o) is int for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise bad(f"data_offsets {offsets!r} is not [begin, end] with 0 <= begin <= end")
    begin, end = offsets
    if end > data_len:
        raise InputError(
            f"data ends at byte {data_start + end} but the file has {data_start + data_len} bytes (truncated?)",
            path=path,
            where=f"tensor {name} @ byte {data_start + begin}",
            fix="the file is truncated; re-download or re-export it",
        )
    bits = SAFETENSORS_DTYPES[dtype].bits
    n = 1
    for d in shape:
        n *= d
        if n > 1 << 64:  # stop before a hostile shape grows a huge integer
            raise bad(f"shape {shape} is absurd")
    if (n * bits) % 8:
        raise bad(f"{n} elements of {dtype} do not fill whole bytes")
    if n * bits // 8 != end - begin:
        raise bad(f"shape {shape} of {dtype} is {n * bits // 8} bytes but data_offsets span {end - begin} bytes")
    return SafetensorsEntry(name, dtype, tuple(shape), data_start + begin, data_start + end)


def _uncovered(entries: list[SafetensorsEntry], data_start: int, size: int) -> tuple[tuple[int, int], ...]:
    gaps, pos = [], data_start
    for begin, end in sorted((e.begin, e.end) for e in entries):
        if begin > pos:
            gaps.append((pos, begin))
        pos = max(pos, end)
    if pos < size:
        gaps.append((pos, size))
    return tuple(gaps)
