"""``verify --max-memory``: the reference and the injected candidate streamed layer by layer within a budget
smaller than the model give the numbers of the in-memory verify, bit for bit; the teacher-forced per-layer error
names the planted layer; a budget below one layer's minimum and a golden of another model are one line each."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from verify_helpers import FAMILIES, Workspace, experts_path, gate_path, vanish_mid_run
from ktconvert.cli import cli
from ktconvert.golden.stream import float32_bytes
from ktconvert.io import resources
from ktconvert.verify import run_verify

FAULT_LAYER = 1


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    return Workspace(tmp_path_factory.mktemp("verify-stream"))


def _budget(ws, family) -> int:
    """Half the float32 model: smaller than the model, above every tiny family's one-layer minimum."""
    return float32_bytes(ws.model(family)) // 2


def _run(ws, family, weights, **kw):
    return run_verify(ws.model(family), ws.rules(family), ws.golden(family), weights=weights, **kw)


def _numbers(report) -> dict:
    """Every number and finding of the report but how the run held its weights (and its wall time)."""
    d = report.as_dict()
    for k in ("run", "seconds", "notes"):
        d.pop(k, None)
    return d


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
@pytest.mark.parametrize("family", FAMILIES)
def test_streamed_verify_is_bit_identical_to_the_in_memory_one(ws, family, qtype):
    weights = ws.gguf(family, qtype)
    budget = _budget(ws, family)
    seen = []
    mem = _run(ws, family, weights)
    st = _run(ws, family, weights, max_memory=budget, progress=lambda *a: seen.append(a))
    assert mem.run["mode"] == "resident" and mem.run["max_memory_default"]
    assert st.run["mode"] == "stream" and st.run["max_memory"] == budget < float32_bytes(ws.model(family))
    assert st.run["bytes_read"] > 0 and 0 < st.run["peak_rss"] <= st.run["peak_rss_tree"]
    assert 0 < st.run["peak_resident_weights"] <= budget  # the operators' decoded experts too
    assert _numbers(st) == _numbers(mem)
    for a, b in zip(mem.phases, st.phases):
        assert np.array_equal(a.candidate_logits, b.candidate_logits)
        assert a.forced is not None and [v for _, v in a.forced] == [v for _, v in b.forced]
    layers = len(mem.phases[0].layers) - 1  # both phases in one pass over the layers: one line per layer
    assert seen == [("prefill+decode", i + 1, layers, seen[i][3]) for i in range(layers)]


@pytest.mark.parametrize("family", FAMILIES)
def test_streamed_hf_safetensors_candidate_is_read_part_by_part_and_bit_identical(ws, family):
    """The model's own Hugging Face weights as the candidate: its source reads nothing until a part asks (the expert
    types come from the headers), each part as the streamed reference reads it, dropped when the part ends; the
    numbers are the in-memory run's. The budget is the least both models run in (a CPU-experts operator keeps its
    layer's stored safetensors experts in memory, which the minimum counts), still below the float32 model."""
    import re

    from ktconvert.errors import UsageProblem
    from ktconvert.model import load_config
    from ktconvert.model.ops.source import WeightSource

    src = WeightSource(ws.model(family), load_config(ws.model(family)))
    assert src.expert_types() and src._state.parts == {}  # nothing read yet
    need = []
    for localize in (True, False):  # the reference's minimum is checked first, the candidate's alone without it
        with pytest.raises(UsageProblem) as exc:
            _run(ws, family, None, max_memory=1, localize=localize)
        need.append(int(re.search(r"\((\d+) bytes\)", exc.value.message).group(1)))
    budget = max(need)
    assert budget < float32_bytes(ws.model(family))
    mem = _run(ws, family, None)
    st = _run(ws, family, None, max_memory=budget)
    assert st.run["mode"] == "stream" and 0 < st.run["peak_resident_weights"] <= budget
    assert _numbers(st) == _numbers(mem)
    for a, b in zip(mem.phases, st.phases):
        assert np.array_equal(a.candidate_logits, b.candidate_logits)


