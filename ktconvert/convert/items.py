"""The vocabulary of a conversion plan: an output tensor (:class:`Item`) and the input rows that fill it
(:class:`Segment`). :mod:`ktconvert.convert.source` explains the segment kinds and makes them from a checkpoint;
the planners, workers and writers read them.
"""

from __future__ import annotations

import math

from dataclasses import dataclass


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
