"""The model directory is opened once per run (ktconvert.formats.release): verify, in memory and streamed, and a
streamed golden read config.json once and parse each safetensors header once; the rest of the directory is read
as tensor data only."""

from __future__ import annotations

import collections
import os
import sys

import pytest

from verify_helpers import Workspace
from ktconvert.formats import checkpoint as checkpoint_mod
from ktconvert.formats import open_release

FAMILY = "qwen3_moe"


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    return Workspace(tmp_path_factory.mktemp("release-once"))


class _Opens:
    """Every ``open`` of a file under ``root`` (Python's audit event), and every safetensors header parsed."""

    _active: "_Opens | None" = None
    _hooked = False

    def __init__(self, root, monkeypatch):
        self.root = os.path.realpath(root) + os.sep
        self.opens: collections.Counter = collections.Counter()
        self.headers: collections.Counter = collections.Counter()
        real = checkpoint_mod.parse_safetensors_header

        def parse(buf, path="<buffer>"):
            self.headers[os.path.basename(path)] += 1
            return real(buf, path)

        monkeypatch.setattr(checkpoint_mod, "parse_safetensors_header", parse)
        if not _Opens._hooked:  # an audit hook cannot be removed: one for the session, reporting to the active counter
            sys.addaudithook(_Opens._hook)
            _Opens._hooked = True
        _Opens._active = self

    @staticmethod
    def _hook(event, args):
        me = _Opens._active
        if me is None or event != "open" or not isinstance(args[0], (str, bytes, os.PathLike)):
            return
        p = os.path.realpath(os.fsdecode(args[0]))
        if p.startswith(me.root):
            me.opens[p[len(me.root):]] += 1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        _Opens._active = None


def _weight_files(model) -> list[str]:
    return [f.name for f in open_release(model).checkpoint.files]


@pytest.mark.parametrize("streamed", [False, True], ids=["resident", "streamed"])
def test_verify_opens_the_model_directory_once(ws, monkeypatch, streamed):
    from ktconvert.golden.stream import float32_bytes
    from ktconvert.verify import run_verify

    model = ws.model(FAMILY)
    kw = {"max_memory": float32_bytes(model)} if streamed else {}  # a budget given: streamed layer by layer
    files = _weight_files(model)
    with _Opens(model, monkeypatch) as seen:
        report = run_verify(model, ws.rules(FAMILY), ws.golden(FAMILY), **kw)
    assert report.passed and report.run["mode"] == ("stream" if streamed else "resident")
    assert seen.opens["config.json"] == 1  # hashed against the golden and parsed from the same read
    assert files and all(seen.headers[f] == 1 for f in files), seen.headers
    assert set(seen.headers) == set(files)
    assert set(seen.opens) <= {"config.json", *files}  # nothing else of the directory is read


def test_streamed_golden_opens_the_model_directory_once(ws, monkeypatch, tmp_path):
    from ktconvert.golden.generate import generate_golden
    from ktconvert.golden.stream import float32_bytes

    monkeypatch.delenv("CI", raising=False)  # goldens are made by a person, never under CI: this one is a test's
    model = ws.model(FAMILY)
    budget = float32_bytes(model) // 2
    files = _weight_files(model)
    with _Opens(model, monkeypatch) as seen:
        got = generate_golden(model, tmp_path / "golden", engine="stream", max_memory=budget,
                              prompt_ids=[1, 5, 9, 2, 7])
    assert got.manifest["producer"]["engine"] == "stream"
    assert all(seen.headers[f] == 1 for f in files) and set(seen.headers) == set(files), seen.headers
    assert seen.opens["config.json"] == 1
    # the sources the manifest records are the headers as they were parsed
    assert got.manifest["model"]["sources"] == open_release(model).source_records()


def test_imatrix_parses_each_header_once(ws, monkeypatch, tmp_path):
    """imatrix's planner (convert.source.analyze) and its streamed provider read the one release's headers; the
    tokenizer converter still reads config.json and the tokenizer files itself (gguf-py's SpecialVocab)."""
    from ktconvert.imatrix import make_imatrix

    model = ws.model(FAMILY)
    files = _weight_files(model)
    with _Opens(model, monkeypatch) as seen:
        run = make_imatrix(model, tmp_path / "imatrix.gguf", prompt_ids=list(range(1, 40)), chunk_size=16)
    assert run.entries
    assert all(seen.headers[f] == 1 for f in files) and set(seen.headers) == set(files), seen.headers


def test_a_release_hands_back_what_it_read_once(ws):
    """The object every layer reads: one config read gives its hash, the raw dict and the normalised config; the
    checkpoint's own config is that dict (quantized.analyze and dims read it, not the file)."""
    import hashlib

    model = ws.model(FAMILY)
    rel = open_release(model)
    assert open_release(rel) is rel
    assert rel.config_sha256 == hashlib.sha256((model / "config.json").read_bytes()).hexdigest()
    assert rel.config.family == FAMILY and rel.config is rel.config  # normalised once
    assert rel.checkpoint.config is rel.raw
    assert rel.file_sha256("config.json") == rel.config_sha256
    rec = rel.source_records()["model.safetensors"]
    data = (model / "model.safetensors").read_bytes()
    n = 8 + int.from_bytes(data[:8], "little")
    assert rec == {"bytes": len(data), "header_sha256": hashlib.sha256(data[:n]).hexdigest()}