@pytest.mark.parametrize("fault,module", [("gate-up-swapped", experts_path), ("router-transposed", gate_path)])
@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3", "qwen3_next", "glm_moe_dsa"])
def test_streamed_localisation_and_teacher_forced_error_name_the_planted_layer(ws, family, fault, module):
    weights = ws.gguf(family, "F32", faults=[(fault, FAULT_LAYER)])
    mem = _run(ws, family, weights)
    st = _run(ws, family, weights, max_memory=_budget(ws, family))
    assert not st.passed
    for a, b in zip(mem.phases, st.phases):
        assert b.localization == a.localization
        loc = b.localization
        assert loc["layer"] == f"layer {FAULT_LAYER}" and loc["module"] == module(family, FAULT_LAYER)
        assert loc["forced_layer"] == f"layer {FAULT_LAYER}"
        forced = dict(b.forced)
        limit = st.profile.hidden_nmse
        # the layers before it add nothing over the limit; after it, free-running error is large but each layer
        # alone on the reference's input adds far less than the planted one
        assert all(forced[f"layer {i}"] <= limit for i in range(FAULT_LAYER))
        assert forced[f"layer {FAULT_LAYER}"] == max(forced.values())


def test_teacher_forced_error_of_a_clean_conversion_stays_under_the_limit(ws):
    rep = _run(ws, "qwen3_moe", ws.gguf("qwen3_moe", "Q8_0"), max_memory=_budget(ws, "qwen3_moe"))
    assert rep.passed
    for p in rep.phases:
        assert p.localization["forced_layer"] is None
        assert all(v <= rep.profile.hidden_nmse for _, v in p.forced)


def _verify(ws, family, *extra, golden=None):
    args = ["verify", "--model", str(ws.model(family)), "--rules", str(ws.rules(family)),
            "--golden", str(golden or ws.golden(family)), *map(str, extra)]
    return CliRunner().invoke(cli, args, catch_exceptions=False)


def _files(root) -> set:
    return {p for p in root.rglob("*")}


def _one_line(res, code):
    assert res.exit_code == code, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("ktconvert: error: "), res.stderr
    assert res.stdout == ""
    return lines[0]


def test_cli_streamed_json_matches_the_schema_and_says_how_it_ran(ws):
    import jsonschema

    weights = ws.gguf("qwen2_moe", "F32", faults=[("gate-up-swapped", FAULT_LAYER)])
    res = _verify(ws, "qwen2_moe", "--weights", weights, "--max-memory", _budget(ws, "qwen2_moe"), "-o", "json")
    assert res.exit_code == 1, res.output
    report = json.loads(res.stdout)
    jsonschema.Draft202012Validator(resources.load_schema("verify-report")).validate(report)
    assert report["run"]["mode"] == "stream" and not report["run"]["max_memory_default"]
    assert [x["layer"] for x in report["phases"]["decode"]["forced"]] == ["embed", "layer 0", "layer 1"]
    text = _verify(ws, "qwen2_moe", "--weights", weights, "--max-memory", _budget(ws, "qwen2_moe"), "--progress")
    assert "prefill+decode: layer 2/2" in text.stderr  # both phases in one pass over the layers
    assert "streamed layer by layer within budget" in text.stdout
    assert f"decode: layer {FAULT_LAYER} alone adds NMSE" in text.stdout


def test_budget_below_one_layer_is_one_line_naming_the_minimum(ws):
    weights = ws.gguf("qwen2_moe", "Q8_0")
    before = _files(ws.root)
    line = _one_line(_verify(ws, "qwen2_moe", "--weights", weights, "--max-memory", "64KiB"), 2)
    assert "--max-memory 64 KiB is below the minimum" in line and "layer" in line and "pass --max-memory" in line
    need = int(line.split("(")[1].split(" bytes")[0])
    assert _files(ws.root) == before
    ok = _verify(ws, "qwen2_moe", "--weights", weights, "--max-memory", need)
    assert ok.exit_code == 0, ok.output


def test_golden_of_another_model_is_one_line_when_streamed(ws):
    weights = ws.gguf("qwen2_moe", "Q8_0")
    before = _files(ws.root)
    line = _one_line(_verify(ws, "qwen2_moe", "--weights", weights, "--max-memory", "1GiB",
                             golden=ws.golden("qwen3_moe")), 3)
    assert "config.json differs from the one golden" in line
    assert _files(ws.root) == before


