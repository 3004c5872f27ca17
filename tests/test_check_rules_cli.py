"""check-rules through the CLI: exit codes, output formats, hostile input, and the torch-free fast path."""

from __future__ import annotations

import json
import subprocess
import sys

import jsonschema
import pytest
from click.testing import CliRunner

from ktconvert.cli import cli
from ktconvert.io.resources import load_schema
from ktconvert.rules import modeltree

from conftest import REPO

GOOD = '- match: {name: "^model\\\\.embed_tokens$"}\n  replace: {class: default, kwargs: {generate_device: cpu, prefill_device: cpu}}\n'
TYPO = '- match: {name: "^model$"}\n  replace:\n    class: ktransformers.operators.models.KDeepseekV2Model\n    kwargs: {per_layer_prefill_input_threshold: 0}\n'


def run(*args):
    return CliRunner().invoke(cli, list(map(str, args)), catch_exceptions=False)


@pytest.fixture
def files(tmp_path):
    (tmp_path / "good.yaml").write_text(GOOD)
    (tmp_path / "typo.yaml").write_text(TYPO)
    return tmp_path


def test_clean_file_exits_0(files):
    r = run("check-rules", files / "good.yaml")
    assert r.exit_code == 0, r.output
    assert "1 file checked" in r.output and "0 error(s)" in r.output


def test_findings_exit_1_with_file_line_col_and_suggestion(files):
    r = run("check-rules", files / "typo.yaml")
    assert r.exit_code == 1
    assert f"{files / 'typo.yaml'}:4:14: KT206 error" in r.output
    assert "did you mean 'per_layer_prefill_intput_threshold'?" in r.output


def test_shipped_rules_directory_is_clean():
    r = run("check-rules", "--strict", REPO / "rules")
    assert r.exit_code == 0, r.output
    assert "0 error(s), 0 warning(s)" in r.output


@pytest.mark.parametrize("family", modeltree.FAMILIES)
def test_shipped_rules_are_clean_against_their_model(tmp_path, family):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(modeltree.PROBE_CONFIGS[family]))
    targets = sorted(p for p in (REPO / "rules" / "optimize").glob(f"{family}*.yaml")
                     if p.stem.split("-")[0] == family)  # not deepseek_v32.yaml for deepseek_v3
    assert targets
    r = run("check-rules", "--strict", "--model", cfg, *targets)
    assert r.exit_code == 0, r.output


# --- hostile input: one line naming the file, the right exit code, nothing else --------------------------
def _one_error_line(output: str, path) -> str:
    lines = [l for l in output.splitlines() if str(path) in l]
    assert lines, output
    assert "Traceback" not in output
    return lines[0]


def test_empty_file_is_a_finding(tmp_path):
    p = tmp_path / "empty.yaml"
    p.write_text("")
    r = run("check-rules", p)
    assert r.exit_code == 1
    assert "KT103" in _one_error_line(r.output, p) and "empty" in r.output


def test_mapping_instead_of_list(tmp_path):
    p = tmp_path / "map.yaml"
    p.write_text("match: {name: x}\nreplace: {class: default}\n")
    r = run("check-rules", p)
    assert r.exit_code == 1
    assert "a YAML list of rules, found a dict" in _one_error_line(r.output, p)


def test_binary_file_exit_3(tmp_path):
    p = tmp_path / "model.yaml"
    p.write_bytes(b"PK\x03\x04\x00\x00binary")
    r = run("check-rules", p)
    assert r.exit_code == 3
    assert "binary file" in _one_error_line(r.output, p)


def test_invalid_utf8_exit_3(tmp_path):
    p = tmp_path / "latin1.yaml"
    p.write_bytes("- match: {name: 'caf\xe9'}\n".encode("latin-1"))
    r = run("check-rules", p)
    assert r.exit_code == 3
    assert "invalid UTF-8 at byte" in _one_error_line(r.output, p)


def test_50_mb_file_exit_3_without_reading_it(tmp_path):
    p = tmp_path / "huge.yaml"
    with open(p, "wb") as fh:
        fh.truncate(50 * 1000 * 1000)
    r = run("check-rules", p)
    assert r.exit_code == 3
    assert "50.0 MB" in _one_error_line(r.output, p)


def test_directory_without_yaml_exit_3(tmp_path):
    (tmp_path / "notes.txt").write_text("nothing")
    r = run("check-rules", tmp_path)
    assert r.exit_code == 3
    assert "holds no .yaml or .yml file" in _one_error_line(r.output, tmp_path)


def test_missing_path_exit_3(tmp_path):
    r = run("check-rules", tmp_path / "nope.yaml")
    assert r.exit_code == 3 and "no such file or directory" in r.output


def test_unreadable_file_does_not_hide_findings_in_others(files):
    (files / "bin.yaml").write_bytes(b"\x00\x00")
    r = run("check-rules", files)
    assert r.exit_code == 3
    assert "KT206" in r.output and "binary file" in r.output


