"""llama.cpp importance-matrix files, read into the per-column importances ``llama-quantize --imatrix`` uses.

Two formats (llama.cpp ``common/imatrix-loader.cpp``, the version the tests pin):

* **GGUF** (what ``llama-imatrix`` writes now): KVs ``imatrix.datasets``, ``imatrix.chunk_count``,
  ``imatrix.chunk_size`` (llama-quantize refuses a file without all three), and per matrix two F32 tensors
  ``<name>.in_sum2`` (ne ``[n_in]``, or ``[n_in, n_expert]`` for merged experts) and ``<name>.counts`` (ne ``[1]`` or
  ``[1, n_expert]``). llama-quantize rounds each count to an integer and divides: importance = in_sum2 / count, in
  float32; an expert whose count is 0 (the calibration text never routed to it) gets importance 1 everywhere.
* **legacy ``.dat``**: int32 entry count, then per entry int32 name length, the name, int32 ``ncall``, int32
  ``nval`` and ``nval`` float32 sums (already averaged per call by the writer, times ``ncall``); optionally an int32
  chunk count and an int32-length dataset name. llama-quantize divides by ``ncall`` (if > 0; else takes the sums).

:func:`imatrix_gguf_bytes` writes the GGUF form (``ktconvert imatrix``'s output) as llama-imatrix's ``save_imatrix``
lays it out: ``general.type = imatrix``, the three ``imatrix.*`` KVs, then per entry in sorted name order
``<name>.in_sum2`` (F32, ne ``[n_in, n_mat]``) and ``<name>.counts`` (F32, ne ``[1, n_mat]``), trailing 1s dropped
from ``ne`` as ggml's GGUF writer drops them; the raw sums and counts, not divided.

Anything llama-quantize would crash on, read as garbage or refuse later (a truncated file, sums without counts, a
zero-length counts tensor, NaN/inf, negative sums or counts, shapes that do not divide) is an :class:`InputError`
naming the file and the entry.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ktconvert.errors import InputError
from ktconvert.formats.gguf_header import GGUFArray, parse_gguf_header, read_array
from ktconvert.io.files import regular_file_size

_F32 = 0  # ggml type id
_META = ("imatrix.datasets", "imatrix.chunk_count", "imatrix.chunk_size")
_REMAKE = "remake it with llama-imatrix for this model"


@dataclass(frozen=True)
class Imatrix:
    """An importance matrix as llama-quantize uses it.

    ``values[name]``: float32, ``(n_in,)`` for a dense matrix or ``(n_expert, n_in)`` for merged experts (the legacy
    format stores experts flat: ``(n_expert * n_in,)`` until :meth:`for_tensor` shapes it). ``no_data[name]``: the
    experts (0 for a dense matrix) whose count was 0, importance 1 in ``values``.
    """

    path: str
    format: str  # "gguf" or "dat"
    values: dict[str, np.ndarray]
    datasets: tuple[str, ...] = ()
    chunk_count: int = 0
    chunk_size: int = 0
    sha256: str = ""
    no_data: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def for_tensor(self, name: str, shape: tuple[int, ...]) -> np.ndarray | None:
        """The importances for the weight ``name`` of numpy ``shape`` (``(rows, n_in)`` or ``(E, rows, n_in)``):
        ``(n_in,)`` or ``(E, n_in)``; ``None`` when the file has no entry for it (llama-quantize then quantizes it
        without one). A size that is not ``n_in * E`` is an :class:`InputError` (llama-quantize refuses it too),
        except for ``token_embd.weight``, which llama-quantize quantizes without one."""
        v = self.values.get(name)
        if v is None:
            return None
        n_in = int(shape[-1])
        experts = int(shape[0]) if len(shape) >= 3 else 1
        if v.size != n_in * experts:
            if name == "token_embd.weight":
                return None
            raise InputError(f"the importance matrix has {v.size} values for {name}, whose {experts} expert(s) of "
                             f"{n_in} columns need {n_in * experts}", path=self.path, where=name,
                             fix=f"this imatrix was made for another model; {_REMAKE}")
        return v.reshape(experts, n_in) if experts > 1 else v.reshape(n_in)

    def select(self, include: tuple[str, ...] = (), exclude: tuple[str, ...] = ()) -> "Imatrix":
        """The entries llama-quantize keeps with ``--include-weights`` (those whose name contains one of
        ``include``) or ``--exclude-weights`` (all but those containing one of ``exclude``)."""
        keep = {k: v for k, v in self.values.items()
                if not any(x in k for x in exclude) and (not include or any(x in k for x in include))}
        return Imatrix(**{**self.__dict__, "values": keep,
                          "no_data": {k: v for k, v in self.no_data.items() if k in keep}})

    def summary(self) -> dict:
        """What a manifest records: the file, its sha256 and format, the entries, and the experts without data."""
        return {"file": Path(self.path).name, "sha256": self.sha256, "format": self.format,
                "entries": len(self.values), "datasets": list(self.datasets), "chunk_count": self.chunk_count,
                "no_data": {k: list(v) for k, v in sorted(self.no_data.items())}}


def read_imatrix(path: str | Path) -> Imatrix:
    """Read ``path`` (GGUF if it starts with ``GGUF``, else the legacy ``.dat``); :class:`InputError` if unusable."""
    path = Path(path)
    size = regular_file_size(path, "imatrix file")
    if size == 0:
        raise InputError("the imatrix file is empty", path=str(path), fix=_REMAKE)
    try:
        mm = path.read_bytes()  # read whole, as llama-quantize does: an imatrix is small next to the model
    except OSError as exc:
        raise InputError(f"cannot read the imatrix file: {exc.strerror}", path=str(path)) from None
    digest = hashlib.sha256(mm).hexdigest()
    out = _read_gguf(mm, str(path)) if mm[:4] == b"GGUF" else _read_dat(mm, str(path))
    return Imatrix(**{**out.__dict__, "sha256": digest})


def _lround(x: np.ndarray) -> np.ndarray:
    """C's ``lround``: to the nearest integer, halves away from zero."""
    return (np.sign(x) * np.floor(np.abs(x.astype(np.float64)) + 0.5)).astype(np.int64)


