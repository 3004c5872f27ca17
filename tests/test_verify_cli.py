"""``ktconvert verify`` through the CLI: exit codes, text and JSON (against its schema), profiles as data, and a
one-line error for every unusable input."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from verify_helpers import Workspace, rewrite_gguf
from ktconvert.io import resources
from ktconvert.cli import cli
from ktconvert.verify import load_profile, shipped_profiles


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    return Workspace(tmp_path_factory.mktemp("verify-cli"))


@pytest.fixture(scope="module")
def validator():
    import jsonschema

    schema = resources.load_schema("verify-report")
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def _verify(ws, family, *extra, model=None, golden=None, rules=None):
    args = ["verify", "--model", str(model or ws.model(family)), "--rules", str(rules or ws.rules(family)),
            "--golden", str(golden or ws.golden(family)), *map(str, extra)]
    return CliRunner().invoke(cli, args, catch_exceptions=False)


def _error(res, code=3):
    assert res.exit_code == code, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("ktconvert: error: "), res.stderr
    return lines[0]


def test_pass_exits_0_with_text(ws):
    res = _verify(ws, "qwen3_moe", "--weights", ws.gguf("qwen3_moe", "Q8_0"))
    assert res.exit_code == 0, res.output
    out = res.stdout
    assert "profile q8_0" in out and "KExpertsCPU" in out and "cpu-experts-ggml" in out
    assert "activations Q8_0/Q8_0/Q8_0, hidden bfloat16" in out
    assert out.rstrip().splitlines()[-1].startswith("PASS")


def test_fail_exits_1_and_json_matches_the_schema(ws, validator):
    broken = ws.gguf("deepseek_v2", "Q4_K", faults=[("experts-ne-order", 2)])
    res = _verify(ws, "deepseek_v2", "--weights", broken, "-o", "json")
    assert res.exit_code == 1, res.output
    report = json.loads(res.stdout)
    validator.validate(report)
    assert report["verdict"] == "fail" and report["profile"]["name"] == "q4_k"
    assert report["profile"]["limits"]["hidden_states"]["nmse_max"] == 0.07  # the deepseek override applied
    for phase in ("prefill", "decode"):
        loc = report["phases"][phase]["localization"]
        assert (loc["layer"], loc["module"]) == ("layer 2", "model.layers.2.mlp.experts")
        assert loc["operator"] == "ktransformers.operators.experts.KTransformersExperts"
        assert len(report["phases"][phase]["positions"]) == 31
    assert {b["phase"] for b in report["breaches"]} == {"prefill", "decode"}


def test_fail_text_names_breaches_and_the_jump(ws):
    broken = ws.gguf("mixtral", "F32", faults=[("router-transposed", 0)])
    res = _verify(ws, "mixtral", "--weights", broken, "--tolerance", "f32")
    assert res.exit_code == 1
    assert "decode: error jumps at layer 0, module model.layers.0.block_sparse_moe.gate (KTransformersLinear;" in res.stdout
    assert "FAIL:" in res.stdout and "hidden_nmse" in res.stdout


def test_json_of_a_passing_run_matches_the_schema(ws, validator):
    res = _verify(ws, "qwen2_moe", "-o", "json", "--compute-dtype", "bfloat16", "--no-act-quant", "--tolerance", "q8_0")
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    validator.validate(report)
    assert report["options"] == {"compute_dtype": "bfloat16", "cpu_hidden_dtype": "bfloat16", "cpu_act_quant": False,
                                 "threads": 1}
    assert report["weights"]["container"] == "safetensors" and report["injection"]["not_emulated"] == []


def test_profile_by_file_and_not_emulated_policy(ws, tmp_path):
    """A profile file whose not_emulated is fail turns an op verify cannot emulate into a breach."""
    profile = tmp_path / "strict.yaml"
    profile.write_text((resources.rules_dir() / "tolerances" / "q8_0.yaml").read_text()
                       .replace("name: q8_0", "name: strict").replace("not_emulated: warn", "not_emulated: fail"))
    rules = tmp_path / "marlin.yaml"
    rules.write_text(ws.rules("qwen3_moe").read_text().replace('generate_op: "KExpertsCPU"', 'generate_op: "KExpertsMarlin"')
                     .replace('generate_device: "cpu"', 'generate_device: "cuda"').replace('      out_device: "cuda"\n', ""))
    res = _verify(ws, "qwen3_moe", "--weights", ws.gguf("qwen3_moe", "Q8_0"), "--tolerance", profile, "--rules", rules)
    assert res.exit_code == 1, res.output
    assert "NOT EMULATED" in res.stdout and "injection: not_emulated" in res.stdout
    warn = _verify(ws, "qwen3_moe", "--weights", ws.gguf("qwen3_moe", "Q8_0"), "--tolerance", "q8_0", "--rules", rules)
    assert warn.exit_code == 0 and "not emulated" in warn.stdout


def test_shipped_profiles_are_valid_and_checked_by_check_rules():
    names = set(shipped_profiles())
    assert {"f32", "q8_0", "q4_k"} <= names
    for name in names:
        assert load_profile(name).name == name
    res = CliRunner().invoke(cli, ["check-rules", "--strict", str(resources.rules_dir() / "tolerances")])
    assert res.exit_code == 0, res.output


# --- unusable inputs: one line, exit 3 (2 for usage) ----------------------------------------------------------
def test_missing_golden(ws, tmp_path):
    line = _error(_verify(ws, "qwen3_moe", golden=tmp_path / "nope"))
    assert "manifest.yaml: golden manifest not found" in line


def test_golden_of_another_model(ws):
    line = _error(_verify(ws, "qwen3_moe", golden=ws.golden("qwen2_moe")))
    assert "config.json differs from the one golden 'qwen2_moe' was made with" in line


def test_golden_of_other_weights(ws, tmp_path):
    model = tmp_path / "m"
    shutil.copytree(ws.model("qwen3_moe"), model)
    data = bytearray((model / "model.safetensors").read_bytes())
    data[-1] ^= 0x01  # one weight's last byte: same config, different weights
    (model / "model.safetensors").write_bytes(bytes(data))
    line = _error(_verify(ws, "qwen3_moe", model=model))
    assert "model.safetensors: weights differ from those golden 'qwen3_moe' was made with" in line


def test_weights_missing_a_tensor(ws):
    partial = ws.gguf("qwen2_moe", "Q8_0", drop=("blk.1.ffn_down_exps.weight",))
    line = _error(_verify(ws, "qwen2_moe", "--weights", partial))
    assert "experts of layer 1: no tensor blk.1.ffn_down_exps.weight" in line


def test_weights_missing_a_non_expert_tensor(ws):
    partial = ws.gguf("qwen2_moe", "Q8_0", drop=("blk.0.attn_norm.weight", "output_norm.weight"))
    line = _error(_verify(ws, "qwen2_moe", "--weights", partial))
    assert "2 tensor(s) the model needs are missing: blk.0.attn_norm.weight (model.layers.0.input_layernorm.weight)" in line


def test_weights_not_found(ws, tmp_path):
    line = _error(_verify(ws, "qwen2_moe", "--weights", tmp_path / "x.gguf"))
    assert "weights not found" in line



@pytest.mark.parametrize("flag", ["--weights", "--prefill-weights"])
def test_a_kt_amx_directory_as_weights_is_sent_to_kt_weights(ws, tmp_path, flag):
    # kt-kernel's AMX expert blobs hold no attention or norms: the directory is read through --kt-weights
    from ktconvert.convert import convert

    amx = tmp_path / "amx"
    convert(ws.model("qwen3_moe"), amx, type="AMXINT8", format="kt-amx")
    line = _error(_verify(ws, "qwen3_moe", flag, amx), code=2)
    assert f"{amx}: this is a kt-amx directory (kt-kernel's AMX expert blobs, no other weights)" in line
    assert "--kt-weights" in line and "no tensor" not in line

def test_bad_tolerance_file(ws, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("kind: tolerance-profile\nversion: 1\nname: bad\ndescription: x\nlogits:\n  kl_maxx: 1\n")
    line = _error(_verify(ws, "qwen3_moe", "--tolerance", bad))
    assert "bad.yaml:6:3: not a valid tolerance profile: Additional properties are not allowed ('kl_maxx'" in line
    broken = tmp_path / "broken.yaml"
    broken.write_text("kind: tolerance-profile\nlogits: [\n")
    assert "broken.yaml:" in _error(_verify(ws, "qwen3_moe", "--tolerance", broken))


def test_unknown_profile_name(ws):
    line = _error(_verify(ws, "qwen3_moe", "--tolerance", "q9_9"))
    assert f"no tolerance profile named 'q9_9' (shipped: {', '.join(shipped_profiles())})" in line


def test_auto_profile_follows_the_least_precise_expert_type(ws, tmp_path):
    from ktconvert import quant

    def layer1_q8_0(name, data, qtype):  # F32 experts except layer 1's, which become Q8_0
        if name.startswith("blk.1.ffn_") and name.endswith("_exps.weight"):
            return quant.quantize(data, "Q8_0"), "Q8_0"
        return data, qtype

    mixed = rewrite_gguf(ws.gguf("qwen3_moe", "F32"), tmp_path / "mixed.gguf", layer1_q8_0)
    res = _verify(ws, "qwen3_moe", "--weights", mixed)
    assert res.exit_code == 0 and "profile q8_0" in res.stdout, res.output


def test_experts_of_another_shape(ws, tmp_path):
    def four_experts(name, data, qtype):
        return (data[:4], qtype) if name == "blk.1.ffn_gate_exps.weight" else (data, qtype)

    bad = rewrite_gguf(ws.gguf("qwen3_moe", "Q8_0"), tmp_path / "four.gguf", four_experts)
    line = _error(_verify(ws, "qwen3_moe", "--weights", bad))
    assert ("four.gguf:blk.1.ffn_gate_exps.weight: gate experts have shape [4, 256, 256] (numpy order), "
            "the config needs [8, 256, 256]") in line


def test_non_expert_tensor_of_another_shape(ws, tmp_path):
    def short_norm(name, data, qtype):
        return (data[:128], qtype) if name == "blk.0.attn_norm.weight" else (data, qtype)

    bad = rewrite_gguf(ws.gguf("qwen3_moe", "Q8_0"), tmp_path / "norm.gguf", short_norm)
    line = _error(_verify(ws, "qwen3_moe", "--weights", bad))
    assert "model.layers.0.input_layernorm.weight: shape [128] does not fit the model's [256]" in line


def test_auto_profile_without_a_profile_for_the_type(ws, monkeypatch):
    from ktconvert.verify import profile

    only = {"f32": shipped_profiles()["f32"]}  # whatever else ships, a type no profile lists
    monkeypatch.setattr(profile, "shipped_profiles", lambda: only)
    line = _error(_verify(ws, "qwen3_moe", "--weights", ws.gguf("qwen3_moe", "Q6_K")), code=2)
    assert "no shipped tolerance profile is meant for Q6_K experts" in line and "--tolerance" in line


def test_rules_with_errors(ws, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(ws.rules("qwen3_moe").read_text().replace('generate_op: "KExpertsCPU"', 'generate_op: "KExpertCPU"'))
    line = _error(_verify(ws, "qwen3_moe", rules=bad))
    assert "KT202" in line and "bad.yaml:" in line


def test_plot_without_matplotlib_is_an_environment_error(ws, tmp_path):
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        line = _error(_verify(ws, "qwen3_moe", "--plot", tmp_path / "p.png"))
        assert "--plot needs matplotlib, which is not installed (pip install matplotlib" in line
        assert not (tmp_path / "p.png").exists()
    else:
        pytest.skip("matplotlib is installed; the plot test covers it")


def test_plot_with_matplotlib(ws, tmp_path):
    pytest.importorskip("matplotlib")
    res = _verify(ws, "qwen3_moe", "--plot", tmp_path / "p.png")
    assert res.exit_code == 0 and (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_verify_does_not_import_torch_before_it_runs():
    """The CLI group lists verify without importing torch (check-rules stays torch-free)."""
    import subprocess
    import sys

    code = ("import sys; from ktconvert.cli import cli; import ktconvert.cli.verify, ktconvert.verify; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"


def test_rules_written_for_another_family_are_refused(ws):
    """deepseek_v3 rules on a qwen3_moe model used to PASS: their classes match nothing and everything stays default."""
    line = _error(_verify(ws, "qwen3_moe", rules=ws.rules("deepseek_v3")))
    assert "the rules are written for deepseek_v3 (their match classes), the model is qwen3_moe" in line
    assert "deepseek_v3.yaml:rule " in line and "rules/optimize/qwen3_moe.yaml" in line
