"""One checkpoint, whatever its container: tensor names and infos from the headers, data read lazily per tensor.

Opening reads and validates headers only. :meth:`Checkpoint.read` memory-maps one tensor at a time (random
access); :meth:`Checkpoint.read_rows` reads a run of whole rows with large ``pread`` calls into a reused buffer
(a conversion's reads: no page faults). Nothing ever loads a whole file, so a 700 GB checkpoint opens in the time
it takes to read its headers.
"""

from __future__ import annotations

import hashlib
import mmap
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ktconvert.errors import InputError
from ktconvert.formats import gguf_header as gh
from ktconvert.formats.safetensors_header import parse_safetensors_header
from ktconvert.formats.sources import Source, resolve
from ktconvert.formats.tensor_info import TensorInfo
from ktconvert.io.files import ReadBuffer, read_direct, read_exact, regular_file_size
from ktconvert.io.dtypes import (
    SAFETENSORS_DTYPES,
    decode_float32,
    ggml_block,
    ggml_decode_float32,
    ggml_is_known,
    ggml_type_name,
    ggml_view_dtype_and_shape,
)

if TYPE_CHECKING:
    from ktconvert.formats.config import ModelDims


@contextmanager
def _mapped(path: Path):
    """The whole file as a read-only buffer (an mmap: touching the header does not page in the data)."""
    regular_file_size(path, "checkpoint file")
    try:
        with open(path, "rb") as fh:
            size = fh.seek(0, 2)
            if size == 0:
                raise InputError("file is empty", path=str(path), fix="re-download or re-export it")
            with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                yield mm
    except IsADirectoryError:
        raise InputError("is a directory, expected a file", path=str(path)) from None
    except PermissionError:
        raise InputError("permission denied", path=str(path), fix="check file permissions") from None