def _finite(arr: np.ndarray, path: str, where: str) -> None:
    bad = ~np.isfinite(arr) | (arr < 0)
    if bad.any():
        i = int(np.argwhere(bad.reshape(-1))[0][0])
        raise InputError(f"value {arr.reshape(-1)[i]} at index {i}; sums of squares and counts are finite and >= 0",
                         path=path, where=where, fix=_REMAKE)


def _read_gguf(mm, path: str) -> Imatrix:
    header = parse_gguf_header(mm, path)
    kind = header.kv.get("general.type")
    missing = [k for k in _META if k not in header.kv]
    if missing:
        what = f"a {kind} GGUF, not an importance matrix" if kind not in (None, "imatrix") else \
            f"an imatrix GGUF without {', '.join(missing)}"
        raise InputError(f"this is {what} (llama-quantize refuses it too)", path=path,
                         where=missing[0], fix=_REMAKE)
    pairs: dict[str, dict] = {}
    for t in header.tensors:
        for suffix in (".in_sum2", ".counts"):
            if t.name.endswith(suffix) and len(t.name) > len(suffix):
                pairs.setdefault(t.name[: -len(suffix)], {})[suffix] = t
    if not pairs:
        raise InputError("no <tensor>.in_sum2 / <tensor>.counts tensors", path=path, fix=_REMAKE)
    values: dict[str, np.ndarray] = {}
    no_data: dict[str, tuple[int, ...]] = {}
    for name, pair in sorted(pairs.items()):
        if len(pair) != 2:
            have = next(iter(pair))
            raise InputError(f"{name}{have} has no {'.counts' if have == '.in_sum2' else '.in_sum2'} partner",
                             path=path, where=name + have, fix=_REMAKE)
        s_t, c_t = pair[".in_sum2"], pair[".counts"]
        for t in (s_t, c_t):
            if t.ggml_type != _F32:
                raise InputError("sums and counts must be F32", path=path, where=t.name, fix=_REMAKE)
        sums = np.frombuffer(mm, dtype="<f4", count=_elems(s_t), offset=s_t.begin)
        counts = np.frombuffer(mm, dtype="<f4", count=_elems(c_t), offset=c_t.begin)
        if counts.size == 0 or sums.size == 0 or sums.size % counts.size:
            raise InputError(f"{sums.size} sums do not split into {counts.size} count(s)", path=path,
                             where=c_t.name, fix=_REMAKE)
        _finite(sums, path, s_t.name)
        _finite(counts, path, c_t.name)
        n = _lround(counts).astype(np.float32)  # (float) lround(count), as llama-quantize divides
        per = sums.reshape(counts.size, -1)
        v = np.ones_like(per)
        has = n > 0
        v[has] = per[has] / n[has, None]
        if not has.all():
            no_data[name] = tuple(int(i) for i in np.flatnonzero(~has))
        values[name] = v.reshape(-1) if counts.size == 1 else v
    return Imatrix(path, "gguf", values, tuple(_datasets(mm, header.kv.get("imatrix.datasets"))),
                   int(header.kv.get("imatrix.chunk_count") or 0), int(header.kv.get("imatrix.chunk_size") or 0),
                   no_data=no_data)


def _elems(t) -> int:
    return int(np.prod(t.ne, dtype=np.int64)) if t.ne else 1


def _datasets(mm, arr) -> list[str]:
    if arr is None:
        return []
    try:
        return [str(x) for x in read_array(mm, arr)] if isinstance(arr, GGUFArray) else [str(arr)]
    except (struct.error, ValueError, StopIteration):
        return []


