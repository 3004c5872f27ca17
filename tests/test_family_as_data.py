"""A family that reuses existing mechanisms is one data file: a renamed copy of qwen3_moe's spec with other sizes,
written only into a temporary directory on ``KTCONVERT_FAMILY_PATH``, goes through tiny-model, quantize,
check-rules, golden and verify with no change to the repository (docs/developing/adding-a-family.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import REPO

RULES = REPO / "rules" / "optimize" / "qwen3_moe.yaml"


def _acme_spec() -> dict:
    """qwen3_moe's spec renamed (family, model_type, architecture) with 6 experts and 3 layers; transformers
    implements it as qwen3_moe (``classes.transformers_type``) and ktransformers' Qwen3Moe rules apply (same
    ``classes.prefix``)."""
    spec = yaml.safe_load((REPO / "rules" / "families" / "qwen3_moe.yaml").read_text())
    spec.update(family="acme_moe", order=100, description="Acme-MoE, a renamed Qwen3-MoE with other sizes",
                architectures=["AcmeMoeForCausalLM"])
    spec["classes"] = {"prefix": "Qwen3Moe", "transformers_type": "qwen3_moe"}
    tiny = spec["tiny"]
    tiny.pop("fp8", None)
    tiny["config"].update(architectures=["AcmeMoeForCausalLM"], model_type="acme_moe", num_local_experts=6,
                          num_hidden_layers=3)
    return spec


def _run(args: list[str], env: dict, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ktconvert", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


def _env(*dirs: Path) -> dict:
    env = dict(os.environ, KTCONVERT_FAMILY_PATH=os.pathsep.join(map(str, dirs)), OMP_NUM_THREADS="1")
    env.pop("CI", None)  # golden refuses to run under CI (goldens are made by people, not by CI)
    return env


def test_a_new_family_is_one_spec_file(tmp_path):
    specs = tmp_path / "families"
    specs.mkdir()
    (specs / "acme_moe.yaml").write_text(yaml.safe_dump(_acme_spec(), sort_keys=False))
    env = _env(specs)
    steps = [
        ["tiny-model", "acme_moe", "m"],
        ["inspect", "m"],
        ["quantize", "m", "q", "--type", "Q8_0"],
        ["check-rules", "--model", "m/config.json", str(RULES)],
        ["golden", "m", "g", "--engine", "stream"],
        ["verify", "--model", "m", "--rules", str(RULES), "--weights", "q/model.gguf", "--golden", "g",
         "-o", "json"],
    ]
    for args in steps:
        r = _run(args, env, tmp_path)
        assert r.returncode == 0, f"ktconvert {' '.join(args)}: exit {r.returncode}\n{r.stdout[-1500:]}\n{r.stderr[-1500:]}"
    report = yaml.safe_load(r.stdout)
    assert report["verdict"] == "pass" and report["model"]["family"] == "acme_moe"
    cfg = yaml.safe_load((tmp_path / "m" / "config.json").read_text())
    assert (cfg["model_type"], cfg["num_local_experts"], cfg["num_hidden_layers"]) == ("acme_moe", 6, 3)
    assert "3 layers" in _run(["inspect", "m"], env, tmp_path).stdout


def test_a_spec_redefining_a_shipped_family_is_refused(tmp_path):
    specs = tmp_path / "families"
    specs.mkdir()
    spec = yaml.safe_load((REPO / "rules" / "families" / "qwen3_moe.yaml").read_text())
    (specs / "qwen3_moe.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    r = _run(["tiny-model", "qwen3_moe", "m"], _env(specs), tmp_path)
    assert r.returncode == 3, r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert "family 'qwen3_moe' is already defined by rules/families/qwen3_moe.yaml" in line
    assert str(specs / "qwen3_moe.yaml") in line
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("bad", ["missing", "file"])
def test_a_family_path_that_is_no_directory_is_refused(tmp_path, bad):
    target = tmp_path / "specs"
    if bad == "file":
        target.write_text("not a directory")
    r = _run(["tiny-model", "qwen3_moe", "m"], _env(target), tmp_path)
    assert r.returncode == 3, r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert "KTCONVERT_FAMILY_PATH" in line and "not a directory of family specs" in line and str(target) in line
    assert not (tmp_path / "m").exists()


def test_an_unknown_family_in_a_gate_suite_or_profile_is_one_line(tmp_path):
    """The schemas no longer list the families (a family is its spec): the registry refuses an unknown one, naming
    the file and the place."""
    from ktconvert.errors import InputError
    from ktconvert.gate import load_suite
    from ktconvert.verify.profile import load_profile

    suite = tmp_path / "suite.yaml"
    suite.write_text("kind: gate-suite\nversion: 1\ncases:\n"
                     "  - {name: a, family: qwen3_moee, rules: qwen3_moe, type: Q8_0, golden: qwen3_moe, tolerance: q8_0}\n")
    with pytest.raises(InputError) as exc:
        load_suite(suite)
    assert "unknown family 'qwen3_moee'" in exc.value.message and exc.value.path == str(suite)
    assert exc.value.where == "4:5" and "qwen3_moe" in exc.value.fix

    profile = tmp_path / "p.yaml"
    text = (REPO / "rules" / "tolerances" / "q8_0.yaml").read_text().replace("families: [deepseek_v2, deepseek_v3]",
                                                                            "families: [deepseek_v2, deepseek_v9]")
    profile.write_text(text)
    with pytest.raises(InputError) as exc:
        load_profile(str(profile))
    line = text[:text.index("deepseek_v9")].count("\n") + 1
    assert "unknown family 'deepseek_v9'" in exc.value.message and exc.value.where.startswith(f"{line}:")
