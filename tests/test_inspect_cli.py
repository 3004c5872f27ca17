"""``ktconvert inspect``: text and JSON on real checkpoints, the JSON schema, --tensors, --scan, exit codes."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner

from formats_helpers import FAMILIES, H, I, gguf_from_hf, hf_checkpoint, kt_amx_checkpoint, write_gguf
from ktconvert.io import resources
from ktconvert.cli import cli


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("inspect")


@pytest.fixture(scope="module")
def validator():
    import jsonschema

    schema = resources.load_schema("inspect-report")
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def _run(*args):
    return CliRunner().invoke(cli, ["inspect", *map(str, args)], catch_exceptions=False)


def _json(validator, *args, code=0):
    res = _run(*args, "-o", "json")
    assert res.exit_code == code, res.output + res.stderr
    report = json.loads(res.stdout)
    errors = sorted(validator.iter_errors(report), key=lambda e: list(e.path))
    assert not errors, errors[0]
    assert report["exit_code"] == code
    return report


def _layers(report):
    return [(ly["layer"], ly["layout"], ly["n_experts"], ly["intermediate"], ly["hidden"]) for ly in report["layers"]]


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_json_reports_for_every_family_and_layout(root, validator, model_type):
    n_exp, moe_layers, arch, _ = FAMILIES[model_type]
    for kind, path in (("hf-split", hf_checkpoint(root, model_type, "split")),
                       ("hf-fused", hf_checkpoint(root, model_type, "fused")),
                       ("gguf-merged", gguf_from_hf(root, model_type) / "model.gguf")):
        r = _json(validator, path)
        assert r["architecture"]["arch"] == arch and r["layouts"] == [kind]
        assert _layers(r) == [(L, kind, n_exp, I, H) for L in moe_layers]
        assert not [p for p in r["problems"] if p["severity"] == "error"]


def test_json_legacy_split_set_and_kt_amx(root, validator):
    r = _json(validator, gguf_from_hf(root, "mixtral", legacy_split=True))
    assert _layers(r) == [(L, "gguf-split", 4, I, H) for L in range(3)]
    r = _json(validator, gguf_from_hf(root, "qwen3_moe", split_max_tensors=12) / "model-00003-of-00004.gguf")
    assert len(r["files"]) == 4 and _layers(r) == [(L, "gguf-merged", 8, I, H) for L in range(3)]
    assert r["gguf_version"] == 3
    r = _json(validator, kt_amx_checkpoint(root))
    assert [(ly["layout"], ly["quant"], ly["numa_parts"]) for ly in r["layers"]] == [("kt-amx", "AMXINT4", 2)] * 2
    assert _layers(r) == [(L, "kt-amx", 4, 256, 128) for L in (1, 2)]


def test_text_labels_both_shape_orders_and_folds_layers(root):
    res = _run(gguf_from_hf(root, "qwen3_moe") / "model.gguf")
    assert res.exit_code == 0 and res.stderr == ""
    out = res.stdout
    assert "numpy = slowest axis first" in out and "ggml ne = fastest axis first" in out
    assert "layers 0-2" in out and "gguf-merged  E=8  I=24  H=64" in out
    gate = next(line for line in out.splitlines() if line.strip().startswith("gate "))
    assert "Q8_0" in gate and "numpy [8, 24, 64]" in gate and "ggml ne [64, 24, 8]" in gate
    down = next(line for line in out.splitlines() if line.strip().startswith("down "))
    assert "F16" in down and "numpy [8, 64, 24]" in down and "ggml ne [24, 64, 8]" in down
    assert "quant types" in out and "bytes per tensor group" in out
    assert "architecture  qwen3moe (general.architecture)" in out


def test_quant_histogram_and_groups_add_up(root, validator):
    r = _json(validator, gguf_from_hf(root, "deepseek_v3") / "model.gguf")
    assert r["quant_types"]["Q8_0"]["tensors"] == 4  # gate and up of the two MoE layers
    assert set(r["quant_types"]) == {"Q8_0", "F16", "F32"}
    assert sum(q["bytes"] for q in r["quant_types"].values()) == r["total_bytes"]
    assert sum(g["tensors"] for g in r["groups"].values()) == r["n_tensors"]
    assert {"experts", "attention", "score_bias", "shared_experts", "dense_ffn", "router"} <= set(r["groups"])
    assert r["layers"][0]["score_bias"] == "blk.1.exp_probs_b.bias"


def test_tensors_regex_lists_matches_with_both_orders(root, validator):
    r = _json(validator, hf_checkpoint(root, "deepseek_v3", "split"), "--tensors", r"layers\.1\..*experts\.3\.(gate|down)")
    names = {t["name"]: t for t in r["tensors"]}
    assert set(names) == {"model.layers.1.mlp.experts.3.gate_proj.weight", "model.layers.1.mlp.experts.3.down_proj.weight"}
    g = names["model.layers.1.mlp.experts.3.gate_proj.weight"]
    assert g["numpy_shape"] == [I, H] and g["ggml_ne"] == [H, I] and g["expert"] == 3 and g["layer"] == 1
    assert g["gguf_name"] == "blk.1.ffn_gate_exps.weight" and g["group"] == "experts"
    assert "tensors" not in _json(validator, hf_checkpoint(root, "deepseek_v3", "split"))


def _poisoned_gguf(tmp_path):
    import gguf

    rng = np.random.default_rng(1)
    gate = rng.standard_normal((4, 32, 64)).astype(np.float32)
    gate[2, 5, 7] = np.nan
    up = rng.standard_normal((4, 32, 64)).astype(np.float32)
    up[1] = 0.0
    down = gguf.quants.quantize(rng.standard_normal((4, 64, 32)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    emb = rng.standard_normal((16, 64)).astype(np.float32)
    emb[3, :2] = np.inf
    return write_gguf(tmp_path / "poisoned.gguf", "qwen3moe", {
        "token_embd.weight": emb,
        "blk.0.ffn_gate_exps.weight": gate,
        "blk.0.ffn_up_exps.weight": up,
        "blk.0.ffn_down_exps.weight": (down, gguf.GGMLQuantizationType.Q8_0),
    })


def test_scan_names_nan_inf_and_zero_experts(tmp_path, validator):
    p = _poisoned_gguf(tmp_path)
    r = _json(validator, p, "--scan", code=1)
    found = {(f["kind"], f["tensor"], f["expert"], f["count"]) for f in r["scan"]["findings"]}
    assert found == {("nan", "blk.0.ffn_gate_exps.weight", 2, 1), ("all-zero", "blk.0.ffn_up_exps.weight", 1, 32 * 64),
                     ("inf", "token_embd.weight", None, 2)}
    assert r["scan"]["scanned_tensors"] == 4 and r["status"] == "fail"
    kinds = {(p["kind"], p["severity"]) for p in r["problems"]}
    assert {("nan", "error"), ("inf", "error"), ("zero-expert", "warning")} <= kinds
    res = _run(p, "--scan")
    assert res.exit_code == 1 and res.stderr == ""  # no progress bar when stderr is not a terminal
    assert "blk.0.ffn_gate_exps.weight[expert 2]: 1 NaN value(s)" in res.stdout
    assert "blk.0.ffn_up_exps.weight[expert 1]: all zeros" in res.stdout
    # --tensors limits the scan
    r = _json(validator, p, "--scan", "--tensors", "up_exps")
    assert [f["kind"] for f in r["scan"]["findings"]] == ["all-zero"] and r["exit_code"] == 0


def test_scan_skips_types_it_cannot_decode(tmp_path, validator):
    import gguf

    p = write_gguf(tmp_path / "q81.gguf", "qwen3moe", {
        "blk.0.attn_q.weight": (np.zeros((4, 2 * 40), np.uint8), gguf.GGMLQuantizationType.Q8_1),
        "blk.0.attn_k.weight": np.full((4, 64), np.nan, np.float32),
    })
    r = _json(validator, p, "--scan", code=1)
    [(tensor, why)] = [(s["tensor"], s["why"]) for s in r["scan"]["skipped"]]
    assert tensor == "blk.0.attn_q.weight" and why.startswith("cannot decode Q8_1 to float32")
    assert [(f["kind"], f["tensor"], f["count"]) for f in r["scan"]["findings"]] == [("nan", "blk.0.attn_k.weight", 256)]


def test_scan_clean_bf16_checkpoint(root, validator):
    r = _json(validator, hf_checkpoint(root, "qwen3_moe", "split", "bfloat16"), "--scan")
    assert r["scan"]["findings"] == [] and r["scan"]["skipped"] == []
    assert r["scan"]["scanned_bytes"] == r["total_bytes"]


def test_problems_fail_with_exit_1(root, tmp_path, validator):
    from safetensors.numpy import load_file, save_file

    src = hf_checkpoint(root, "mixtral", "split")
    t = load_file(src / "model.safetensors")
    del t["model.layers.2.block_sparse_moe.experts.1.w3.weight"]
    d = tmp_path / "broken"
    d.mkdir()
    save_file(t, d / "model.safetensors")
    (d / "config.json").write_text((src / "config.json").read_text())
    r = _json(validator, d, code=1)
    miss = [p for p in r["problems"] if p["kind"] == "missing-experts"]
    assert miss[0]["layer"] == 2 and "layer 2 up: 1 of 4 experts missing (1)" == miss[0]["message"]
    res = _run(d)
    assert res.exit_code == 1 and "error    [missing-experts] layer 2 up" in res.stdout
    cfg = tmp_path / "other.json"
    cfg.write_text(json.dumps({"model_type": "mixtral", "hidden_size": H, "intermediate_size": 32,
                               "num_local_experts": 4, "num_hidden_layers": 3}))
    r = _json(validator, src, "--config", cfg, code=1)
    assert r["config"]["source"] == str(cfg) and r["config"]["moe_intermediate_size"] == 32
    assert [p["message"] for p in r["problems"] if p["kind"] == "config-mismatch"][0] == (
        f"layer 0: I (expert intermediate size) is 24 but {cfg} says 32")


def test_progress_bar_only_on_a_terminal(monkeypatch):
    from ktconvert.cli.inspect_cmd import _progress_factory

    class Tty(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert _progress_factory(True)(1000) is None
    tty = Tty()
    monkeypatch.setattr(sys, "stderr", tty)
    assert _progress_factory(False)(1000) is None  # -q
    factory = _progress_factory(True)
    update = factory(1000)
    update(600)
    assert [bar.n for bar in factory.bars] == [600]
    for bar in factory.bars:
        bar.close()
    assert "scan:" in tty.getvalue()


def test_inspect_never_imports_torch(root):
    path = gguf_from_hf(root, "qwen3_moe") / "model.gguf"
    code = ("import sys\nfrom ktconvert.cli import main\n"
            f"try:\n    main(['inspect', {str(path)!r}, '--scan', '-o', 'json'])\nexcept SystemExit as e:\n    code = e.code\n"
            "assert code == 0, code\nassert 'torch' not in sys.modules and 'transformers' not in sys.modules\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def test_help_lists_the_options():
    res = CliRunner().invoke(cli, ["inspect", "--help"])
    assert res.exit_code == 0
    for opt in ("--format", "--tensors", "--config", "--scan", "Exit codes"):
        assert opt in res.output
    assert "inspect" in CliRunner().invoke(cli, ["--help"]).output
