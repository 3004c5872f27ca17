"""The vocabulary of a conversion plan: an output tensor of the source's analysis (:class:`Item`) and the input rows
that fill it (:class:`Segment`), and the plan itself (:class:`Plan`: its :class:`PlanTensor` s and :class:`OutFile` s).
:mod:`ktconvert.convert.source` explains the segment kinds and makes them from a checkpoint, :mod:`ktconvert.convert.plan`
makes the plan; the planners (``imatrix_plan`` too), workers and writers read them.
"""

from __future__ import annotations

import math

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ktconvert import __version__

if TYPE_CHECKING:
    from ktconvert.convert.recipe import Recipe


@dataclass(frozen=True)
class Segment:
    """Output rows ``[start, start + rows)`` of an item come from input tensor ``source``.

    ``rows``: from source flat rows starting at ``src_row``. ``transpose``: from columns ``src_col ..`` of the
    2-D slab ``source[expert]``. ``permute``: from source rows reordered per llama.cpp's rope layout with
    ``heads`` heads (``src_row`` is 0: the whole tensor is one segment). ``scale``/``block``/``fmt``: the source
    is a quantized release weight (:mod:`ktconvert.formats.quantized`) of format ``fmt``, decoded exactly with
    that scale tensor (and block size, for the FP8 family; a packed weight's companions come with it).
    """

    start: int
    rows: int
    source: str
    op: str = "rows"
    src_row: int = 0
    expert: int = 0
    src_col: int = 0
    heads: int = 0
    scale: str = ""
    block: tuple[int, ...] = ()
    fmt: str = ""
    parts: int = 0  # kt-amx: the expert projection's part count (``source`` names part 0's weight)
    method: str = ""  # kt-amx: AMXINT8 / AMXINT4
    lora: tuple = ()  # (A file, A name, A index or -1, B file, B name, B index or -1, alpha/r): + scale * B[rows] @ A
    col_step: int = 0  # rows/transpose: every col_step-th source column from src_col (0: contiguous)
    value: str = ""  # elementwise map after decoding: add_one / neg_exp (formats.transforms)
    col_tile: tuple[int, ...] = ()  # (key heads, value heads per key head, width): columns grouped -> tiled
    t_rows: int = 0  # block_t: output rows are the columns of source rows [src_row, src_row + t_rows)

    def to_dict(self) -> dict:
        d = {"rows": [self.start, self.start + self.rows], "source": self.source, "op": self.op}
        if self.col_step:
            d.update(source_col=self.src_col, col_step=self.col_step)
        if self.op == "kt-amx":
            d.update(parts=self.parts, method=self.method, source_rows=[self.src_row, self.src_row + self.rows])
        elif self.op == "rows":
            d["source_rows"] = [self.src_row, self.src_row + self.rows]
        elif self.op == "transpose":
            d.update(expert=self.expert, source_cols=[self.src_col, self.src_col + self.rows])
        elif self.op == "block_t":
            d.update(source_rows=[self.src_row, self.src_row + self.t_rows], source_cols=[0, self.rows])
        else:
            d["heads"] = self.heads
        if self.scale:
            d.update(scale=self.scale, block=list(self.block), format=self.fmt)
        if self.lora:
            d["lora"] = {"A": [self.lora[1], self.lora[2]], "B": [self.lora[4], self.lora[5]], "scale": self.lora[6]}
        if self.value:
            d["value"] = self.value
        if self.col_tile:
            d["col_tile"] = list(self.col_tile)
        return d


@dataclass(frozen=True)
class Item:
    """One output tensor before a type is chosen. ``shape`` is numpy order (ggml ``ne`` is its reverse);
    ``src_dtype`` the storage type shared by every source (``"mixed"`` when they differ); ``hf_name`` the
    canonical Hugging Face name recipes may match (``*`` for the expert of a stacked expert tensor)."""

    name: str
    hf_name: str | None
    shape: tuple[int, ...]
    segments: tuple[Segment, ...]
    src_dtype: str
    group: str
    layer: int | None = None
    projection: str | None = None

    @property
    def rows(self) -> int:
        return math.prod(self.shape[:-1])

    @property
    def row_len(self) -> int:
        return self.shape[-1] if self.shape else 1

    @property
    def reshaped(self) -> bool:
        """Whether rows are reordered or values changed (transpose/permute, picked or tiled columns, a value map):
        then bytes cannot be copied block for block."""
        return any(s.op != "rows" or s.col_step or s.value or s.col_tile for s in self.segments)


