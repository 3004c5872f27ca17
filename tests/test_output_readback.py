"""Every output form ktconvert writes is read back cleanly by its own ``inspect`` and ``check-rules --weights``
(issue 15: ``inspect`` took ``--to safetensors`` output for U8 tensors with H=272 and unknown names, and
``check-rules --weights`` gave false KT501 findings on it)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from convert_helpers import tiny
from ktconvert.cli import cli
from ktconvert.convert import convert
from ktconvert.io.resources import rules_dir

FORMS = {  # output form -> convert() arguments
    "gguf": {"type": "Q4_K"},
    "safetensors": {"type": "Q4_K", "format": "safetensors"},
    "safetensors-q4_k_m": {"recipe": "Q4_K_M", "format": "safetensors"},
    "hf": {"type": "BF16", "format": "hf"},
    "kt-amx": {"type": "AMXINT8", "format": "kt-amx"},
}


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("readback")
    src = tiny(root, "qwen3_moe")
    return src, {form: convert(src, root / form, **kw).out for form, kw in FORMS.items()}


def _run(*args):
    return CliRunner().invoke(cli, [*map(str, args)])


@pytest.mark.parametrize("form", list(FORMS))
def test_inspect_reads_every_output_form_cleanly(outputs, form):
    src, outs = outputs
    res = _run("inspect", outs[form], "-o", "json")
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert [p for p in rep["problems"] if p["severity"] != "info"] == []
    assert "unknown" not in rep["groups"]
    for layer in rep["layers"]:
        if layer["layout"] and form != "kt-amx":
            assert (layer["hidden"], layer["intermediate"]) == (256, 256), layer
    if form.startswith("safetensors"):  # ggml blocks are described by their type and element shape
        assert "U8" not in rep["quant_types"] and "Q4_K" in rep["quant_types"]


@pytest.mark.parametrize("form", list(FORMS))
def test_check_rules_weights_reads_every_output_form(outputs, form):
    src, outs = outputs
    res = _run("check-rules", rules_dir() / "optimize" / "qwen3_moe.yaml", "--model", src / "config.json",
               "--weights", outs[form], "-o", "json")
    findings = json.loads(res.stdout)["findings"]
    ids = [f["id"] for f in findings]
    if form == "kt-amx":  # no optimize-rule operator reads kt-amx: said once, not per tensor
        assert ids == ["KT501"] and "kt-amx directory" in findings[0]["message"]
    else:
        assert res.exit_code == 0 and ids == [], res.stdout
