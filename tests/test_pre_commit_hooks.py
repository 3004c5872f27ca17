"""The pre-commit hooks we publish run check-rules the way pre-commit would: entry + the matching files."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest
import yaml

from conftest import REPO

HOOKS = yaml.safe_load((REPO / ".pre-commit-hooks.yaml").read_text())
GOOD = '- match: {name: "^model\\\\.embed_tokens$"}\n  replace: {class: default, kwargs: {generate_device: cpu, prefill_device: cpu}}\n'
STYLE = '- match: {name: "^model.embed_tokens$"}\n  replace: {class: default, kwargs: {generate_device: cpu, prefill_device: cpu}}\n'
BROKEN = '- match: {name: "^model$"}\n  replace: {class: ktransformers.operators.models.KDeepseekV2Model, kwargs: {transfer_map: {"30": "cuda:1"}}}\n'


def _run_hook(hook: dict, files: list) -> int:
    """What pre-commit does for a python hook: run ``entry`` with the staged files that match ``files``."""
    rx = re.compile(hook["files"])
    selected = [str(f) for f in files if rx.search(str(f).replace("\\", "/"))]
    assert selected, "the hook's files pattern must select rule files"
    argv = shlex.split(hook["entry"])
    assert argv[0] == "ktconvert"
    return subprocess.run([sys.executable, "-m", "ktconvert", *argv[1:], *selected], capture_output=True).returncode


@pytest.fixture
def repo(tmp_path):
    d = tmp_path / "optimize_rules"
    d.mkdir()
    for name, text in (("good.yaml", GOOD), ("style.yaml", STYLE), ("broken.yaml", BROKEN)):
        (d / name).write_text(text)
    (tmp_path / "notes.yaml").write_text("not: a rule file\n")  # outside the pattern: never handed to the hook
    return d


def test_hooks_are_well_formed():
    ids = [h["id"] for h in HOOKS]
    assert ids == ["ktconvert-check-rules", "ktconvert-check-rules-strict"]
    for h in HOOKS:
        assert h["language"] == "python" and h["entry"].startswith("ktconvert check-rules")
        assert re.search(h["files"], "ktransformers/optimize/optimize_rules/DeepSeek-V3-Chat.yaml")
        assert not re.search(h["files"], "configs/train.yaml")


def test_positive_and_negative_cases(repo):
    lenient, strict = HOOKS
    assert _run_hook(lenient, [repo / "good.yaml", repo / "style.yaml"]) == 0
    assert _run_hook(lenient, [repo / "broken.yaml"]) == 1
    assert _run_hook(strict, [repo / "good.yaml"]) == 0
    assert _run_hook(strict, [repo / "style.yaml"]) == 1