@pytest.mark.parametrize("args,needle", [
    (["check-rules"], "give at least one rule file"),
    (["check-rules", "--select", "KT9", "x.yaml"], "'KT9' names no check"),
    (["check-rules", "--explain", "x.yaml"], "--explain needs --model"),
    (["check-rules", "--backend", "nope", "x.yaml"], "Invalid value for '--backend'"),
])
def test_usage_errors_exit_2(args, needle):
    r = run(*args)
    assert r.exit_code == 2 and needle in r.output


def test_unsupported_model_family_is_said_plainly(files, tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "ernie4_5_moe", "num_hidden_layers": 4}))
    r = run("check-rules", "--model", cfg, files / "good.yaml")
    assert r.exit_code == 3
    assert "config.json:model_type: model_type 'ernie4_5_moe' is not one of the supported families (qwen2_moe," in r.output
    assert "check-rules without --model still runs the model-independent checks" in r.output



def test_a_release_model_type_that_names_its_family_by_architectures_is_checked(tmp_path):
    # Kimi-K2's model_type kimi_k2 is DeepseekV3ForCausalLM: quantize converts it, so check-rules --model checks it
    from ktconvert.model.tiny import tiny_config

    cfg = tiny_config("deepseek_v3", variant="kimi_k2")
    assert cfg["model_type"] == "kimi_k2"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    r = run("check-rules", "--model", tmp_path / "config.json", REPO / "rules" / "optimize" / "deepseek_v3.yaml")
    assert r.exit_code == 0, r.output

# --- outputs and options ----------------------------------------------------------------------------------
def test_json_output_follows_its_schema(files):
    r = run("check-rules", "-o", "json", files)
    assert r.exit_code == 1
    doc = json.loads(r.output)
    jsonschema.validate(doc, load_schema("check-rules-report"))
    assert doc["status"] == "fail" and doc["summary"]["errors"] == 1
    (finding,) = doc["findings"]
    assert finding["id"] == "KT206" and finding["rule_index"] == 0 and finding["path"] == "$[0].replace.kwargs.per_layer_prefill_input_threshold"


def test_github_annotations(files):
    r = run("check-rules", "-o", "github", files / "typo.yaml")
    assert r.exit_code == 1
    assert r.output.startswith(f"::error file={files / 'typo.yaml'},line=4,col=14,title=KT206::")


def test_strict_select_and_ignore(tmp_path):
    p = tmp_path / "warn.yaml"
    p.write_text('- match: {name: "^model.embed_tokens$"}\n  replace: {class: default, kwargs: {generate_device: cpu, prefill_device: cpu}}\n')
    assert run("check-rules", p).exit_code == 0
    assert run("check-rules", "--strict", p).exit_code == 1
    assert run("check-rules", "--strict", "--ignore", "KT302", p).exit_code == 0
    assert run("check-rules", "--strict", "--select", "KT2", p).exit_code == 0


def test_list_checks():
    r = run("check-rules", "--list-checks")
    assert r.exit_code == 0
    assert "KT204  error" in r.output and "KT401  warning" in r.output


def test_explain_prints_the_injection_plan(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(modeltree.PROBE_CONFIGS["deepseek_v3"]))
    r = run("check-rules", "--model", cfg, "--explain", "-o", "json", REPO / "rules" / "optimize" / "deepseek_v3.yaml")
    assert r.exit_code == 0, r.output
    plan = {row["module"]: row for row in json.loads(r.output)["files"][0]["plan"]}
    assert plan["model.layers.5.mlp.experts"]["operator"] == "KTransformersExperts"
    assert plan["model.layers.5.mlp.experts"]["ops"] == {"generate_op": "KExpertsCPU", "prefill_op": "KExpertsTorch"}
    assert plan["model.layers.0.mlp"]["operator"] == "default"  # dense layer: the MoE rule's class excludes it
    assert "model.layers.5.mlp.experts.0.gate_proj" not in plan  # recursive: false
    assert plan["model.layers.5.self_attn.kv_b_proj"]["operator"] == "default"
    text = run("check-rules", "--model", cfg, "--explain", REPO / "rules" / "optimize" / "deepseek_v3.yaml").output
    assert "injection plan for" in text and "model.layers.5.mlp.experts" in text


def test_user_catalog_is_layered_over_the_builtin(tmp_path):
    rules = tmp_path / "r.yaml"
    rules.write_text('- match: {name: "^model\\\\.layers\\\\.[0-9]+\\\\.mlp$"}\n  replace: {class: mylab.ops.FastMoE, kwargs: {tile: 64}}\n')
    assert run("check-rules", rules).exit_code == 1
    cat = tmp_path / "cat.yaml"
    cat.write_text("kind: operator-catalog\nversion: 1\noperators:\n  mylab.ops.FastMoE:\n    role: moe-block\n"
                   "    backends: [ktransformers]\n    contract: hf\n    replaces: [moe-block]\n    kwargs: {tile: {type: int, min: 1}}\n")
    r = run("check-rules", "--catalog", cat, rules)
    assert r.exit_code == 0, r.output
    bad = tmp_path / "bad-cat.yaml"
    bad.write_text("kind: operator-catalog\nversion: 1\noperators:\n  x.Y: {role: wizard}\n")
    r = run("check-rules", "--catalog", bad, rules)
    assert r.exit_code == 3 and f"{bad}:4:" in r.output and "not a valid operator catalog" in r.output


