"""Locates the data the tool ships (schemas, rule files, catalogs) in a checkout and in an installed wheel alike."""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources
from pathlib import Path


def _root(package: str) -> Path:
    return Path(str(resources.files(package)))


def schemas_dir() -> Path:
    return _root("ktconvert._schemas")


def rules_dir() -> Path:
    return _root("ktconvert._rules")


@lru_cache(maxsize=None)
def load_schema(name: str) -> dict:
    """Load ``schemas/<name>.schema.json`` (cached: schemas are immutable data)."""
    with open(schemas_dir() / f"{name}.schema.json", encoding="utf-8") as fh:
        return json.load(fh)
