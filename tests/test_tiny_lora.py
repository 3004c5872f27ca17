"""The tiny models' MoE LoRA adapters (``tiny-model FAMILY OUT --lora DIR``): deterministic, in kt-kernel's raw
training form byte for byte as its trainer's ``save_file`` writes it, no finding against their model, every other
form made by convert-lora, and kt-kernel's own converter (child process) writes the same sglang adapter."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from ktconvert.cli import cli
from ktconvert.convert.lora import convert_lora
from ktconvert.families.config import FAMILIES
from ktconvert.model.tiny_lora import tiny_lora_files
from lora_helpers import kt_kernel_convert


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-lora")
    for f in FAMILIES:
        res = CliRunner().invoke(cli, ["tiny-model", f, str(root / f / "model"), "--lora", str(root / f / "raw")])
        assert res.exit_code == 0, res.output
    return root


@pytest.mark.parametrize("family", FAMILIES)
def test_every_form_without_a_finding(adapters, family):
    d = adapters / family
    assert tiny_lora_files(family) == {p.name: p.read_bytes() for p in (d / "raw").iterdir()}  # deterministic
    for name, kw in (("merged", {}), ("expert", {"expert_only": True}), ("kt", {"to": "kt"})):
        r = convert_lora(d / "raw", d / name, base_config=d / "model", **kw)
        assert r.findings == [] and r.alpha == 8.0 and r.rank == 4, (name, r.findings)
    # the kt form is the raw form itself: every file equal, the manifest included
    for f in (d / "raw").iterdir():
        assert (d / "kt" / f.name).read_bytes() == f.read_bytes(), f.name
    assert convert_lora(d / "merged", d / "back", base_config=d / "model").findings == []


def test_kt_kernel_converts_them_to_the_same_adapter(adapters, tmp_path):
    jobs = [{"input": str(adapters / f / "raw"), "output": str(tmp_path / f), "expert": str(tmp_path / f"{f}-e"),
             "base": f"ktconvert/tiny-{f}"} for f in FAMILIES]
    assert kt_kernel_convert(jobs) == [None] * len(FAMILIES)
    for f in FAMILIES:
        for ours, theirs in (("merged", f), ("expert", f"{f}-e")):
            convert_lora(adapters / f / "raw", tmp_path / f"ours-{f}-{ours}", expert_only=ours == "expert")
            for name in ("adapter_model.safetensors", "adapter_config.json"):
                assert (tmp_path / f"ours-{f}-{ours}" / name).read_bytes() == (tmp_path / theirs / name).read_bytes(), \
                    (f, ours, name)


def test_fused_file_is_what_save_file_writes(adapters):
    from safetensors.torch import load_file, save

    for name, meta in (("fused_expert_lora.safetensors", None), ("adapter_model.safetensors", {"format": "pt"})):
        p = adapters / "qwen3_moe" / "raw" / name
        assert save(load_file(str(p)), meta) == p.read_bytes(), name
    man = json.loads((adapters / "qwen3_moe" / "raw" / "kt_adapter_manifest.json").read_text())
    assert man["lora"] == {"rank": 4, "alpha": 8.0} and man["expert_weight_format"] == "bf16"