def _read_dat(mm, path: str) -> Imatrix:
    pos = 0
    size = len(mm)

    def take(fmt: str, what: str, where: str):
        nonlocal pos
        n = struct.calcsize(fmt)
        if pos + n > size:
            raise InputError(f"the file ends at byte {size} inside {what}", path=path, where=where,
                             fix="the legacy .dat imatrix is truncated: copy it again or remake it")
        out = struct.unpack_from(fmt, mm, pos)
        pos += n
        return out

    (n_entries,) = take("<i", "the entry count", "byte 0")
    if n_entries < 1:
        raise InputError(f"entry count {n_entries} (a legacy .dat imatrix starts with its number of entries, >= 1)",
                         path=path, where="byte 0", fix="this is not an importance matrix; " + _REMAKE)
    values: dict[str, np.ndarray] = {}
    no_data: dict[str, tuple[int, ...]] = {}
    for i in range(n_entries):
        where = f"entry {i + 1} of {n_entries} (byte {pos})"
        (length,) = take("<i", "a name length", where)
        if length < 1 or length > size - pos:
            raise InputError(f"name length {length} does not fit in the file", path=path, where=where,
                             fix="the file is truncated or not an importance matrix; " + _REMAKE)
        raw = bytes(mm[pos: pos + length])
        pos += length
        name = raw.split(b"\0", 1)[0].decode("utf-8", errors="replace")  # llama.cpp reads it as a C string
        where = f"entry {name!r}"
        ncall, nval = take("<ii", "the call and value counts", where)
        if nval < 1 or ncall < 0:
            raise InputError(f"ncall {ncall}, nval {nval}: a legacy entry has nval >= 1 values and ncall >= 0",
                             path=path, where=where, fix=_REMAKE)
        if pos + 4 * nval > size:
            raise InputError(f"the file ends at byte {size} inside the {nval} values", path=path, where=where,
                             fix="the legacy .dat imatrix is truncated: copy it again or remake it")
        sums = np.frombuffer(mm, dtype="<f4", count=nval, offset=pos)
        pos += 4 * nval
        _finite(sums, path, where)
        values[name] = sums / np.float32(ncall) if ncall > 0 else sums.copy()
        if ncall == 0:
            no_data[name] = (0,)
    chunk_count, datasets = 0, []
    if pos + 4 <= size:  # optional trailer: chunk count and the dataset's name
        (chunk_count,) = take("<i", "the chunk count", "trailer")
        if pos + 4 <= size:
            (length,) = take("<i", "the dataset name length", "trailer")
            if 0 < length <= size - pos:
                datasets.append(bytes(mm[pos: pos + length]).split(b"\0", 1)[0].decode("utf-8", errors="replace"))
    return Imatrix(path, "dat", values, tuple(datasets), int(chunk_count), 0, no_data=no_data)


@dataclass(frozen=True)
class ImatrixEntry:
    """One matrix's raw statistics: ``sums`` float32 ``(n_mat, n_in)`` (sum over the tokens of each input column's
    squared activation; ``n_mat`` is 1 for a dense matrix, ``n_expert`` for merged experts) and ``counts``
    ``(n_mat,)`` (the tokens each matrix saw)."""

    sums: np.ndarray
    counts: np.ndarray


def imatrix_gguf_bytes(entries: dict[str, ImatrixEntry], *, datasets: tuple[str, ...], chunk_count: int,
                       chunk_size: int) -> bytes:
    """The imatrix GGUF llama-imatrix writes for ``entries`` (see the module docstring), as bytes."""
    from ktconvert.formats.gguf_write import encode_kv, layout_gguf

    kv = [("general.type", encode_kv("general.type", 8, "imatrix")),
          ("imatrix.datasets", encode_kv("imatrix.datasets", 9, list(datasets), 8)),
          ("imatrix.chunk_count", encode_kv("imatrix.chunk_count", 4, int(chunk_count))),
          ("imatrix.chunk_size", encode_kv("imatrix.chunk_size", 4, int(chunk_size)))]
    tensors, blobs = [], []
    for name in sorted(entries):
        e = entries[name]
        n_mat = int(e.counts.size)
        sums = np.ascontiguousarray(e.sums, dtype="<f4").reshape(n_mat, -1)
        for suffix, data, ne in ((".in_sum2", sums, (sums.shape[1], n_mat)),
                                 (".counts", np.ascontiguousarray(e.counts, dtype="<f4"), (1, n_mat))):
            ne = ne[:1] if ne[1] == 1 else ne  # ggml_n_dims: trailing 1s are not written
            tensors.append((name + suffix, ne, _F32, data.nbytes))
            blobs.append(data.tobytes())
    header, slots, size = layout_gguf(kv, tensors)
    out = bytearray(size)
    out[: len(header)] = header
    for slot, blob in zip(slots, blobs):
        out[slot.offset: slot.offset + len(blob)] = blob
    return bytes(out)


__all__ = ["Imatrix", "ImatrixEntry", "imatrix_gguf_bytes", "read_imatrix"]
