"""Where the shipped golden data lives: ``golden/`` at the top of the repository, packaged as
``ktconvert._golden`` (editable installs map it to the checkout), one directory per golden plus
``tiny-models.yaml``."""

from __future__ import annotations

from functools import lru_cache
from importlib import resources
from pathlib import Path

from ktconvert.errors import EnvironmentProblem, InputError
from ktconvert.io.datafile import load_data_file

TINY_HASHES_NAME = "tiny-models.yaml"


def golden_root() -> Path:
    """The golden data directory, from package data when installed that way, else from the checkout."""
    try:
        root = Path(str(resources.files("ktconvert._golden")))
        if root.is_dir():
            return root
    except ModuleNotFoundError:
        pass
    raise EnvironmentProblem(
        "the golden data directory is not available in this installation",
        fix="run from a ktconvert checkout (golden/ at its top level)",
    )


def tiny_hashes_path() -> Path:
    return golden_root() / TINY_HASHES_NAME


@lru_cache(maxsize=1)
def _load(path: str) -> dict[str, dict[str, str]]:
    models = load_data_file(path, "tiny-models", "tiny-model hash list").data["models"]
    return {str(k): {str(f): str(h) for f, h in v.items()} for k, v in models.items()}


def load_tiny_hashes() -> dict[str, dict[str, str]]:
    """``{family: {file name: sha256}}`` recorded for the tiny models."""
    try:
        path = tiny_hashes_path()
    except EnvironmentProblem as exc:
        raise InputError(exc.message)
    return _load(str(path))