@dataclass(frozen=True)
class PlanTensor:
    """One output tensor. ``type`` is a ggml type name; ``st_dtype``/``st_shape`` how a safetensors output
    stores it (quantized types as U8 bytes); ``copy_bytes`` means its source bytes are copied unchanged;
    ``const`` holds the bytes of a small generated tensor (the ``.ggml_type`` companions)."""

    name: str
    shape: tuple[int, ...]
    type: str
    nbytes: int
    file: int
    offset: int
    segments: tuple[Segment, ...] = ()
    copy_bytes: bool = False
    rule: int | None = None
    fallback_from: str | None = None
    hf_name: str | None = None
    group: str = ""
    layer: int | None = None
    src_dtype: str = ""
    st_dtype: str | None = None
    st_shape: tuple[int, ...] | None = None
    const: bytes | None = None
    kt_pack: tuple | None = None  # kt-amx: (method, proj, parts, rows, cols, group bytes) of a group's lead tensor
    written_by: str | None = None  # kt-amx: the lead tensor whose unit writes this one
    imatrix: str | None = None  # quantize --imatrix: the importance-matrix file this tensor's entry is read from

    @property
    def rows(self) -> int:
        return math.prod(self.shape[:-1])

    @property
    def row_bytes(self) -> int:
        return self.nbytes // self.rows if self.rows else 0

    def operation(self) -> str:
        if self.const is not None:
            return "generated"
        if self.written_by is not None:
            return f"written with {self.written_by}"
        if self.kt_pack is not None:
            return f"kt-kernel {self.kt_pack[0]} pack into {self.kt_pack[2]} part(s), {self.src_dtype} -> bf16 -> {self.type}"
        ops = Counter(s.op for s in self.segments)
        n_src = len({s.source for s in self.segments})
        if ops.get("kt-amx"):
            what = f"unpack {ops['kt-amx']} kt-amx expert(s)"
        elif ops.get("transpose"):
            what = f"transpose {ops['transpose']} expert slab(s)"
        elif ops.get("permute"):
            what = "reorder rows for llama.cpp's rope (q/k)"
        elif n_src > 1:
            what = f"stack {n_src} tensors"
        elif len(self.segments) > 1:
            what = f"gather {len(self.segments)} row ranges"
        else:
            what = "rename"
        return f"{what}, {'copy bytes' if self.copy_bytes else f'{self.src_dtype} -> {self.type}'}"

    def to_dict(self) -> dict:
        d = {"name": self.name, "type": self.type, "shape": list(self.shape), "ne": list(reversed(self.shape)),
             "bytes": self.nbytes, "file": self.file, "offset": self.offset, "operation": self.operation()}
        if self.const is None:
            d["sources"] = sorted({s.source for s in self.segments})
            d["segments"] = [s.to_dict() for s in self.segments]
            d["copy_bytes"] = self.copy_bytes
        if self.rule is not None:
            d["rule"] = self.rule
        if self.fallback_from:
            d["fallback_from"] = self.fallback_from
        if self.kt_pack is not None:
            d["kt_pack"] = list(self.kt_pack)
        if self.written_by is not None:
            d["written_by"] = self.written_by
        if self.imatrix:
            d["imatrix"] = True
        if self.st_dtype:
            d["safetensors"] = {"dtype": self.st_dtype, "shape": list(self.st_shape)}
        return d


@dataclass(frozen=True)
class OutFile:
    """One output file: its name inside the output directory, the header written first, its final size."""

    name: str
    header: bytes
    size: int


