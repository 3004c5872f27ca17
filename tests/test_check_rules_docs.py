"""Every check's documented bad example triggers it, and its fixed example does not."""

import json

import pytest

from ktconvert.rules import lint, modeltree
from ktconvert.rules.catalog import load_catalog
from ktconvert.rules.findings import registry

CHECKS = list(registry().values())


def _run(text, check, tmp_path, bad=False):
    tree = None
    if check.model:
        cfg = tmp_path / "config.json"
        cfg.write_text(json.dumps(modeltree.PROBE_CONFIGS[check.model]))
        data, where = modeltree.load_config(cfg)
        tree = modeltree.build_tree(data, "model", where)
    checkpoint = None
    if check.weights is not None:
        from ktconvert.formats import open_checkpoint
        from rules_weights_helpers import write_gguf

        path = tmp_path / ("bad.gguf" if bad else "fixed.gguf")
        write_gguf(path, tree, drop=check.weights.get("drop_in_bad", ()) if bad else (),
                   experts_type=check.weights.get("experts_type", "F32"))
        checkpoint = open_checkpoint(path)
    options = lint.Options(backend=check.backend)
    return lint.check_text(text, f"{check.id}.yaml", options, load_catalog(), tree, checkpoint=checkpoint)


@pytest.mark.parametrize("check", CHECKS, ids=[c.id for c in CHECKS])
def test_bad_example_triggers_and_fixed_example_does_not(check, tmp_path):
    bad = _run(check.bad, check, tmp_path, bad=True)
    assert check.id in {f.id for f in bad.findings}, [(f.id, f.message) for f in bad.findings]
    hit = next(f for f in bad.findings if f.id == check.id)
    assert hit.severity == check.severity and hit.line >= 1 and hit.col >= 1 and hit.message
    fixed = _run(check.fixed, check, tmp_path)
    assert [f for f in fixed.findings if f.severity == "error" or f.id == check.id] == []


def test_registry_ids_are_stable_and_grouped():
    ids = [c.id for c in CHECKS]
    assert len(ids) == len(set(ids))
    groups = {"1": "syntax/schema", "2": "catalog", "3": "regex", "4": "model", "5": "weights"}
    assert all(i[2] in groups for i in ids)
    assert all(c.needs == "model" for c in CHECKS if c.id.startswith("KT4") and c.id != "KT402")
    assert all(c.needs == "weights" and c.weights is not None for c in CHECKS if c.id.startswith("KT5"))


def test_every_emitted_id_is_documented():
    import re
    from pathlib import Path

    here = Path(lint.__file__)
    src = "".join(p.read_text() for p in [*here.parent.glob("checks/*.py"), here, here.parents[1] / "io" / "yamlpos.py"])
    emitted = set(re.findall(r'"(KT[1-5][0-9]{2})"', src))
    assert emitted <= set(registry()), emitted - set(registry())


def test_every_documented_check_is_one_registered_function():
    """Each KT check is a function registered by ID (rules/checks/); each documented ID has one."""
    from ktconvert.rules import checks

    implemented = checks.implemented_ids()
    assert set(registry()) <= set(implemented), set(registry()) - set(implemented)
    assert set(implemented) <= set(registry()), set(implemented) - set(registry())
