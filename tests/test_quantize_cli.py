"""The quantize command line: dry-run plans (text and JSON) that read no data and write nothing, presets,
reports, paths it refuses, split GGUF output, and the memory budget's effect on the units of work."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from convert_helpers import read_gguf, tiny
from ktconvert.cli import cli


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("qcli")


def _invoke(*args):
    return CliRunner().invoke(cli, [*map(str, args)])


def test_dry_run_prints_the_plan_and_writes_nothing(root, tmp_path):
    src = tiny(root, "deepseek_v3")
    res = _invoke("quantize", src, tmp_path / "out", "--recipe", "Q4_K_M", "--dry-run")
    assert res.exit_code == 0, res.output
    assert list(tmp_path.iterdir()) == []
    out = res.stdout
    assert "recipe        Q4_K_M (preset Q4_K_M)" in out and "tokenizer     gpt2 (pre gpt-2, 512 tokens" in out
    # both shape orders, the rule, the operation, and the fallback taken, for each tensor
    line = next(ln for ln in out.splitlines() if ln.strip().startswith("blk.1.ffn_gate_exps.weight"))
    assert "Q4_K" in line and "[8, 256, 256]" in line and "stack 8 tensors, F32 -> Q4_K" in line
    assert "(fallback from Q4_K)" in next(ln for ln in out.splitlines() if "blk.0.attn_q_b.weight" in ln)
    assert "Q6_K" in next(ln for ln in out.splitlines() if ln.strip().startswith("blk.2.ffn_down_exps.weight"))


def test_dry_run_json_is_the_plan_as_data(root, tmp_path):
    src = tiny(root, "mixtral")
    res = _invoke("quantize", src, tmp_path / "out", "--type", "Q8_0", "--dry-run", "-o", "json")
    assert res.exit_code == 0 and list(tmp_path.iterdir()) == []
    plan = json.loads(res.stdout)
    assert plan["arch"] == "llama" and plan["format"] == "gguf" and plan["files"][0]["name"] == "model.gguf"
    by = {t["name"]: t for t in plan["output_tensors"]}
    q = by["blk.0.attn_q.weight"]
    assert q["operation"].startswith("reorder rows for llama.cpp's rope") and q["segments"][0]["heads"] == 4
    g = by["blk.1.ffn_gate_exps.weight"]
    assert g["shape"] == [8, 256, 256] and g["ne"] == [256, 256, 8] and g["type"] == "Q8_0"
    assert g["sources"] == sorted(f"model.layers.1.block_sparse_moe.experts.{e}.w1.weight" for e in range(8))
    assert g["bytes"] == 8 * 256 * 256 // 32 * 34 and g["rule"] == 1
    assert by["blk.0.ffn_gate_inp.weight"]["type"] == "F32" and by["blk.0.ffn_gate_inp.weight"]["copy_bytes"]
    assert plan["types"]["Q8_0"]["tensors"] + plan["types"]["F32"]["tensors"] == plan["tensors"] == len(by)


def test_list_recipes():
    res = _invoke("quantize", "--list-recipes")
    assert res.exit_code == 0
    names = [ln.split()[0] for ln in res.stdout.splitlines()]
    assert names == ["IQ1_M", "IQ1_S", "IQ2_M", "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ3_M", "IQ3_S", "IQ3_XS", "IQ3_XXS",
                     "IQ4_NL", "IQ4_XS", "Q2_K", "Q2_K_S", "Q3_K_L", "Q3_K_M", "Q3_K_S", "Q4_0", "Q4_K_M", "Q5_K_M",
                     "Q6_K", "Q8_0", "cpu-experts-Q4_K"]


def test_json_report_and_quiet_text(root, tmp_path):
    src = tiny(root, "qwen3_moe")
    res = _invoke("quantize", src, tmp_path / "a", "--type", "Q8_0", "-o", "json")
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert set(rep["files"]) == {"model.gguf"} and rep["units_resumed"] == 0 and rep["plan"]["tensors"] == 27
    res = _invoke("quantize", src, tmp_path / "b", "--type", "Q8_0")
    assert res.exit_code == 0 and res.stdout.startswith(f"wrote {tmp_path / 'b'} (1 file(s)")
    res = _invoke("-q", "quantize", src, tmp_path / "c", "--type", "Q8_0")
    assert res.exit_code == 0 and res.stdout == "" and res.stderr == ""
    assert (tmp_path / "a" / "model.gguf").read_bytes() == (tmp_path / "b" / "model.gguf").read_bytes()


def test_refuses_to_write_inside_the_input(root, tmp_path):
    import shutil

    src = tmp_path / "model"
    shutil.copytree(tiny(root, "qwen3_moe"), src)
    for out in (src / "q8", src):
        res = _invoke("quantize", src, out, "--type", "Q8_0", "--force")
        assert res.exit_code == 2 and "inside the input" in res.stderr
    res = _invoke("quantize", src / "model.safetensors", tmp_path, "--type", "Q8_0", "--force")
    assert res.exit_code == 2 and "the input lies inside the output directory" in res.stderr
    assert sorted(p.name for p in src.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json",
                                                    "tokenizer_config.json"]


def test_split_gguf_output_reads_back(root, tmp_path):
    """--shard-size splits a GGUF the way gguf-split does (split.* keys); ktconvert and gguf-py read the set."""
    from ktconvert.formats import open_checkpoint

    src = tiny(root, "qwen2_moe")
    whole = _invoke("quantize", src, tmp_path / "one", "--type", "F16")
    split = _invoke("quantize", src, tmp_path / "split", "--type", "F16", "--shard-size", "3MiB")
    assert whole.exit_code == split.exit_code == 0, split.output
    shards = sorted((tmp_path / "split").glob("model-*-of-*.gguf"))
    assert len(shards) > 2
    a, _ = read_gguf(tmp_path / "one" / "model.gguf")
    got = {}
    for i, s in enumerate(shards):
        t, r = read_gguf(s)
        assert r.fields["split.no"].contents() == i and r.fields["split.count"].contents() == len(shards)
        assert r.fields["split.tensors.count"].contents() == len(a)
        got.update(t)
    assert set(got) == set(a) and all(got[n][1].tobytes() == a[n][1].tobytes() for n in a)
    ck = open_checkpoint(shards[0])
    assert len(ck) == len(a) and ck.metadata["general.architecture"] == "qwen2moe"


def test_budget_sizes_the_units(root):
    from ktconvert.convert import plan_conversion
    from ktconvert.convert.execute import make_units

    plan = plan_conversion(tiny(root, "qwen3_moe"), type="Q4_K")
    for budget, jobs in ((64 * 1024, 1), (1024**2, 2), (256 * 1024**2, 1)):
        units = make_units(plan, budget, jobs)
        per_job = budget // jobs // 2
        for u in units:
            t = plan.tensors[u.tensor]
            if t.const is not None:
                continue
            work = (u.r1 - u.r0) * (8 * t.shape[-1] + t.row_bytes) + u.in_bytes
            assert work <= per_job or u.r1 - u.r0 == 1, (budget, t.name, work)
        covered = {}
        for u in units:
            covered.setdefault(u.tensor, []).append((u.r0, u.r1))
        for ti, spans in covered.items():  # every row exactly once
            spans.sort()
            assert spans[0][0] == 0 and spans[-1][1] == plan.tensors[ti].rows
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


def test_real_entry_point(root, tmp_path):
    src = tiny(root, "qwen3_moe")
    res = subprocess.run([sys.executable, "-m", "ktconvert", "quantize", str(src), str(tmp_path / "o"), "--type",
                          "Q9_0"], capture_output=True, text=True)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "not a ggml type" in res.stderr


def test_config_option_for_a_bare_checkpoint(root, tmp_path):
    src = tmp_path / "bare"
    src.mkdir()
    (src / "model.safetensors").write_bytes((tiny(root, "qwen3_moe") / "model.safetensors").read_bytes())
    res = _invoke("quantize", src, tmp_path / "out", "--type", "Q8_0", "--config", tiny(root, "qwen3_moe") / "config.json")
    assert res.exit_code == 0, res.output
    ref = _invoke("quantize", tiny(root, "qwen3_moe"), tmp_path / "ref", "--type", "Q8_0", "--no-tokenizer")
    assert ref.exit_code == 0
    a, ra = read_gguf(tmp_path / "out" / "model.gguf")
    b, _ = read_gguf(tmp_path / "ref" / "model.gguf")
    assert all(a[n][1].tobytes() == b[n][1].tobytes() for n in b) and set(a) == set(b)
    assert ra.fields["tokenizer.ggml.model"].contents() == "none"  # no tokenizer.json beside it
    assert ra.fields["qwen3moe.vocab_size"].contents() == 512


def test_type_fallback_is_an_error_unless_allowed_then_reported(root, tmp_path):
    """Issue 15: --type Q4_K on rows it cannot hold (DeepSeek's MLA rows of 64/128) silently wrote Q5_0. Now it is
    refused before anything is written; with --allow-fallback each fallback is on stderr and in the manifest."""
    src = tiny(root, "deepseek_v3")
    res = _invoke("quantize", src, tmp_path / "out", "--type", "Q4_K")
    assert res.exit_code == 3 and res.stdout == ""
    line = res.stderr.strip()
    assert "\n" not in line and "--type Q4_K" in line and "its fallback Q5_0 is not allowed" in line
    assert "--allow-fallback" in line and "(and " in line  # the other tensors are counted, not listed
    assert list(tmp_path.iterdir()) == []
    res = _invoke("-q", "quantize", src, tmp_path / "out", "--type", "Q4_K", "--allow-fallback")
    assert res.exit_code == 0 and res.stdout == "" and res.stderr == ""  # -q: nothing
    res = _invoke("quantize", src, tmp_path / "out2", "--type", "Q4_K", "--allow-fallback")
    assert res.exit_code == 0, res.output
    warned = [ln for ln in res.stderr.splitlines() if "fallback:" in ln]
    manifest = json.loads((tmp_path / "out2" / "manifest.json").read_text())
    fbs = manifest["plan"]["fallbacks"]
    assert fbs and len(warned) == len(fbs) and manifest["recipe"]["allow_fallback"] is True
    assert {"tensor": "blk.0.attn_q_b.weight", "asked": "Q4_K", "written": "Q5_0", "row": 128} in fbs
    assert any("blk.0.attn_q_b.weight written as Q5_0, not Q4_K (rows of 128)" in ln for ln in warned)


def test_recipe_can_forbid_its_fallbacks(root, tmp_path):
    src = tiny(root, "deepseek_v3")
    recipe = tmp_path / "strict.yaml"
    recipe.write_text("kind: convert-recipe\nname: strict\nallow_fallback: false\nrules:\n"
                      "  - {match: '.', type: Q4_K, fallback: [Q5_0, F16]}\n")
    res = _invoke("quantize", src, tmp_path / "out", "--recipe", recipe)
    assert res.exit_code == 3 and "allow_fallback: true" in res.stderr and f"{recipe}:5" in res.stderr