class Checkpoint(Mapping):
    """A read-only view of a checkpoint: a mapping of tensor name -> :class:`TensorInfo`, plus lazy data access.

    It holds no open files: headers are parsed at open time and every :meth:`read` maps its own tensor, so there is
    nothing to close.

    ``container`` is ``"safetensors"`` or ``"gguf"``. ``metadata`` holds the GGUF KV pairs of the first file
    (scalars and strings as Python values, arrays as :class:`~ktconvert.formats.gguf_header.GGUFArray`, complete
    via :meth:`kv`) or the merged safetensors ``__metadata__``. ``config`` is the ``config.json`` found next to the
    checkpoint, if any. ``notes`` are oddities that are not errors (e.g. a tensor a shard holds but the index omits).
    ``llama_names``: tensors carry llama.cpp names (a GGUF, or kernel-order safetensors with ``.ggml_type``
    companions, whose ggml-block tensors are described by their ggml type and element shape, as in a GGUF).
    """

    def __init__(
        self,
        source: Source,
        tensors: dict[str, TensorInfo],
        metadata: dict,
        notes: list[str],
        path: Path,
        gguf_version: int | None = None,
        packed: tuple = ({}, [], {}),
    ):
        self.path = path
        self.gguf_version = gguf_version
        self.container = source.container
        self.files = source.files
        self.index = source.index
        self.config_path = source.config
        self.metadata = metadata
        self.notes = notes
        self._tensors = tensors
        # packed release weights (formats.quantized): logical name -> Packed, the malformed ones, and the stored
        # tensor info behind each logical name (what read() hands out)
        self.packed, self.packed_bad, self._stored = packed
        self.packed_parts = frozenset(n for p in [*self.packed.values(), *self.packed_bad] for _, n in p.parts)
        self._config: dict | None = None
        self.read_config = None  # who reads config.json when first asked (a Release: its one read), else load_config
        # per safetensors file: its size and the sha256 of its header (8-byte length + JSON), taken as it was parsed
        self.headers: dict[str, dict] = {}
        self.llama_names = self.container == "gguf" or any(n.endswith(COMPANION) for n in tensors)

    # Mapping protocol ---------------------------------------------------------------------------------------------
    def __getitem__(self, name: str) -> TensorInfo:
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def __repr__(self) -> str:
        return f"Checkpoint({str(self.path)!r}, {self.container}, {len(self)} tensors, {len(self.files)} files)"

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self._tensors.values())

    @property
    def architecture(self) -> str | None:
        """llama.cpp architecture name from GGUF metadata or config.json ``model_type``; ``None`` if neither says."""
        arch = self.metadata.get("general.architecture") if self.container == "gguf" else None
        if isinstance(arch, str):
            return arch
        return self.dims().arch

    @property
    def config(self) -> dict | None:
        if self._config is None and self.config_path is not None:
            from ktconvert.formats.config import load_config  # its families: not for a worker that only reads data

            self._config = self.read_config() if self.read_config is not None else load_config(self.config_path)
        return self._config

    def dims(self, config: str | Path | dict | None = None) -> ModelDims:
        """Expected dims: from ``config`` if given, else config.json next to the checkpoint, else GGUF metadata."""
        from ktconvert.formats.config import ModelDims, dims_from_gguf, dims_from_hf_config, load_config

        if isinstance(config, dict):
            return dims_from_hf_config(config, "config")
        if config is not None:
            return dims_from_hf_config(load_config(config), str(config))
        if self.config is not None:
            return dims_from_hf_config(self.config, str(self.config_path))
        if self.container == "gguf":
            return dims_from_gguf(self.metadata, path=str(self.files[0]))
        return ModelDims(source="none")

    def kv(self, key: str):
        """A metadata value with arrays read in full (vocabularies are only read here, on demand)."""
        value = self.metadata[key]
        if isinstance(value, gh.GGUFArray):
            with _mapped(self.files[0]) as mm:
                return gh.read_array(mm, value)
        return value

    # Data --------------------------------------------------------------------------------------------------------
    def _layout(self, name: str) -> tuple[TensorInfo, np.dtype, tuple[int, ...]]:
        """The stored info of ``name`` and the dtype and shape :meth:`read` hands its data out as."""
        info = self._stored.get(name) or self._info(name)
        if info.ggml_type is None:
            d = SAFETENSORS_DTYPES[info.dtype]
            dtype = d.raw
            shape = info.shape if d.bits == 8 * dtype.itemsize else (info.nbytes,)
        else:
            dtype, shape = ggml_view_dtype_and_shape(info.ne, info.ggml_type)
        return info, np.dtype(dtype), tuple(shape)

    def read(self, name: str) -> np.ndarray:
        """The tensor's stored data as a read-only memory-mapped array; nothing is read until it is touched.

        Numpy-native types come with their numpy dtype and ``info.shape``. BF16 comes as ``uint16`` bits with the
        element shape; float8 as ``uint8`` with the element shape; packed sub-byte safetensors types as a flat
        ``uint8`` array; ggml block types as ``uint8`` shaped ``(*shape[:-1], row_bytes)``, so ``a[e]`` is the byte
        slab of expert ``e`` of a merged expert tensor.

        For random access (a few rows, a column band). Code that reads runs of whole rows in order (a
        conversion) uses :meth:`read_rows`, which reads them with large ``pread`` calls instead of page faults.
        """
        info, dtype, shape = self._layout(name)
        if info.nbytes == 0:
            out = np.empty(shape, dtype)
            out.flags.writeable = False
            return out
        try:
            return np.memmap(info.file, dtype=dtype, mode="r", offset=info.offset, shape=shape)
        except OSError as exc:
            raise InputError(f"cannot map tensor data: {exc.strerror}", path=str(info.file), where=f"tensor {name}") from None

    def rows(self, name: str) -> int:
        """How many flat rows :meth:`read_rows` counts in ``name`` (every axis but the last; a 0-/1-D tensor is one)."""
        _, _, shape = self._layout(name)
        return int(np.prod(shape[:-1])) if len(shape) > 1 else 1

    def read_rows(self, name: str, r0: int, r1: int, buf: ReadBuffer | None = None, *,
                  direct: bool = False) -> np.ndarray:
        """Flat rows ``r0..r1`` of the stored data (``read(name)`` seen as ``(rows, last axis)``, a 0-/1-D tensor as
        one row) as a 2-D array, read from the file with large ``pread`` calls into ``buf`` (reused: the array is
        only valid until ``buf``'s next use) or, without one, into a new array.

        Rows are contiguous in the file, so this is one read of exactly their bytes: no mapping, no page faults,
        and the same bytes whatever reads them (``read`` and ``read_rows`` agree byte for byte). ``direct`` (with
        ``buf``): read around the page cache (:func:`ktconvert.io.files.read_direct`) where the filesystem allows it,
        for bytes read once, in reads large enough to keep the disk busy without the kernel's readahead."""
        info, dtype, shape = self._layout(name)
        cols = shape[-1] if shape else 1
        nbytes = (r1 - r0) * cols * dtype.itemsize
        start = info.offset + r0 * cols * dtype.itemsize
        if direct and buf is not None and nbytes and start % dtype.itemsize == 0:  # aligned values stay aligned
            out = read_direct(info.file, start, nbytes, buf, what="checkpoint file", where=f"tensor {name}")
            if out is not None:
                return out.view(dtype).reshape(r1 - r0, cols)
        out = buf.take(nbytes) if buf is not None else np.empty(nbytes, np.uint8)
        if nbytes:
            read_exact(info.file, start, out, what="checkpoint file",
                       where=f"tensor {name}")
        return out.view(dtype).reshape(r1 - r0, cols)

    def read_all(self) -> dict[str, np.ndarray]:
        """Every tensor's stored data as a writable copy (same dtypes and shapes as :meth:`read`), for callers that
        load a whole checkpoint (the reference models): one read per tensor, no mapping."""
        out: dict[str, np.ndarray] = {}
        for name in self._tensors:
            _, _, shape = self._layout(name)
            out[name] = self.read_rows(name, 0, self.rows(name)).reshape(shape)
        return out

    def read_float32(self, name: str, index: int | slice | None = None) -> np.ndarray:
        """The tensor (or ``[index]`` along its first axis: one expert, a block of rows) decoded to a float32 copy."""
        info = self._info(name)
        if name in self.packed:  # a packed release weight: its exact decoding
            from ktconvert.formats.quantized import n_rows, read_float32, read_rows

            p = self.packed[name]
            if index is None:
                return read_float32(self, p)
            per = n_rows(p) // p.shape[0]  # flat rows per index of the first axis (one expert of a stacked weight)
            r = range(p.shape[0])[index]
            if isinstance(r, int):
                return read_rows(self, p, r * per, (r + 1) * per).reshape(p.shape[1:])
            if r.step != 1:
                return read_float32(self, p)[index]
            return read_rows(self, p, r.start * per, r.stop * per).reshape(len(r), *p.shape[1:])
        raw = self.read(name)
        if index is not None:
            raw = raw[index]
        try:
            if info.ggml_type is None:
                return decode_float32(raw, info.dtype)
            return ggml_decode_float32(raw, info.ggml_type)
        except (NotImplementedError, ValueError) as exc:
            raise InputError(
                f"cannot decode {info.dtype} to float32 ({exc})",
                path=str(info.file),
                where=f"tensor {name}",
                fix="this type can be inspected but not decoded yet",
            ) from None

    def _info(self, name: str) -> TensorInfo:
        try:
            return self._tensors[name]
        except KeyError:
            raise InputError(f"no tensor named {name!r}", path=str(self.path), fix="list names with ktconvert inspect") from None