@dataclass
class Plan:
    """Everything a conversion will do. ``extra`` are small files written verbatim (``name -> bytes``): the
    copied ``config.json`` and tokenizer files of a safetensors output, and its shard index."""

    source: str
    container: str
    arch: str
    model_type: str | None
    format: str
    recipe: Recipe
    tensors: list[PlanTensor]
    files: list[OutFile]
    extra: dict[str, bytes] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    sources: list[dict] = field(default_factory=list)
    kv_keys: list[str] = field(default_factory=list)
    tokenizer: str = ""
    input_files: list[str] = field(default_factory=list)
    _in_bytes: dict = field(default_factory=dict, repr=False)  # input bytes read per output tensor
    lora: dict = field(default_factory=dict)  # the adapter merged in (quantize --lora): files and sha256, r, alpha
    imatrix: dict = field(default_factory=dict)  # quantize --imatrix: the file's sha256, entries, experts without data
    extra_kv: list = field(default_factory=list)  # (key, encoded KV) appended to the GGUF's keys (quantize.imatrix.*)

    @property
    def in_bytes(self) -> int:
        return sum(self.segment_bytes(t) for t in self.tensors)

    @property
    def out_bytes(self) -> int:
        return sum(f.size for f in self.files) + sum(len(b) for b in self.extra.values())

    def segment_bytes(self, t: PlanTensor) -> int:
        return 0 if t.const is not None else self._in_bytes.get(t.name, 0)

    def fingerprint(self) -> str:
        """sha256 over everything that decides the output bytes (not over options that only change speed)."""
        core = {
            "version": __version__,
            "unit_digest": "checksum64",  # what the journal records per unit (a partial run of another kind is refused)
            "format": self.format,
            "sources": self.sources,
            "files": [{"name": f.name, "size": f.size, "header": hashlib.sha256(f.header).hexdigest()} for f in self.files],
            "tensors": [t.to_dict() for t in self.tensors],
            "extra": {k: hashlib.sha256(v).hexdigest() for k, v in sorted(self.extra.items())},
            **({"lora": self.lora} if self.lora else {}),
            **({"imatrix": self.imatrix} if self.imatrix else {}),
        }
        return hashlib.sha256(json.dumps(core, sort_keys=True).encode()).hexdigest()

    def fallbacks(self) -> list[dict]:
        """Every tensor written as a fallback type: name, the type asked for, the type written, its row length."""
        return [{"tensor": t.name, "asked": t.fallback_from, "written": t.type, "row": t.shape[-1] if t.shape else 1}
                for t in self.tensors if t.fallback_from]

    def summary(self) -> dict:
        types: Counter = Counter()
        counts: Counter = Counter()
        for t in self.tensors:
            if t.const is None:
                types[t.type] += t.nbytes
                counts[t.type] += 1
        return {
            "source": self.source, "container": self.container, "arch": self.arch, "model_type": self.model_type,
            "format": self.format, "recipe": self.recipe.name, "recipe_source": self.recipe.source,
            "tensors": sum(1 for t in self.tensors if t.const is None), "input_bytes": self.in_bytes,
            "output_bytes": self.out_bytes, "files": [{"name": f.name, "bytes": f.size} for f in self.files]
            + [{"name": k, "bytes": len(v)} for k, v in self.extra.items()],
            "types": {k: {"tensors": counts[k], "bytes": v} for k, v in sorted(types.items())},
            "tokenizer": self.tokenizer, "notes": list(self.notes), "fallbacks": self.fallbacks(),
        }

    def to_dict(self) -> dict:
        return {**self.summary(), "recipe_rules": [
            {"index": r.index, "match": r.match, "type": r.type, "fallback": list(r.fallback),
             **({"layers": r.layers if isinstance(r.layers, str) else list(r.layers)} if r.layers else {}),
             **({"when": {k: list(v) if isinstance(v, tuple) else v for k, v in r.when}} if r.when else {}),
             "where": r.where} for r in self.recipe.rules],
            "output_tensors": [{**t.to_dict(), "file": self.files[t.file].name} for t in self.tensors]}


# --- types -----------------------------------------------------------------------------------------------------------
