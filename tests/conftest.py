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


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory) -> Path:
    """The five deterministic tiny models, written once for every test that reads them (none writes into them)."""
    from ktconvert.model import FAMILIES
    from ktconvert.model.tiny import write_tiny_model

    root = tmp_path_factory.mktemp("tiny")
    for family in FAMILIES:
        write_tiny_model(family, root / family)
    return root


@pytest.fixture(scope="session")
def llama_built():
    """llama-cpp-python built into the cache (tests/llamacpp_runner.py), for the interop and parity tiers: under CI
    a failed build fails them, elsewhere they skip with the reason."""
    import os

    import llamacpp_runner

    try:
        return llamacpp_runner.ensure_built()
    except llamacpp_runner.Unavailable as exc:
        if os.environ.get("CI"):
            pytest.fail(f"llama.cpp tiers required under CI: {exc}")
        pytest.skip(str(exc))


def _llama_tools(*need: str):
    """llama.cpp's tools ``need`` built into the cache (tests/llamacpp_tools.py): under CI a failed build fails the
    tests that need them, elsewhere they skip with the reason."""
    import os

    import llamacpp_tools
    from ggml_ref import RefUnavailable

    try:
        return llamacpp_tools.build(need)
    except RefUnavailable as exc:
        if os.environ.get("CI"):
            pytest.fail(f"llama.cpp's tools required under CI: {exc}")
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def llama_tools():
    """llama-imatrix and llama-quantize (the imatrix parity tests)."""
    return _llama_tools("llama-imatrix", "llama-quantize")


@pytest.fixture(scope="session")
def llama_perplexity():
    """llama-perplexity (the KL-divergence base-file tests)."""
    return _llama_tools("llama-perplexity")


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch on one thread for a module's tests (results differ at ~1e-7 between thread counts); restored after."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
