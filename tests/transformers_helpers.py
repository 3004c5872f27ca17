"""transformers as the reference tests use it: version 5.23, which the goldens, the tiny configs' spelling and the
reference blocks were checked against; any other version (or none) skips the test with the reason."""

from __future__ import annotations

import importlib

import pytest


def transformers_523(pinned: str = "compared with transformers 5.23"):
    transformers = pytest.importorskip("transformers")
    if not transformers.__version__.startswith("5.23."):
        pytest.skip(f"{pinned}, found {transformers.__version__}")
    return transformers


def modeling_523(model_type: str):
    """``(transformers, transformers.models.<model_type>.modeling_<model_type>)``."""
    transformers = transformers_523()
    return transformers, importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
