"""What kt-kernel's LLAMAFILE method runs (rules/kernels/kt-llamafile.yaml), and the three places that refuse the
rest before a 61 GB load fails at the first prefill (ktransformers #1884): preflight, check-rules --weights and
quantize --for kt-llamafile. The table's logic is tested on tables of our own; the shipped table is re-measured
where kt-kernel is installed."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
from click.testing import CliRunner

from conftest import REPO
from ktconvert.cli import cli
from ktconvert.errors import InputError
from ktconvert.quant import WRITABLE, kt_llamafile

E, H, I = 8, 256, 256  # the tiny qwen3_moe: layers 0 and 1 are MoE


def _invoke(*args):
    return CliRunner().invoke(cli, [*map(str, args)])


def _table(path, entries):
    body = {"kind": "kt-llamafile-types", "version": 1, "measurements": entries}
    path.write_text(json.dumps(body))  # JSON is YAML
    return path


def _entry(variant, types):
    return {"kt_kernel": "0.7.2", "variant": variant, "cpu": None, "date": "2026-11-28", "command": "test",
            "layer": {"experts": 8, "top_k": 2, "hidden": 256, "inter": 256, "prefill_tokens": 64, "decode_tokens": 3},
            "types": {t: {"verdict": v, "quantizer": "ktconvert", "quant_error": q, "bound": 0.08,
                          **({"detail": "SIGABRT in the decode batch (3 tokens)"} if v == "aborts" else {})}
                      for t, (v, q) in types.items()}}


# --- the table ------------------------------------------------------------------------------------------------
def test_shipped_table_is_valid_and_says_where_it_was_measured():
    ms = kt_llamafile.measurements()
    assert ms and all(m["variant"] and m["kt_kernel"] and m["date"] for m in ms)
    measured = set.union(*(set(m["types"]) for m in ms))
    assert set(WRITABLE) <= measured  # every type ktconvert writes has a verdict
    assert {"Q4_K", "Q8_0", "BF16"} <= set(kt_llamafile.runnable())
    assert kt_llamafile.problem("Q4_1").message.startswith("kt-kernel 0.7.2's LLAMAFILE aborts the process on Q4_1")
    assert kt_llamafile.problem("IQ4_NL", 256).extra["alternative"] == "Q4_K"


def test_closest_type_loses_no_bits_fits_the_rows_and_breaks_ties_on_measured_error(tmp_path):
    t = _table(tmp_path / "t.yaml", [_entry("avx512_bf16", {
        "Q4_0": ("runs", 0.15), "Q4_K": ("runs", 0.12), "Q5_0": ("runs", 0.08), "Q8_0": ("runs", 0.01),
        "Q2_K": ("runs", 0.5), "IQ4_NL": ("aborts", 0.13), "IQ2_XXS": ("wrong", 0.6)})])
    assert kt_llamafile.closest("IQ4_NL", 256, t) == "Q4_K"  # 4.5 bpw: Q4_0 and Q4_K tie, Q4_K's error is lower
    assert kt_llamafile.closest("IQ4_NL", 288, t) == "Q4_0"  # rows of 288 hold no K-quant block
    assert kt_llamafile.closest("IQ2_XXS", 256, t) == "Q2_K"
    assert kt_llamafile.closest("F16", 256, t) == "Q8_0"  # nothing at or above 16 bpw runs: the most bits below
    assert kt_llamafile.closest("IQ4_NL", 7, t) is None
    p = kt_llamafile.problem("IQ4_NL", 7, t)
    assert p.extra["alternative"] is None and "holds rows of 7" in p.fix
    assert "has not been measured on Q6_K" in kt_llamafile.problem("Q6_K", 256, t).message


def test_a_type_failing_on_one_variant_is_refused_naming_that_variant(tmp_path):
    t = _table(tmp_path / "t.yaml", [_entry("avx512_bf16", {"Q4_K": ("runs", 0.12), "Q8_0": ("runs", 0.01)}),
                                     _entry("amx", {"Q4_K": ("aborts", 0.12), "Q8_0": ("runs", 0.01)})])
    assert kt_llamafile.runnable(t) == ["Q8_0"]
    p = kt_llamafile.problem("Q4_K", 256, t)
    assert "aborts the process on Q4_K weights (measured on its amx variant" in p.message and p.extra["alternative"] == "Q8_0"


def test_a_hostile_table_is_one_line_naming_the_file_and_place(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("kind: kt-llamafile-types\nversion: 1\nmeasurements:\n  - kt_kernel: '0.7.2'\n    variant: x\n")
    with pytest.raises(InputError) as exc:
        kt_llamafile.measurements(bad)
    assert str(bad) in exc.value.one_line() and "4:" in exc.value.one_line()


# --- the table is current -------------------------------------------------------------------------------------
@pytest.mark.slow  # three kt-kernel children (one per type: an abort takes its child down): ~20 s idle, 60 s on busy cores
def test_the_table_is_current_where_kt_kernel_runs():
    """Re-measure one type of each verdict the shipped table holds for ktconvert-written types: the verdicts must
    be the table's, on this machine's variant (or, for a variant the table lacks, on every variant it has)."""
    from kernel_helpers import require_kernel
    from ktconvert.kernel.llamafile_measure import measure_type

    info = require_kernel()
    ms = kt_llamafile.measurements()
    here = [m for m in ms if m["variant"] == info["variant"] and m["kt_kernel"] == info["version"]]
    against = here or ms
    stale = []
    for t in ("Q4_K", "IQ4_NL", "IQ4_XS"):  # runs, aborts, wrong (kt-kernel 0.7.2 on avx512_bf16)
        got = measure_type(t)
        for m in against:
            want = m["types"][t]
            if got["verdict"] != want["verdict"]:
                stale.append(f"{t}: {got['verdict']} here, {want['verdict']} in the {m['variant']} entry")
            elif here and got["verdict"] == "runs":  # same variant, same seeds: the same error within 1.5x
                for phase, e in want["error"].items():
                    ratio = got["error"][phase]["token_max"] / e["token_max"]
                    assert 1 / 1.5 < ratio < 1.5, (t, phase, got["error"], want["error"])
    assert not stale, (f"rules/kernels/kt-llamafile.yaml is stale for kt-kernel {info['version']} "
                       f"({info['variant']}): {stale}; rerun python benchmarks/measure_llamafile_types.py --write")


# --- refusals ---------------------------------------------------------------------------------------------------
def _expert_gguf(path, types: dict[str, str]) -> None:
    """The tiny qwen3_moe's expert tensors only (zero blocks), ``{tensor name: ggml type}`` (default Q8_0)."""
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    for layer in (0, 1):
        for p in ("gate", "up", "down"):
            name = f"blk.{layer}.ffn_{p}_exps.weight"
            qt = gguf.GGMLQuantizationType[types.get(name, "Q8_0")]
            bs, ts = gguf.GGML_QUANT_SIZES[qt]
            rows, cols = (I, H) if p != "down" else (H, I)
            w.add_tensor(name, np.zeros((E, rows, cols // bs * ts), dtype=np.uint8), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_preflight_refuses_expert_types_llamafile_cannot_run(tiny_root, tmp_path):
    from ktconvert.preflight import Launch, preflight

    mixed = tmp_path / "ud.gguf"  # an unsloth-style mix: IQ4_NL downs, one IQ2_XXS gate
    _expert_gguf(mixed, {"blk.0.ffn_down_exps.weight": "IQ4_NL", "blk.1.ffn_down_exps.weight": "IQ4_NL",
                         "blk.1.ffn_gate_exps.weight": "IQ2_XXS"})
    launch = dict(model_path=str(tiny_root / "qwen3_moe"), cpuinfer="1", threadpools="1", gpu_experts="0",
                  method="LLAMAFILE")
    report = preflight(Launch(weight_path=str(mixed), **launch))
    found = {f.where: f for f in report.findings}
    assert [f.id for f in report.findings] == ["PF141", "PF141"] and not report.passed
    nl = found["blk.0.ffn_down_exps.weight"]
    assert "aborts the process on IQ4_NL" in nl.message and "1 more expert tensor(s) in IQ4_NL" in nl.message
    assert "requantize the experts to Q4_K" in nl.fix
    xxs = found["blk.1.ffn_gate_exps.weight"]
    assert "IQ2_XXS" in xxs.message and "requantize the experts to Q2_K" in xxs.fix
    ok = tmp_path / "ok.gguf"
    _expert_gguf(ok, {})
    assert preflight(Launch(weight_path=str(ok), **launch)).findings == []
    res = _invoke("preflight", "--model-path", tiny_root / "qwen3_moe", "--kt-weight-path", mixed, "--kt-method",
                  "LLAMAFILE", "--kt-cpuinfer", "1", "--kt-threadpool-count", "1", "--kt-num-gpu-experts", "0")
    assert res.exit_code == 1, res.output
    (line,) = [ln for ln in res.output.splitlines() if "blk.0.ffn_down_exps.weight" in ln]
    assert "IQ4_NL" in line and "Q4_K" in line


def test_check_rules_weights_refuses_llamafile_experts_in_an_unrunnable_type(tmp_path):
    from rules_weights_helpers import write_gguf

    from ktconvert.rules import modeltree

    rules = REPO / "rules" / "optimize" / "deepseek_v3.yaml"
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(modeltree.PROBE_CONFIGS["deepseek_v3"]))
    tree = modeltree.build_tree(modeltree.PROBE_CONFIGS["deepseek_v3"])
    nl = tmp_path / "iq4_nl.gguf"
    write_gguf(nl, tree, experts_type="IQ4_NL")
    res = _invoke("check-rules", "--model", cfg, "--weights", nl, rules)
    assert res.exit_code == 1, res.output
    (line,) = [ln for ln in res.output.splitlines() if "KT502" in ln]
    assert "ffn_gate_exps.weight is IQ4_NL" in line and "aborts the process on IQ4_NL" in line
    assert "requantize the experts to Q4_0" in res.output  # rows of 32 here: the closest type that holds them
    q8 = tmp_path / "q8.gguf"
    write_gguf(q8, tree, experts_type="Q8_0")
    assert _invoke("check-rules", "--model", cfg, "--weights", q8, rules).exit_code == 0


def test_quantize_for_kt_llamafile_refuses_before_writing_and_names_the_override(tiny_root, tmp_path):
    src = tiny_root / "qwen3_moe"
    out = tmp_path / "out"
    res = _invoke("quantize", src, out, "--type", "Q4_1", "--for", "kt-llamafile")
    assert res.exit_code == 2, res.output
    assert "blk.0.ffn_gate_exps.weight would be written as Q4_1, which kt-llamafile cannot run" in res.output
    assert "--tensor-type '\\.ffn_(gate|up|down)_exps\\.weight$=Q5_K'" in res.output  # 5.0 bpw: the next up
    assert not out.exists() and list(tmp_path.iterdir()) == []
    res = _invoke("quantize", src, out, "--type", "Q4_1", "--tensor-type", r"\.ffn_(gate|up|down)_exps\.weight$=Q5_K",
                  "--for", "kt-llamafile", "--dry-run")
    assert res.exit_code == 0, res.output  # the override the refusal names is accepted; non-experts stay Q4_1
    assert "Q4_1" in next(ln for ln in res.output.splitlines() if ln.strip().startswith("blk.0.attn_q.weight"))
    res = _invoke("quantize", src, out, "--recipe", "cpu-experts-Q4_K", "--to", "safetensors", "--for", "kt-llamafile",
                  "--dry-run")
    assert res.exit_code == 2 and "needs GGUF output" in res.output
    assert _invoke("quantize", src, out, "--recipe", "cpu-experts-Q4_K", "--for", "kt-llamafile",
                   "--dry-run").exit_code == 0


def test_quantize_for_kt_llamafile_from_a_gguf_it_cannot_run_names_the_requantize(tiny_root, tmp_path):
    """The field report's flow: a GGUF already in such a type, kept as is, then the override the refusal names."""
    from ktconvert.convert import convert

    q41 = convert(tiny_root / "qwen3_moe", tmp_path / "q41", type="Q4_1").out / "model.gguf"
    out = tmp_path / "out"
    res = _invoke("quantize", q41, out, "--type", "keep", "--for", "kt-llamafile")
    assert res.exit_code == 2 and not out.exists(), res.output
    override = r"\.ffn_(gate|up|down)_exps\.weight$=Q5_K"
    assert f"--tensor-type '{override}' --allow-requantize" in res.output
    res = _invoke("quantize", q41, out, "--type", "keep", "--tensor-type", override, "--allow-requantize",
                  "--for", "kt-llamafile", "--dry-run")
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert "Q4_1 -> Q5_K" in next(ln for ln in lines if ln.strip().startswith("blk.1.ffn_down_exps.weight"))
    assert "copy bytes" in next(ln for ln in lines if ln.strip().startswith("blk.0.attn_q.weight"))  # untouched