def test_release_disappearing_mid_run_is_one_line(ws, tmp_path, monkeypatch):
    """The streamed reference reads the release layer by layer: its file going away mid-run is one line, exit 3,
    and nothing is written."""
    import shutil

    model = tmp_path / "m"
    shutil.copytree(ws.model("qwen2_moe"), model)
    gguf = ws.gguf("qwen2_moe", "Q8_0")
    vanish_mid_run(monkeypatch, model / "model.safetensors")
    before = _files(tmp_path) - {model / "model.safetensors"}
    args = ["verify", "--model", str(model), "--rules", str(ws.rules("qwen2_moe")), "--golden",
            str(ws.golden("qwen2_moe")), "--weights", str(gguf), "--max-memory", str(_budget(ws, "qwen2_moe"))]
    line = _one_line(CliRunner().invoke(cli, args, catch_exceptions=False), 3)
    assert "model.safetensors" in line and "No such file" in line
    assert _files(tmp_path) == before


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_vl_moe"])  # qwen3_vl_moe: fused gate_up_proj experts
def test_one_swapped_expert_is_named_resident_and_streamed(ws, family):
    """Layer 1's expert 2 alone has gate and up swapped: localisation names layer 1, and the report names expert 2,
    whose error on the reference's own expert input is large while every other expert's is the CPU experts op's rounding."""
    weights = ws.gguf(family, "F32", faults=[("gate-up-swapped", FAULT_LAYER, 2)])
    mem = _run(ws, family, weights)
    st = _run(ws, family, weights, max_memory=_budget(ws, family))
    assert mem.run["mode"] == "resident" and st.run["mode"] == "stream"
    for rep in (mem, st):
        assert not rep.passed
        for phase in rep.phases:
            loc = phase.localization
            assert loc["forced_layer"] == f"layer {FAULT_LAYER}", (phase.name, loc)
            assert loc["expert"] == 2 and loc["expert_nmse"] > 1e-2, (phase.name, loc)
            rows = {r["expert"]: r for r in phase.experts[f"layer {FAULT_LAYER}"]}
            assert loc["expert_tokens"] == rows[2]["tokens"] > 0
            # the others: only the CPU experts op's own rounding (measured: 1e-5 against 0.4)
            assert max(r["nmse"] for e, r in rows.items() if e != 2) < 1e-3 * loc["expert_nmse"]
            # and it stands out from its layer's other experts
            assert loc["outlier"]["layer"] == f"layer {FAULT_LAYER}" and loc["outlier"]["expert"] == 2, loc
    for a, b in zip(mem.phases, st.phases):
        assert a.experts == b.experts and a.localization == b.localization


def test_the_streamed_candidates_injection_keeps_nothing_it_decoded(ws, monkeypatch):
    """A streamed candidate's operators are built once at injection, to check and describe them, and again when
    their layer runs. The weights that first build decoded are not kept: before, the source held every layer's
    float32 weights from injection until the layer ran, outside the budget (the DeepSeek-V3-shaped benchmark's
    FP8 attention and dense MLP: 3 GB beside --max-memory 4GiB, a 5.6 GB process)."""
    import torch

    from ktconvert.model import executor

    held = []
    real = executor.InjectedWeights.__init__

    def spy(self, source, *args, **kw):  # right after inject(..., lazy=True), before any layer runs
        held.append(sorted(name for part in source._state.parts.values() for name, t in part.items()
                           if isinstance(t, torch.Tensor)))
        real(self, source, *args, **kw)

    monkeypatch.setattr(executor.InjectedWeights, "__init__", spy)
    rep = _run(ws, "deepseek_v3", None, max_memory=_budget(ws, "deepseek_v3"))
    assert rep.run["mode"] == "stream" and held == [[]], held[0][:5]


