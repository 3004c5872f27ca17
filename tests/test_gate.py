"""The numeric regression gate: the shipped suite is green, and regressions a user cares about turn it red.

The full suite runs once (about a minute on two cores); the injected regressions each run a few cases
in process, with the converter or a quantizer deliberately broken the way real bugs break them.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from ktconvert.cli import cli
from ktconvert.errors import InputError
from ktconvert.gate import default_suite_path, load_suite



def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def _junit_cases(path):
    root = ET.parse(path).getroot()
    return {tc.get("name"): tc for tc in root.iter("testcase")}


def test_shipped_suite_covers_families_types_and_backends():
    suite = load_suite(default_suite_path())
    from ktconvert.families import FAMILIES

    assert {c.family for c in suite.cases} == set(FAMILIES)  # every registered family has gate cases
    assert {c.conversion for c in suite.cases} == {"type:F32", "type:BF16", "type:Q8_0", "recipe:Q4_K_M", "type:Q6_K",
                                                   "kt-amx:type:AMXINT8", "kt-amx:type:AMXINT4", "lora:type:Q8_0"}
    assert {c.lora for c in suite.cases} == {None, "verify", "quantize"}
    assert {c.rules.name for c in suite.cases} >= {"qwen3_moe.yaml", "qwen3_moe-serve.yaml", "deepseek_v3-serve.yaml",
                                                   "glm4_moe-serve.yaml", "minimax_m2.yaml"}


def _suite_without_kernel_cases(tmp_path):
    """The shipped suite minus its kt-kernel cases, for a machine where kt-kernel cannot be imported."""
    import yaml

    data = yaml.safe_load(default_suite_path().read_text())
    data["cases"] = [c for c in data["cases"] if c.get("kernel", "emulate") == "emulate"]
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_unmodified_tree_passes_the_whole_gate(tmp_path):
    from ktconvert.kernel import probe_kernel

    junit = tmp_path / "gate.xml"
    expect = 80  # 71 emulated cases + 9 through the real kt-kernel (6 GGUF via LLAMAFILE, 3 kt-amx via AMX)
    extra = []
    if not probe_kernel()["available"]:  # the kernel cases need kt-kernel; the rest of the gate still runs
        extra, expect = [_suite_without_kernel_cases(tmp_path)], 71
    r = run("gate", *extra, "--jobs", "2", "--junit", junit)
    assert r.exit_code == 0, r.output
    assert f"{expect}/{expect} cases passed" in r.output and "gate green" in r.output
    cases = _junit_cases(junit)
    assert len(cases) == expect and not any(tc.find("failure") is not None or tc.find("error") is not None for tc in cases.values())


# --- injected regressions ---------------------------------------------------------------------------------
def _patch_converted_gguf(monkeypatch, edit):
    """Wrap the converter so every GGUF it writes is edited in place before verify reads it."""
    import ktconvert.gate.runner as gate_runner
    from ktconvert.formats import open_checkpoint

    original = gate_runner.convert

    def broken(*args, **kwargs):
        result = original(*args, **kwargs)
        path = result.out / "model.gguf"
        ck = open_checkpoint(path)
        with open(path, "r+b") as fh:
            edit(ck, fh)
        return result

    monkeypatch.setattr(gate_runner, "convert", broken)


def _expert_bytes(info, e):
    per = info.nbytes // info.shape[0]
    return info.offset + e * per, per


def _fail_names_case_and_metric(tmp_path, select, expect_case):
    junit = tmp_path / "gate.xml"
    r = run("gate", "-k", select, "--junit", junit)
    assert r.exit_code == 1, r.output
    assert "gate RED" in r.output
    tc = _junit_cases(junit)[expect_case]
    failure = tc.find("failure")
    assert failure is not None, ET.tostring(tc)
    assert expect_case in failure.get("message")
    metrics = {"kl_mean", "kl_max", "kl_p99", "nmse_max", "max_abs_diff", "hidden_nmse", "top1_agreement", "topk_overlap_mean"}
    assert any(m in failure.get("message") for m in metrics), failure.get("message")
    return failure


def _swap_experts_0_1_of_layer_1(ck, fh):
    for proj in ("gate", "up", "down"):
        info = ck[f"blk.1.ffn_{proj}_exps.weight"]
        (a, n), (b, _) = _expert_bytes(info, 0), _expert_bytes(info, 1)
        fh.seek(a); x = fh.read(n)
        fh.seek(b); y = fh.read(n)
        fh.seek(a); fh.write(y)
        fh.seek(b); fh.write(x)


def test_two_experts_swapped_in_one_layer_turns_the_gate_red(monkeypatch, tmp_path):
    _patch_converted_gguf(monkeypatch, _swap_experts_0_1_of_layer_1)
    failure = _fail_names_case_and_metric(tmp_path, "qwen3_moe-q8_0", "qwen3_moe-q8_0")
    assert "model.layers.1" in (failure.text or "")  # localised to the broken layer


def test_two_experts_swapped_turn_the_kernel_case_red(monkeypatch, tmp_path):
    from kernel_helpers import require_kernel

    require_kernel()
    _patch_converted_gguf(monkeypatch, _swap_experts_0_1_of_layer_1)
    failure = _fail_names_case_and_metric(tmp_path, "qwen3_moe-kt-q8_0", "qwen3_moe-kt-q8_0")
    assert "model.layers.1" in (failure.text or "")


def test_quantizer_scales_off_by_three_percent_turn_the_gate_red(monkeypatch, tmp_path):
    import ktconvert.convert.worker as worker

    original = worker.quantize

    def off(data, qtype, *args, **kwargs):
        out = original(data, qtype, *args, **kwargs)
        if str(getattr(qtype, "name", qtype)).upper().endswith("Q8_0"):
            blocks = out.reshape(-1, 34)
            d = blocks[:, :2].copy().view(np.float16)
            blocks[:, :2] = (d.astype(np.float32) * 1.03).astype(np.float16).view(np.uint8).reshape(-1, 2)
        return out

    monkeypatch.setattr(worker, "quantize", off)
    _fail_names_case_and_metric(tmp_path, "deepseek_v2-q8_0", "deepseek_v2-q8_0")


def test_router_score_bias_dropped_turns_the_gate_red(monkeypatch, tmp_path):
    def drop(ck, fh):
        for name, info in ck.items():
            if name.endswith("exp_probs_b.bias"):
                fh.seek(info.offset)
                fh.write(b"\0" * info.nbytes)

    _patch_converted_gguf(monkeypatch, drop)
    _fail_names_case_and_metric(tmp_path, "deepseek_v3-f32", "deepseek_v3-f32")


def test_adapter_at_half_strength_turns_both_lora_cases_red(monkeypatch, tmp_path):
    """The LoRA cases check the adapter's arithmetic, not only that it is present: alpha/r halved wherever the
    adapter is read (quantize --lora's merge and verify --lora's reference) turns both red."""
    import ktconvert.convert.lora_merge as lora_merge

    original = lora_merge._deltas
    monkeypatch.setattr(lora_merge, "_deltas", lambda ad, scale, model_type: original(ad, scale / 2, model_type))
    junit = tmp_path / "gate.xml"
    r = run("gate", "-k", "lora", "--junit", junit)
    assert r.exit_code == 1 and "0/2 cases passed" in r.output, r.output
    for name in ("qwen3_moe-lora-q8_0", "qwen3_moe-lora-merged-q8_0"):
        assert _junit_cases(junit)[name].find("failure") is not None, name


def test_a_lora_case_against_a_base_golden_is_an_error_naming_both(tmp_path):
    p = tmp_path / "suite.yaml"
    p.write_text("kind: gate-suite\nversion: 1\ncases:\n  - {name: a, family: qwen3_moe, rules: qwen3_moe, type: Q8_0, "
                 "lora: verify, golden: qwen3_moe, tolerance: q8_0}\n")
    r = run("gate", p)
    assert r.exit_code == 3 and "made without an adapter" in r.output, r.output


def test_regen_of_a_lora_case_makes_its_golden_with_the_adapter(monkeypatch, tmp_path):
    import shutil

    from ktconvert.golden import golden_root, read_golden

    monkeypatch.delenv("CI", raising=False)
    shutil.copytree(golden_root() / "qwen3_moe-lora", tmp_path / "g")
    p = tmp_path / "suite.yaml"
    p.write_text("kind: gate-suite\nversion: 1\ncases:\n  - {name: a, family: qwen3_moe, rules: qwen3_moe, type: Q8_0, "
                 "lora: quantize, golden: g, tolerance: q8_0}\n")
    r = run("gate", p, "--regen", "--reason", "test")
    assert r.exit_code == 0, r.output
    made = read_golden(tmp_path / "g")
    assert made.manifest["lora"]["sha256"] == read_golden(golden_root() / "qwen3_moe-lora").manifest["lora"]["sha256"]
    assert made.manifest["regenerations"][-1]["reason"] == "test" and "--lora <ADAPTER>" in made.manifest["command"]
    assert run("gate", p).exit_code == 0


# --- options and bad input --------------------------------------------------------------------------------
def test_select_list_and_json(tmp_path):
    r = run("gate", "-k", "mixtral*", "--list")
    assert r.exit_code == 0 and len(r.output.strip().splitlines()) == 5
    r = run("gate", "-k", "q8_0", "--list")
    assert r.exit_code == 0 and len(r.output.strip().splitlines()) == 26  # fifteen single-request families, Kimi-K2 and Moonlight, five serve files, two kt-kernel, two LoRA
    r = run("gate", "-k", "nothing-like-this")
    assert r.exit_code == 2 and "selects no case" in r.output


def test_junit_carries_judged_and_raw_top1_and_the_near_ties(tmp_path):
    junit = tmp_path / "gate.xml"
    r = run("gate", "-k", "qwen3_moe-q4_k_m", "--junit", junit)
    assert r.exit_code == 0, r.output
    out = _junit_cases(junit)["qwen3_moe-q4_k_m"].find("system-out").text
    assert "decode.top1_agreement=" in out and "decode.top1_agreement_raw=" in out
    assert re.search(r"decode\.top1_near_ties=\[[0-9,]+\]", out), out  # the q4_k_m noise sets some aside


def test_regen_is_refused_under_ci(monkeypatch):
    monkeypatch.setenv("CI", "true")
    r = run("gate", "-k", "qwen3_moe-f32", "--regen", "--reason", "test")
    assert r.exit_code == 3 and "CI environment variable is set" in r.output
    monkeypatch.delenv("CI")
    assert run("gate", "--regen").exit_code == 2  # a regeneration must say why


@pytest.mark.parametrize("text,needle", [
    ("kind: gate-suite\nversion: 1\ncases: []\n", "not a valid gate suite"),
    ("kind: gate-suite\nversion: 1\ncases:\n  - {name: a, family: qwen3_moe, rules: nope, type: F32, golden: qwen3_moe, tolerance: f32}\n",
     "rule file 'nope'"),
    ("kind: gate-suite\nversion: 1\ncases:\n  - {name: a, family: qwen3_moe, rules: qwen3_moe, type: F32, golden: qwen3_moe, tolerance: loose}\n",
     "tolerance profile 'loose'"),
    ("kind: gate-suite\nversion: 1\ncases:\n  - {name: a, family: qwen3_moe, rules: qwen3_moe, golden: qwen3_moe, tolerance: f32}\n",
     "not a valid gate suite"),
    ("kind: gate-suite\nversion: 1\ncases:\n  - {name: a, family: deepseek_v3, variant: kimi_k2, rules: deepseek_v3, type: F32, "
     "lora: verify, golden: qwen3_moe-lora, tolerance: f32}\n", "lora and variant together"),
    ("kind: gate-suite\nversion: 1\ncases:\n  - {name: a, family: qwen3_moe, rules: qwen3_moe, type: F32, lora: yes, "
     "golden: qwen3_moe-lora, tolerance: f32}\n", "not a valid gate suite"),
])
def test_bad_suites_are_one_line_errors(tmp_path, text, needle):
    p = tmp_path / "suite.yaml"
    p.write_text(text)
    with pytest.raises(InputError, match=needle):
        load_suite(p)
    r = run("gate", p)
    assert r.exit_code == 3 and str(p) in r.output and "Traceback" not in r.output


def test_a_tiny_model_that_cannot_be_made_fails_its_cases_with_the_reason(monkeypatch):
    import ktconvert.gate.runner as gate_runner
    from ktconvert.errors import EnvironmentProblem

    def broken(family, out, **kw):
        raise EnvironmentProblem("disk full", path=str(out), fix="free some space")

    monkeypatch.setattr(gate_runner, "write_tiny_model", broken)
    r = run("gate", "-k", "mixtral-f32")
    assert r.exit_code == 3, r.output
    assert "mixtral-f32: " in r.output and "disk full (free some space)" in r.output


# --- cases naming a real model and its conversion on disk ------------------------------------------------------
@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """A model directory outside any suite directory, its Q8_0 GGUF by `ktconvert quantize`, and a broken GGUF (one
    layer's expert gate/up swapped, the planted regression)."""
    from verify_helpers import write_gguf

    from ktconvert.convert import convert
    from ktconvert.golden.stream import float32_bytes
    from ktconvert.model.tiny import write_tiny_model

    root = tmp_path_factory.mktemp("release")
    model = root / "Qwen3-tiny"
    write_tiny_model("qwen3_moe", model)
    good = convert(model, root / "q8", type="Q8_0").out / "model.gguf"
    broken = write_gguf(model, root / "broken.gguf", "Q8_0", faults=[("gate-up-swapped", 1)])
    return {"root": root, "model": model, "good": good, "broken": broken, "budget": float32_bytes(model) // 2}


def _model_suite(path, *cases) -> Path:
    import yaml

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({"kind": "gate-suite", "version": 1, "cases": list(cases)}, sort_keys=False))
    return path


def _model_case(name, model, candidate, **extra) -> dict:
    return {"name": name, "model": str(model), "candidate": str(candidate), "rules": "qwen3_moe",
            "golden": "qwen3_moe", "tolerance": "q8_0", **extra}


def test_cases_naming_a_model_outside_the_suite_gate_its_conversions_within_max_memory(release, tmp_path, monkeypatch):
    """The model relative to the suite file, the candidates absolute; max_memory reaches verify (the run streams);
    the good conversion passes, the planted regression fails with exit 1, named at its layer."""
    import os

    import ktconvert.gate.runner as gate_runner

    suite = tmp_path / "ci" / "gate.yaml"
    rel = os.path.relpath(release["model"], suite.parent)
    _model_suite(suite,
                 _model_case("release-q8_0", rel, release["good"], max_memory=f"{release['budget']}B"),
                 _model_case("release-broken", rel, release["broken"], max_memory=f"{release['budget']}B"))
    loaded = load_suite(suite)
    assert [c.model for c in loaded.cases] == [suite.parent / rel] * 2 and loaded.cases[0].family == "qwen3_moe"
    assert loaded.cases[0].max_memory == release["budget"]
    modes, real = [], gate_runner.run_verify

    def spy(*a, **kw):
        report = real(*a, **kw)
        modes.append((kw["max_memory"], report.run["mode"]))
        return report

    monkeypatch.setattr(gate_runner, "run_verify", spy)
    monkeypatch.setattr(gate_runner, "convert", lambda *a, **kw: pytest.fail("a model case converts nothing"))
    junit = tmp_path / "gate.xml"
    r = run("gate", suite, "--junit", junit)
    assert r.exit_code == 1, r.output
    assert "1/2 cases passed" in r.output and "gate RED" in r.output
    assert modes == [(release["budget"], "stream")] * 2
    cases = _junit_cases(junit)
    assert cases["release-q8_0"].find("failure") is None and cases["release-q8_0"].find("error") is None
    failure = cases["release-broken"].find("failure")
    assert failure is not None and "model.layers.1" in (failure.text or "")


@pytest.mark.parametrize("edit,needle,fix", [
    (lambda c, r: {**c, "model": str(r["root"] / "nowhere")}, "model '{root}/nowhere' not found", "model directory"),
    (lambda c, r: {**c, "model": "../missing"}, "model '../missing' not found", "relative to the suite file"),
    (lambda c, r: {**c, "candidate": "gone.gguf"}, "candidate 'gone.gguf' not found", "converted checkpoint"),
    (lambda c, r: {**c, "model": str(r["root"] / "q8")}, "has no config.json", "Hugging Face model directory"),
    (lambda c, r: {**c, "candidate": str(r["model"] / "config.json")}, "neither a .gguf nor a .safetensors",
     "converted checkpoint"),
    (lambda c, r: {**c, "to": "kt-amx", "kernel": "kt-kernel"}, "is not a directory", "kt-amx directory"),
    (lambda c, r: {**c, "candidate": str(r["root"] / "q8"), "to": "kt-amx"}, "read by the real kernel only",
     "kernel: kt-kernel"),
    (lambda c, r: {**c, "family": "qwen3_moe"}, "names a model directory and also family", "drop family"),
    (lambda c, r: {**c, "max_memory": "8 parsecs"}, "not a valid gate suite", "gate-suite.schema.json"),
    (lambda c, r: {k: v for k, v in c.items() if k != "candidate"}, "'candidate' is a required property",
     "gate-suite.schema.json"),
])
def test_bad_model_case_paths_are_one_line_before_any_case_runs(release, tmp_path, monkeypatch, edit, needle, fix):
    import ktconvert.gate.runner as gate_runner

    good_tiny = {"name": "tiny-f32", "family": "qwen3_moe", "rules": "qwen3_moe", "type": "F32", "golden": "qwen3_moe",
                 "tolerance": "f32"}
    bad = edit(_model_case("release", release["model"], release["good"]), release)
    suite = _model_suite(tmp_path / "suite.yaml", good_tiny, bad)
    monkeypatch.setattr(gate_runner, "write_tiny_model", lambda *a, **kw: pytest.fail("a case ran"))
    r = CliRunner().invoke(cli, ["gate", str(suite)], catch_exceptions=False)
    assert r.exit_code == 3, r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and r.stdout == "", r.output
    line = lines[0]
    assert line.startswith(f"ktconvert: error: {suite}:") and needle.format(root=release["root"]) in line, line
    assert fix in line and (":" in line.split(str(suite))[1])  # the suite file, the case's line, the fix
    if "schema" not in fix:
        assert "case 'release'" in line


def test_regen_of_a_model_case_makes_its_golden_from_that_model(release, tmp_path, monkeypatch):
    import shutil

    from ktconvert.golden import golden_root, read_golden

    monkeypatch.delenv("CI", raising=False)
    shutil.copytree(golden_root() / "qwen3_moe", tmp_path / "g")
    suite = _model_suite(tmp_path / "suite.yaml", _model_case("release", release["model"], release["good"], golden="g",
                                                              max_memory=f"{release['budget']}B"))
    r = run("gate", suite, "--regen", "--reason", "new release")
    assert r.exit_code == 0 and f"regenerated {tmp_path / 'g'}" in r.output, r.output
    made = read_golden(tmp_path / "g")
    assert made.manifest["regenerations"][-1]["reason"] == "new release"
    assert made.manifest["model"]["family"] == "qwen3_moe" and made.manifest["producer"]["engine"] == "stream"
