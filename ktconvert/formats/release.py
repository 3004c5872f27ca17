"""A release opened once: the model directory (or checkpoint file) with its config, family, weights and their decoding.

``verify``, ``golden`` and ``imatrix`` build one :class:`Release` at their entry and hand it down to every layer
that reads the model (the weight sources and providers of :mod:`ktconvert.model`, the golden's records and hashes);
each reads what it needs from it, and each thing is read once, when first asked for:

* ``config.json``: read once; its bytes give :attr:`Release.config_sha256`, the same bytes parsed give
  :attr:`Release.raw` (counts checked) and :attr:`Release.config` (the normalised :class:`MoeConfig`, whose
  ``spec`` is the family spec);
* the weights: :attr:`Release.checkpoint` validates every header once (and records each safetensors header's hash,
  :meth:`Release.source_records`); :attr:`Release.quant` is the quantized-release analysis of those headers (the
  decoding every reader applies), :attr:`Release.qmap` the same, refused when it has a problem;
* whole-file hashes (:meth:`Release.file_sha256`, for goldens that record them) are taken once per file;
* :attr:`Release.tokenizer_files`: the tokenizer files present (their reading belongs to the tokenizer).

Functions that take a model directory take a :class:`Release` as well (:func:`open_release` passes one through).
"""

from __future__ import annotations

import hashlib
import math
import os
from functools import cached_property
from pathlib import Path

from ktconvert.errors import InputError
from ktconvert.families.config import MoeConfig, normalize_config
from ktconvert.formats.checkpoint import Checkpoint, open_checkpoint
from ktconvert.formats.config import checked_config
from ktconvert.io.atomic import sha256_file
from ktconvert.io.datafile import parse_json, read_json_bytes

CONFIG_FIX = "pass a model directory that holds config.json"
#: the files a Hugging Face tokenizer reads, those a golden records the hashes of
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json",
                   "merges.txt")


class Release:
    """One model directory (or checkpoint file with its ``config.json`` beside it), each part read on first use."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        # a checkpoint file reads the config.json beside it; a directory (or a path that is not there) its own
        self.config_file = (self.path.parent if self.path.is_file() else self.path) / "config.json"
        self._hashes: dict[str, str] = {}

    def __repr__(self) -> str:
        return f"Release({str(self.path)!r})"

    def __fspath__(self) -> str:
        return str(self.path)

    def __str__(self) -> str:
        return str(self.path)

    # --- config.json ---------------------------------------------------------------------------------------------
    @cached_property
    def config_bytes(self) -> bytes:
        return read_json_bytes(self.config_file, "config.json", fix=CONFIG_FIX)

    @cached_property
    def config_sha256(self) -> str:
        return hashlib.sha256(self.config_bytes).hexdigest()

    @cached_property
    def raw(self) -> dict:
        """``config.json`` as written (its counts checked)."""
        where = str(self.config_file)
        return checked_config(parse_json(self.config_bytes, "config.json", shown=where, fix=CONFIG_FIX), where)

    @cached_property
    def config(self) -> MoeConfig:
        """The normalised config; ``config.spec`` is the family spec."""
        return normalize_config(self.raw, path=str(self.config_file))

    @cached_property
    def dims(self):
        """The dimensions an adapter is checked against (:func:`ktconvert.formats.config.dims_from_hf_config`)."""
        from ktconvert.formats.config import dims_from_hf_config

        return dims_from_hf_config(self.raw, str(self.config_file))

    # --- weights -------------------------------------------------------------------------------------------------
    @cached_property
    def checkpoint(self) -> Checkpoint:
        """Every weight file's header, validated once; tensor data is read lazily per tensor."""
        ck = open_checkpoint(self.path)
        if ck.config_path == self.config_file:
            ck.read_config = lambda: self.raw  # quantization_config and dims come from the one config read
        return ck

    @cached_property
    def quant(self):
        """:func:`ktconvert.formats.quantized.analyze` of the headers: the quantized weights and their scales."""
        from ktconvert.formats import quantized

        return quantized.analyze(self.checkpoint)

    @property
    def qmap(self):
        """:attr:`quant`, raising its first problem as one :class:`InputError` (what readers of the data need)."""
        from ktconvert.formats import quantized

        return quantized.require(self.checkpoint, path=str(self.path), analysis=self.quant)

    def float32_bytes(self) -> int:
        """What the whole model takes in float32 (logical sizes, quantized weights decoded; scales not counted)."""
        scales = self.quant.scales
        return 4 * sum(math.prod(info.shape) for name, info in self.checkpoint.items() if name not in scales)

    def source_records(self) -> dict[str, dict]:
        """Per safetensors file: its size and the sha256 of its header (8-byte length + JSON), which names and places
        every tensor (hashing a whole multi-hundred-gigabyte release would take longer than a run)."""
        return {name: dict(rec) for name, rec in self.checkpoint.headers.items()}

    def file_sha256(self, name: str) -> str:
        """sha256 of the whole file ``name`` of the directory (config.json from its one read), once per file."""
        if name == "config.json":
            return self.config_sha256
        got = self._hashes.get(name)
        if got is None:
            f = self.config_file.parent / name
            try:
                got = self._hashes[name] = sha256_file(f)
            except OSError as exc:
                raise InputError(f"cannot read: {exc.strerror}", path=str(f), fix="check the file") from None
        return got

    @property
    def tokenizer_files(self) -> list[Path]:
        root = self.config_file.parent
        return [root / n for n in TOKENIZER_FILES if (root / n).is_file()]


def open_release(path: str | os.PathLike | Release) -> Release:
    """``path`` as a :class:`Release` (one already opened is handed back as it is)."""
    return path if isinstance(path, Release) else Release(path)


def checkpoint_of(path: str | os.PathLike | Release) -> Checkpoint:
    """The checkpoint of a release already opened, else ``path`` opened (a converted file verify reads)."""
    return path.checkpoint if isinstance(path, Release) else open_checkpoint(path)
