"""Shared fixtures. Tests that read ../shared skip cleanly when it is absent (a user's clone has none)."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
CORPUS = SHARED / "corpus" / "ktransformers-optimize-rules"


@pytest.fixture(scope="session")
def corpus_dir() -> Path:
    if not CORPUS.is_dir():
        pytest.skip("the upstream rule corpus (../shared/corpus) is not beside this checkout")
    return CORPUS
