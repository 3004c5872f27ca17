"""``benchmarks/bench_verify_scale.py`` at tiny scale, so the benchmark does not rot between its full-size runs:
its checkpoints read back as the models they claim to be (config, every tensor, value scales, the planted
expert's routing), the in-place gate/up swap moves exactly one expert's bytes, and (slow) the whole step
sequence runs and its fault verify names the planted layer and expert."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_verify_scale as bvs  # noqa: E402
from bench_convert import write_checkpoint  # noqa: E402


def _write(root: Path, kind: str, fault_layer: int = 1) -> Path:
    if kind == "qwen":
        config, stored, fill = bvs.qwen_model(bvs.QWEN_TINY, 2, fault_layer)
    else:
        config, stored, fill = bvs.deepseek_model(bvs.DEEPSEEK_TINY, fault_layer)
    out = root / kind
    write_checkpoint(out, 0, config=config, stored=stored, raws=bvs._raws(1 << 20), fill=fill)
    return out


def test_tiny_checkpoints_read_back_as_the_models_they_claim(tmp_path):
    from ktconvert.formats import open_checkpoint
    from ktconvert.model import load_config
    from ktconvert.model.weights import read_tensors

    qwen, ds = _write(tmp_path, "qwen"), _write(tmp_path, "deepseek")
    assert load_config(qwen).family == "qwen3_moe" and load_config(ds).family == "deepseek_v3"
    for model, (_, stored, _) in ((qwen, bvs.qwen_model(bvs.QWEN_TINY, 2, 1)), (ds, bvs.deepseek_model(
            bvs.DEEPSEEK_TINY, 1))):
        ck = open_checkpoint(model)
        assert {n: tuple(ck[n].shape) for n in ck} == {n: s for n, _, s in stored}
    t = read_tensors(ds)  # the FP8 release decoded as quantize decodes it
    w = t["model.layers.2.mlp.experts.3.gate_proj.weight"].float().numpy()
    assert 0.015 < w.std() < 0.025 and abs(w.mean()) < 0.002
    assert np.array_equal(t["model.layers.1.self_attn.kv_a_layernorm.weight"].float().numpy(), np.ones(64))
    bias = t["model.layers.1.mlp.gate.e_score_correction_bias"].float().numpy()
    planted = bvs.FAULT_EXPERT["deepseek"] % bvs.DEEPSEEK_TINY["E"]
    assert bias[planted] == 1.0 and np.count_nonzero(bias) == 1
    assert not np.any(t["model.layers.2.mlp.gate.e_score_correction_bias"].float().numpy())
    router = read_tensors(qwen)["model.layers.1.mlp.gate.weight"].float().numpy()
    stds = router.std(axis=1)
    boosted = bvs.FAULT_EXPERT["qwen"] % bvs.QWEN_TINY["E"]
    others = np.delete(stds, boosted)
    assert 5 < stds[boosted] / others.mean() < 7 and abs(others.mean() - bvs.ROUTER_STD) < 0.01


def test_gate_up_swap_moves_one_experts_bytes_and_nothing_else(tmp_path):
    from ktconvert.convert import convert
    from ktconvert.formats import open_checkpoint

    qwen = _write(tmp_path, "qwen")
    convert(qwen, tmp_path / "q8", format="gguf", type="Q8_0")
    gguf = tmp_path / "q8" / "model.gguf"
    before = gguf.read_bytes()
    touched = bvs.swap_gate_up(gguf, 1, 5)
    assert touched == ["blk.1.ffn_gate_exps.weight", "blk.1.ffn_up_exps.weight"]
    after = gguf.read_bytes()
    ck = open_checkpoint(gguf)
    g, u = ck["blk.1.ffn_gate_exps.weight"], ck["blk.1.ffn_up_exps.weight"]
    per = g.nbytes // g.shape[0]
    ga, ua = g.offset + 5 * per, u.offset + 5 * per
    assert after[ga:ga + per] == before[ua:ua + per] != before[ga:ga + per]
    assert after[ua:ua + per] == before[ga:ga + per]
    changed = np.flatnonzero(np.frombuffer(before, np.uint8) != np.frombuffer(after, np.uint8))
    assert changed.size and all(ga <= i < ga + per or ua <= i < ua + per for i in (changed[0], changed[-1]))
    bvs.swap_gate_up(gguf, 1, 5)
    assert gguf.read_bytes() == before
    with pytest.raises(SystemExit, match="no gate/up tensors of expert 5 in layer 1"):
        bvs.swap_gate_up(tmp_path / "q8", 1, 5)  # a directory without kt-amx experts


def test_fault_verdict_needs_the_planted_layer_in_every_phase():
    named = {"phases": {p: {"localization": {"layer": "layer 1", "forced_layer": "layer 1", "expert": 5}}
                        for p in ("prefill", "decode")}}
    assert bvs.fault_named(named, 1, 5)["layer_named"] and bvs.fault_named(named, 1, 5)["expert_named"]
    assert not bvs.fault_named(named, 0, 5)["layer_named"] and not bvs.fault_named(named, 1, 4)["expert_named"]
    other = json.loads(json.dumps(named))
    other["phases"]["decode"]["localization"]["forced_layer"] = "layer 0"
    assert not bvs.fault_named(other, 1, 5)["layer_named"]
    assert not bvs.fault_named({"phases": {}}, 1, 5)["layer_named"]
    # a 4-bit candidate on random weights breaks the limits first at a later layer: the outlier names the fault
    noisy = {"phases": {p: {"localization": {"layer": "layer 2", "forced_layer": None, "expert": 12,
                                             "outlier": {"layer": "layer 1", "expert": 5}}}
                        for p in ("prefill", "decode")}}
    got = bvs.fault_named(noisy, 1, 5)
    assert got["layer_named"] and got["expert_named"] and got["experts_reported"] == [5, 5]
    noisy["phases"]["decode"]["localization"]["outlier"] = None
    assert not bvs.fault_named(noisy, 1, 5)["layer_named"]


def test_cold_read_reads_every_byte(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a").write_bytes(b"x" * 1000)
    (tmp_path / "b").write_bytes(b"y" * 24)
    r = bvs.cold_read([tmp_path / "d", tmp_path / "b"], drop=False)
    assert r["bytes"] == 1024 and r["dropped"] is False


@pytest.mark.slow
def test_the_step_sequence_runs_and_names_the_planted_layer(tmp_path, monkeypatch):
    """golden --engine stream, quantize, verify, plant, verify again: the tiny Qwen through the benchmark's code;
    the fault verify names the planted layer (teacher-forced) and expert in both phases."""
    monkeypatch.delenv("CI", raising=False)  # the benchmark is a user's run: `golden` refuses to run under CI
    cands = [c for c in bvs.qwen_candidates("1GiB", 1) if c[0] == "Q8_0"]
    res = bvs.run_family("qwen", tmp_path, bvs.QWEN_TINY, 2, "1GiB", False, cands, ("Q8_0", 1, 5), 1)
    assert [s["step"] for s in res["steps"]] == ["golden --engine stream", "quantize Q8_0", "verify Q8_0",
                                                 "verify Q8_0, expert 5 gate/up swapped in layer 1"]
    assert not [s for s in res["steps"] if "failed" in s]
    fault = res["steps"][-1]["fault"]
    assert fault["tensors"] == ["blk.1.ffn_gate_exps.weight", "blk.1.ffn_up_exps.weight"]
    assert all(loc["forced_layer"] == "layer 1" for loc in fault["localization"].values()), fault
    assert fault["expert_named"] and fault["experts_reported"] == [5, 5], fault
    assert res["steps"][2]["run"]["mode"] == "stream" and res["steps"][2]["peak_rss_tree_mib"] > 0
    assert not (tmp_path / "qwen-src").exists() and not (tmp_path / "qwen-Q8_0").exists()
    assert "| qwen | verify Q8_0 |" in bvs.table({"models": [res]})
