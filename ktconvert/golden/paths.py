"""Where the shipped golden data lives: ``golden/`` at the top of the repository, packaged as
``ktconvert._golden`` (editable installs map it to the checkout), one directory per golden plus
``tiny-models.yaml``."""

from __future__ import annotations

from functools import lru_cache
from importlib import resources
from pathlib import Path

import yaml

from ktconvert.errors import EnvironmentProblem, InputError

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
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise InputError(f"cannot read the tiny-model hashes: {exc}", path=path)
    models = data.get("models") if isinstance(data, dict) else None
    if not isinstance(models, dict) or not all(isinstance(v, dict) for v in models.values()):
        raise InputError("expected a mapping `models: {family: {file: sha256}}`", path=path)
    return {str(k): {str(f): str(h) for f, h in v.items()} for k, v in models.items()}


def load_tiny_hashes() -> dict[str, dict[str, str]]:
    """``{family: {file name: sha256}}`` recorded for the tiny models."""
    try:
        path = tiny_hashes_path()
    except EnvironmentProblem as exc:
        raise InputError(exc.message)
    return _load(str(path))