def _mapped_rss(path) -> int:
    """Bytes of ``path``'s pages this process has mapped in its resident set (``/proc/self/smaps``)."""
    total, mine = 0, False
    for line in open("/proc/self/smaps"):
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5:  # a mapping's first line: address range ... [path]
            mine = len(head) >= 6 and head[-1] == str(path)
        elif mine and head and head[0] == "Rss:":
            total += int(head[1]) * 1024
    return total


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/smaps"), reason="needs Linux's /proc/self/smaps")
def test_a_gguf_candidates_experts_leave_no_mapped_pages_resident(ws):
    """A GGUF candidate's experts are read with pread into a reused buffer, not through the file's memory map: pages
    touched through a map stay in the process's RSS (RssFile) until the layer is done, outside every budget (a real
    Qwen3-30B-A3B layer's picked Q8_0 experts were 220 MiB of it, the 1 GiB verify 100 MiB over). Reading every
    expert of a layer leaves none of the file's pages mapped, and decodes what the mapped bytes decode to."""
    from ktconvert import quant
    from ktconvert.model.ops.source import WeightSource
    from ktconvert.model import load_config

    path = ws.gguf("qwen3_moe", "Q8_0")
    src = WeightSource(path, load_config(ws.model("qwen3_moe")))
    blocks = src.expert_blocks(1)
    for p in ("gate", "up", "down"):
        b = getattr(blocks, p)
        for e in range(b.shape[0]):
            assert np.array_equal(b.expert(e), quant.dequantize(np.array(b.data[e]), b.qtype).reshape(b.shape[1:]))
    del b
    src.forget(1)
    blocks = src.expert_blocks(1)
    for p in ("gate", "up", "down"):
        for e in range(blocks.gate.shape[0]):
            getattr(blocks, p).expert(e)
    assert _mapped_rss(path) == 0


def test_a_streamed_candidates_head_is_read_once_per_pass(ws, monkeypatch):
    """Decode computes every position's logits with each vocabulary chunk of the candidate's lm_head read and
    decoded once for all of them (as the reference's head), not once per position: at a real vocabulary (151936
    rows of Q8_0) a 12-token decode decoded the head 12 times, 45 s of a 72 s verify. Prefill and decode run in one
    pass over the model, so each chunk is read once for both phases."""
    from ktconvert.model.modules import VOCAB_CHUNK
    from ktconvert.model.ops.source import WeightSource

    calls = []
    real = WeightSource.rows

    def rows(self, name, ids=None, span=None):
        if name == "lm_head.weight":
            calls.append(span)
        return real(self, name, ids, span)

    monkeypatch.setattr(WeightSource, "rows", rows)
    weights = ws.gguf("qwen3_moe", "Q8_0")
    mem = _run(ws, "qwen3_moe", weights)
    assert calls == []  # in memory: the whole head is decoded once, not by rows
    st = _run(ws, "qwen3_moe", weights, max_memory=_budget(ws, "qwen3_moe"))
    vocab = len(mem.phases[0].candidate_logits[0])
    chunks = -(-vocab // VOCAB_CHUNK)
    assert len(calls) == chunks  # prefill and decode (12 positions) in one pass: each chunk read once
    assert _numbers(st) == _numbers(mem)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_the_candidate_alone_runs_its_phases_in_one_pass_with_the_same_numbers(ws, family):
    """Without the reference (``localize=False``) the candidate still runs prefill and decode in one pass over its
    layers (one progress line per layer), and every number of each phase is the one the run with the reference
    gives the candidate: its logits, its statistics and each layer's hidden-state error, streamed and resident."""
    weights = ws.gguf(family, "Q8_0")
    paired = _run(ws, family, weights)
    for kw in ({}, {"max_memory": _budget(ws, family)}):
        seen = []
        alone = _run(ws, family, weights, localize=False, progress=lambda *a: seen.append(a), **kw)
        layers = len(alone.phases[0].layers) - 1
        assert [s[:3] for s in seen] == [("prefill+decode", i + 1, layers) for i in range(layers)]
        for a, b in zip(paired.phases, alone.phases):
            assert a.name == b.name and b.forced is None and b.modules is None
            assert np.array_equal(a.candidate_logits, b.candidate_logits)
            assert a.layers == b.layers and a.logits.summary() == b.logits.summary()
