"""User regexes are matched with a guard (issue 31): a pattern that can backtrack catastrophically (nested
quantifier, overlapping alternation in a repetition, many adjacent wildcards) is refused before it is ever
matched: a KT305 finding in check-rules (the rule is then never matched, so --model/--explain stay fast), a usage
error for ``inspect --tensors``, an input error at its place in a recipe. Every shipped rule and recipe passes."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from ktconvert.cli import cli
from ktconvert.io.userregex import backtracking_risk

REPO = Path(__file__).resolve().parents[1]

EVIL = [r"(a+)+$", r"(a*)*$", r"(.*)*$", r"(.*a)*$", r"(\w+\.?)+$", r"^(a+b?)+$", r"((a+)b?)+$", r"(a{1,3})+$",
        r"(x+x+)+y", r"^model\.(\d+|\d+\.)+$", r"(a|a)*$", r"(a|aa)*$", r"(a|b|ab)*c", r".*.*.*.*x",
        r"^(([a-z])+.)+[A-Z]([a-z])+$"]
FINE = [r"(\d+\.)+$", r"(ab+)+$", r"(a|ab)*c", r"(\w|\d)+$", r"(?i)(a|A)+$", r"(?>a+)+$", r"a++b",
        r"(\d{1,3}\.){3}\d{1,3}", r"^model\.layers\.(?!.*self_attn).*$", r"^model\.layers\..*\.self_attn$",
        r"^(?:model\.)?layers\.\d+\.(?:mlp|block_sparse_moe)\.experts$", r"[a-z]+[0-9]+[a-z]+", r"^lm_head$"]


@pytest.mark.parametrize("pattern", EVIL)
def test_patterns_that_backtrack_without_end_are_found(pattern):
    assert backtracking_risk(pattern) is not None


@pytest.mark.parametrize("pattern", FINE)
def test_patterns_that_match_in_linear_time_pass(pattern):
    assert backtracking_risk(pattern) is None


def test_the_guard_is_right_about_a_real_blowup():
    """``(a+)+$`` doubles its work per character on a failing subject; ``(\\d+\\.)+$``, which passes, does not."""
    def seconds(pattern: str, n: int) -> float:
        t = time.perf_counter()
        re.search(pattern, "a" * n + "!")
        return time.perf_counter() - t

    assert seconds(r"(a+)+$", 20) > 8 * min(seconds(r"(a+)+$", 12) for _ in range(3))
    assert seconds(r"(\d+\.)+$", 5000) < 0.5


def _patterns(path: Path):
    out = []

    def walk(x):
        if isinstance(x, dict):
            m = x.get("match")
            if isinstance(m, dict) and isinstance(m.get("name"), str):
                out.append(m["name"])
            elif isinstance(m, str):
                out.append(m)
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")):
        walk(doc)
    return out


def test_every_shipped_rule_and_recipe_pattern_passes():
    files = sorted((REPO / "rules" / "optimize").rglob("*.yaml")) + sorted((REPO / "rules" / "convert").glob("*.yaml"))
    patterns = [(f.name, p) for f in files for p in _patterns(f)]
    assert len(patterns) > 50
    assert [(f, p) for f, p in patterns if backtracking_risk(p) is not None] == []


EVIL_RULE = """\
- match: {name: "^(\\\\w+\\\\.?)+x$"}
  replace: {class: default, kwargs: {generate_device: cpu, prefill_device: cpu}}
"""


def test_check_rules_refuses_the_pattern_and_finishes_against_a_model(tmp_path, tiny_root):
    """Every module path fails ``^(\\w+\\.?)+x$`` after exponentially many tries; the rule is reported, not run."""
    rules = tmp_path / "evil.yaml"
    rules.write_text(EVIL_RULE)
    t = time.perf_counter()
    res = CliRunner().invoke(cli, ["check-rules", str(rules), "--model", str(tiny_root / "qwen3_moe"), "--explain"])
    assert time.perf_counter() - t < 10
    assert res.exit_code == 1, res.output
    assert f"{rules}:1:17: KT305 error: regex '^(\\\\w+\\\\.?)+x$' has a nested quantifier" in res.stdout
    assert "(a+)+ -> a+" in res.stdout


def test_inspect_tensors_refuses_the_pattern(tiny_root):
    t = time.perf_counter()
    res = CliRunner().invoke(cli, ["inspect", str(tiny_root / "qwen3_moe"), "--tensors", r"^(\w+\.?)+x$"])
    assert time.perf_counter() - t < 10
    assert res.exit_code == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(r"ktconvert: error: --tensors '^(\\w+\\.?)+x$' has a nested "
                                                   "quantifier"), res.stderr


def test_a_recipe_rule_with_the_pattern_is_refused_at_its_place(tmp_path, tiny_root):
    recipe = tmp_path / "evil.yaml"
    recipe.write_text("kind: convert-recipe\nname: evil\ndescription: x\nrules:\n"
                      "  - {match: '(.*a)*$', type: Q8_0}\n  - {match: '.', type: Q8_0}\n")
    res = CliRunner().invoke(cli, ["quantize", str(tiny_root / "qwen3_moe"), str(tmp_path / "out"), "--recipe",
                                   str(recipe)])
    assert res.exit_code == 3
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"ktconvert: error: {recipe}:5:13: rule 0 match '(.*a)*$' has a "
                                                   "nested quantifier"), res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["evil.yaml"]