def test_check_rules_never_imports_torch_or_numpy(corpus_dir):
    code = ("import sys; from ktconvert.cli import main\n"
            "try:\n    main(['-q', 'check-rules', sys.argv[1]])\nexcept SystemExit as e:\n    code = e.code\n"
            "bad = [m for m in ('torch', 'numpy', 'gguf', 'safetensors') if m in sys.modules]\n"
            "print('HEAVY', bad, 'EXIT', code)")
    out = subprocess.run([sys.executable, "-c", code, str(corpus_dir)], capture_output=True, text=True, check=True).stdout
    # exit 1, not 0: two upstream files really fail (KNOWN_FAILING in test_check_rules_corpus.py); 3 would be a crash
    assert "HEAVY [] EXIT 1" in out, out


def test_python_dash_m_works():
    out = subprocess.run([sys.executable, "-m", "ktconvert", "check-rules", "--list-checks"], capture_output=True, text=True)
    assert out.returncode == 0 and "KT101" in out.stdout


# --- --weights (KT5xx) -----------------------------------------------------------------------------------
@pytest.fixture
def ds3(tmp_path):
    from rules_weights_helpers import write_gguf

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(modeltree.PROBE_CONFIGS["deepseek_v3"]))
    tree = modeltree.build_tree(modeltree.PROBE_CONFIGS["deepseek_v3"])
    complete, broken = tmp_path / "ok.gguf", tmp_path / "broken.gguf"
    write_gguf(complete, tree, experts_type="BF16")
    write_gguf(broken, tree, drop=("token_embd.weight", "blk.7.attn_kv_b.weight", "blk.9.ffn_down_exps.weight"))
    return cfg, complete, broken


def test_weights_complete_and_runnable_is_clean(ds3):
    cfg, complete, _ = ds3
    r = run("check-rules", "--strict", "--model", cfg, "--weights", complete, REPO / "rules" / "optimize" / "deepseek_v3.yaml")
    assert r.exit_code == 0, r.output


def test_weights_missing_tensors_point_at_the_rule_and_the_tensor(ds3):
    cfg, _, broken = ds3
    rules = REPO / "rules" / "optimize" / "deepseek_v3.yaml"
    r = run("check-rules", "-o", "json", "--model", cfg, "--weights", broken, rules)
    assert r.exit_code == 1
    found = {(f["rule_index"], f["message"].split(" ")[0]) for f in json.loads(r.output)["findings"] if f["id"] == "KT501"}
    text = rules.read_text().splitlines()
    by_msg = {m: i for i, m in found}
    assert "token_embd.weight" in by_msg and "blk.7.attn_kv_b.weight" in by_msg and "layer" in by_msg
    assert "embed_tokens" in text[[i for i, l in enumerate(text) if "embed_tokens" in l][0]]
    assert by_msg["blk.7.attn_kv_b.weight"] == 6  # the KDeepseekV2Attention rule loads kv_b_proj


def test_weights_type_the_op_cannot_run(ds3, tmp_path):
    cfg, complete, _ = ds3
    text = (REPO / "rules" / "optimize" / "deepseek_v3.yaml").read_text()
    amx = tmp_path / "amx.yaml"
    amx.write_text(text.replace('generate_op: "KExpertsCPU"', 'generate_op: "KExpertsCPU"\n      backend: "AMXInt8"'))
    assert run("check-rules", "--model", cfg, "--weights", complete, amx).exit_code == 0  # BF16 experts: fine
    from rules_weights_helpers import write_gguf

    f16 = tmp_path / "f16.gguf"
    write_gguf(f16, modeltree.build_tree(modeltree.PROBE_CONFIGS["deepseek_v3"]), experts_type="F16")
    r = run("check-rules", "--model", cfg, "--weights", f16, amx)
    assert r.exit_code == 1
    (line,) = [l for l in r.output.splitlines() if "KT502" in l]
    assert "are F16" in line and "AMXInt8" in line and "runs BF16" in line


def test_weights_errors(ds3, tmp_path):
    _, complete, _ = ds3
    rules = REPO / "rules" / "optimize" / "deepseek_v3.yaml"
    r = run("check-rules", "--weights", tmp_path / "missing.gguf", rules)
    assert r.exit_code == 3 and "missing.gguf" in r.output
    assert run("check-rules", "--weights", complete, rules).exit_code == 0  # the config.json beside it is used
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "m.gguf").write_bytes(complete.read_bytes())
    r = run("check-rules", "--weights", alone / "m.gguf", rules)  # no --model, no config.json beside the GGUF
    assert r.exit_code == 2 and "--weights needs the model's module tree" in r.output
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + b"\xff" * 64)
    r = run("check-rules", "--model", ds3[0], "--weights", junk, rules)
    assert r.exit_code == 3 and "junk.gguf" in r.output and "Traceback" not in r.output