def _add(tensors: dict, info: TensorInfo, fix: str) -> None:
    """Shards must not repeat a tensor: which copy a loader takes would depend on file order."""
    if info.name in tensors:
        raise InputError(f"tensor also stored in {tensors[info.name].file.name}", path=str(info.file),
                         where=f"tensor {info.name}", fix=fix)
    tensors[info.name] = info


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Open a ``.safetensors`` file, a sharded directory or its ``*.safetensors.index.json``, a ``.gguf`` file, or a
    split GGUF set (any shard or the directory); validate every header; raise :class:`InputError` when unusable."""
    source = resolve(path)
    opener = _open_gguf if source.container == "gguf" else _open_safetensors
    headers: dict[str, dict] = {}
    tensors, metadata, notes, version = opener(source, headers)
    packed = ({}, [], {})
    if source.container == "safetensors":
        from ktconvert.formats.quantized import overlay, present_packed

        good, bad = present_packed(tensors, _read_small)
        packed = (good, bad, overlay(tensors, good))
    ck = Checkpoint(source, tensors, metadata, notes, Path(path), version, packed)
    ck.headers = headers
    return ck


def _read_small(info: TensorInfo) -> list[int] | None:
    """The values of a tiny integer tensor (a packed weight's ``weight_shape``), read straight from its file."""
    if info.nbytes > 64 or info.dtype not in ("I32", "I64"):
        return None
    with open(info.file, "rb") as fh:
        fh.seek(info.offset)
        return np.frombuffer(fh.read(info.nbytes), dtype="<i4" if info.dtype == "I32" else "<i8").tolist()


#: The I32 scalar beside each tensor of a kernel-order safetensors file (ktconvert's ``--to safetensors``,
#: ktransformers' SafeTensorLoader): the tensor's ggml type id, its bytes stored as U8 rows.
COMPANION = ".ggml_type"


def _kernel_order(tensors: dict[str, TensorInfo]) -> None:
    """Describe each U8 tensor that has a ``.ggml_type`` companion as what it holds (ggml type and element shape,
    as a GGUF would), so inspect, check-rules --weights and the readers see the tensor the file means."""
    for cname in [n for n in tensors if n.endswith(COMPANION)]:
        c = tensors[cname]
        base = cname[: -len(COMPANION)]
        name = base + ".weight" if base + ".weight" in tensors else base
        info = tensors.get(name)
        if c.dtype != "I32" or c.nbytes != 4:
            raise InputError(f"a {COMPANION} companion must be one I32, not {c.dtype} {list(c.shape)}",
                             path=str(c.file), where=f"tensor {cname}", fix="re-export the file with ktconvert quantize")
        if info is None:
            continue
        with open(c.file, "rb") as fh:
            fh.seek(c.offset)
            tid = int.from_bytes(fh.read(4), "little", signed=True)
        if not ggml_is_known(tid):
            raise InputError(f"{COMPANION} holds {tid}, which is no ggml type", path=str(c.file),
                             where=f"tensor {cname}", fix="re-export the file with ktconvert quantize")
        if info.dtype != "U8":  # stored as floats: the companion must say the same float type
            if ggml_type_name(tid) != info.dtype:
                raise InputError(f"{COMPANION} says {ggml_type_name(tid)} but {name} is stored as {info.dtype}",
                                 path=str(c.file), where=f"tensor {cname}",
                                 fix="re-export the file with ktconvert quantize")
            continue
        block, size = ggml_block(tid)
        row = info.shape[-1] if info.shape else 0
        if not row or row % size:
            raise InputError(f"rows of {row} bytes do not hold whole {ggml_type_name(tid)} blocks of {size} bytes",
                             path=str(info.file), where=f"tensor {name}", fix="re-export the file with ktconvert quantize")
        tensors[name] = TensorInfo(name, (*info.shape[:-1], row // size * block), ggml_type_name(tid), tid,
                                   info.file, info.offset, info.nbytes)


def _open_safetensors(source: Source, headers: dict) -> tuple[dict[str, TensorInfo], dict, list[str], None]:
    tensors: dict[str, TensorInfo] = {}
    metadata: dict = {}
    notes: list[str] = []
    for f in source.files:
        with _mapped(f) as mm:
            header = parse_safetensors_header(mm, str(f))
            n = 8 + int.from_bytes(mm[:8], "little")
            headers[f.name] = {"bytes": len(mm), "header_sha256": hashlib.sha256(mm[:n]).hexdigest()}
        metadata.update(header.metadata)
        if header.uncovered:
            a, b = header.uncovered[0]
            notes.append(
                f"{f.name}: {sum(e - s for s, e in header.uncovered)} byte(s) belong to no tensor (first: bytes {a}..{b}); "
                "the safetensors library and transformers refuse such files; re-export it"
            )
        for e in header.entries:
            _add(tensors, TensorInfo(e.name, e.shape, e.dtype, None, f, e.begin, e.end - e.begin),
                 "two shards hold the same tensor; remove the stray file")
    if source.weight_map is not None:
        for name, shard in source.weight_map.items():
            info = tensors.get(name)
            if info is None or info.file.name != shard:
                raise InputError(
                    f"index says shard {shard} holds this tensor, but "
                    + ("no shard does" if info is None else f"it is in {info.file.name}"),
                    path=str(source.index),
                    where=f"tensor {name}",
                    fix="the index and the shards do not belong together; re-download them",
                )
        extra = [n for n in tensors if n not in source.weight_map]
        if extra:
            notes.append(f"{len(extra)} tensor(s) in the shards are not in the index (e.g. {extra[0]}); loaders skip them")
    _kernel_order(tensors)
    return tensors, metadata, notes, None


def _open_gguf(source: Source, headers: dict) -> tuple[dict[str, TensorInfo], dict, list[str], int | None]:
    tensors: dict[str, TensorInfo] = {}
    metadata: dict = {}
    notes: list[str] = []
    version = None
    count = len(source.files)
    for i, f in enumerate(source.files):
        with _mapped(f) as mm:
            header = gh.parse_gguf_header(mm, str(f))
        if i == 0:
            metadata = dict(header.kv)
            version = header.version
        if count > 1:
            no, n = header.kv.get("split.no"), header.kv.get("split.count")
            if n != count or no != i:
                raise InputError(
                    f"split.no/split.count say shard {no + 1 if type(no) is int else no} of {n}, "
                    f"but the file name says shard {i + 1} of {count}",
                    path=str(f),
                    where="split.no",
                    fix="the shards come from different conversions; re-download the set",
                )
        for t in header.tensors:
            _add(tensors, TensorInfo(t.name, tuple(reversed(t.ne)), ggml_type_name(t.ggml_type), t.ggml_type, f,
                                     t.begin, t.nbytes),
                 "two shards hold the same tensor; re-download the set")
    expected = metadata.get("split.tensors.count")
    if count > 1 and type(expected) is int and expected != len(tensors):
        raise InputError(
            f"split set holds {len(tensors)} tensors but its metadata promises {expected}",
            path=str(source.files[0]),
            where="split.tensors.count",
            fix="a shard is truncated or from another conversion; re-download the set",
        )
    return tensors, metadata, notes, version
