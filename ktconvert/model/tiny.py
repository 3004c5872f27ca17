"""Deterministic tiny checkpoints of every MoE family, written to disk: the plain, FP8, release-format and
variant checkpoints and the tiny MoE LoRA adapter.

The configs, tensors and file bytes are :mod:`ktconvert.model.tiny_weights` (re-exported here, where callers have
always found them); the release formats are :mod:`ktconvert.model.tiny_release` and the adapter
:mod:`ktconvert.model.tiny_lora`, both built on ``tiny_weights``, so the three import in one direction.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from ktconvert.errors import UsageProblem
from ktconvert.io.atomic import sha256_file, write_dirs
from ktconvert.model.tiny_lora import tiny_lora_files
from ktconvert.model.tiny_release import tiny_release_files
from ktconvert.model.tiny_weights import (  # noqa: F401 (re-exported: callers find them here)
    BOS_ID,
    EOS_ID,
    FP8_VARIANTS,
    TINY_VARIANTS,
    VOCAB,
    router_permutation,
    routing_channels,
    tensor_specs,
    tiny_config,
    tiny_files,
    tiny_fp8_files,
    tiny_name,
    tiny_tensors,
    token_codes,
)


def write_tiny_model(family: str, out_dir: str | os.PathLike, *, force: bool = False,
                     fp8: bool = False, quant: str | None = None, variant: str | None = None) -> dict[str, str]:
    """Write the tiny checkpoint into ``out_dir`` (atomically: a sibling temp dir renamed into place); with
    ``fp8`` its FP8 block-scaled variant (:func:`tiny_fp8_files`), with ``quant`` a release format
    (:mod:`ktconvert.model.tiny_release`).

    Returns ``{file name: sha256}``. An existing non-empty ``out_dir`` is replaced only with ``force``.
    """
    return write_tiny(family, out_dir, force=force, fp8=fp8, quant=quant, variant=variant)[0]


def write_tiny(family: str, out_dir: str | os.PathLike, *, lora_dir: str | os.PathLike | None = None,
               force: bool = False, fp8: bool = False, quant: str | None = None,
               variant: str | None = None) -> tuple[dict[str, str], dict[str, str] | None]:
    """:func:`write_tiny_model`, and with ``lora_dir`` the tiny MoE LoRA adapter too; both outputs are checked
    (neither inside the other, each new or ``force``) before either is written. ``(model sha256s, adapter's)``."""
    if fp8 and variant is not None:
        raise UsageProblem("--fp8 and --variant do not combine", fix="ask for one of them (--quant takes a variant)")
    if quant is not None:
        files = tiny_release_files(family, quant, variant=variant)
    else:
        files = tiny_fp8_files(family) if fp8 else tiny_files(family, variant)
    outputs = [(Path(out_dir), files)]
    if lora_dir is not None:
        outputs.append((Path(lora_dir), tiny_lora_files(family)))
    write_dirs(outputs, force=force)
    hashes = [{name: hashlib.sha256(data).hexdigest() for name, data in sorted(f.items())} for _, f in outputs]
    return hashes[0], (hashes[1] if lora_dir is not None else None)


def file_hashes(model_dir: str | os.PathLike, names: list[str] | None = None) -> dict[str, str]:
    """sha256 of files of a checkpoint directory (all regular files when ``names`` is None)."""
    root = Path(model_dir)
    paths = [root / n for n in names] if names else sorted(p for p in root.iterdir() if p.is_file())
    return {p.name: sha256_file(p) for p in paths}
