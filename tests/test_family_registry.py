"""The family registry is the one place that knows families: every spec loads and validates, a malformed spec is
one error naming its file and line:column, and no Python code outside ``ktconvert/families/`` names a family."""

from __future__ import annotations

import ast
import re
import shutil
from pathlib import Path

import pytest

from ktconvert import families
from ktconvert.errors import InputError
from ktconvert.families import registry
from ktconvert.io.resources import rules_dir

PKG = Path(__file__).resolve().parents[1] / "ktconvert"
REGISTRY = PKG / "families"


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring nodes (prose, examples: they may name a family)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                out.add(id(first.value))
    return out


def _literal_hits(names: tuple[str, ...]) -> list[str]:
    pattern = re.compile(r"(?<![A-Za-z0-9_.])(" + "|".join(map(re.escape, names)) + r")(?![A-Za-z0-9_])")
    hits = []
    for f in sorted(PKG.rglob("*.py")):
        if REGISTRY in f.parents:
            continue
        tree = ast.parse(f.read_text(encoding="utf-8"))
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                m = pattern.search(node.value)
                if m:
                    hits.append(f"{f.relative_to(PKG.parent)}:{node.lineno}: {m.group(1)!r} in {node.value!r}")
    return hits


def test_no_family_name_outside_the_registry():
    hits = _literal_hits(families.FAMILIES)
    assert not hits, "ask the family spec (ktconvert.families) instead of naming a family:\n" + "\n".join(hits)


def test_the_scan_finds_a_family_name():
    assert _literal_hits(("demo",)), "the literal scan found nothing: it would pass vacuously"


def test_every_spec_file_is_a_registered_family():
    files = sorted(p.stem for p in (rules_dir() / "families").glob("*.yaml"))
    assert sorted(families.FAMILIES) == files
    for f in families.FAMILIES:
        sp = families.spec(f)
        assert (rules_dir() / sp.naming_map).is_file(), f"{sp.shown}: gguf.naming {sp.naming_map} does not exist"
        assert sp.tiny["config"]["model_type"] == f


def test_a_malformed_spec_names_its_file_and_line(tmp_path, monkeypatch):
    bad = tmp_path / "families"
    shutil.copytree(rules_dir() / "families", bad)
    text = (bad / "mixtral.yaml").read_text(encoding="utf-8")
    (bad / "mixtral.yaml").write_text(text.replace("dense_layers: none", "dense_layers: sometimes"), encoding="utf-8")
    monkeypatch.setattr(registry, "rules_dir", lambda: tmp_path)
    registry._registry.cache_clear()
    try:
        with pytest.raises(InputError) as exc:
            registry.families()
        err = exc.value
        assert err.path == "rules/families/mixtral.yaml"
        line = next(i for i, ln in enumerate(text.splitlines(), 1) if "dense_layers: none" in ln)
        assert str(err.where).startswith(f"{line}:")
    finally:
        registry._registry.cache_clear()


def test_an_unknown_family_is_a_usage_problem():
    with pytest.raises(Exception, match="unknown family"):
        families.spec("not_a_family")


def test_a_malformed_spec_stops_a_command_with_one_error(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from ktconvert.cli import cli

    model = _probe_config(tmp_path)
    bad = tmp_path / "families"
    shutil.copytree(rules_dir() / "families", bad)
    text = (bad / "mixtral.yaml").read_text(encoding="utf-8")
    (bad / "mixtral.yaml").write_text(text.replace("block: block_sparse_moe", "block: [x]"), encoding="utf-8")
    line = next(i for i, ln in enumerate(text.splitlines(), 1) if "block: block_sparse_moe" in ln)
    monkeypatch.setattr(registry, "rules_dir", lambda: tmp_path)
    registry._registry.cache_clear()
    try:
        res = CliRunner().invoke(cli, ["check-rules", str(rules_dir() / "optimize" / "mixtral.yaml"),
                                       "--model", str(model)])
    finally:
        registry._registry.cache_clear()
    assert res.exit_code == 3, res.output
    assert f"rules/families/mixtral.yaml:{line}:" in res.output
    assert "Traceback" not in res.output


def _probe_config(tmp_path: Path) -> Path:
    import json

    from ktconvert.rules import modeltree

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(modeltree.PROBE_CONFIGS["mixtral"]), encoding="utf-8")
    return cfg


def test_spec_facts_agree_with_the_code_and_the_naming_maps():
    from ktconvert.convert.metadata import _ARCH_KEYS
    from ktconvert.formats import naming_map
    from ktconvert.io.resources import load_schema

    gguf = load_schema("family-spec")["properties"]["gguf"]["properties"]
    assert set(gguf["metadata"]["items"]["enum"]) == set(_ARCH_KEYS)
    for f in families.FAMILIES:
        sp = families.spec(f)
        m = naming_map(sp.gguf_arch)
        assert m.arch == sp.gguf_arch and f in m.hf_model_types, f"{sp.shown}: {sp.naming_map} does not list {f}"
