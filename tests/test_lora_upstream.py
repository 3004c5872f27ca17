"""convert-lora against kt-kernel 0.7.2's own adapter code, run in a child process: its converter
(``sft/convert_kt_to_sglang_adapter.py``) writes the same files byte for byte, converts ktconvert's ``--to kt`` output
back to the same sglang adapter, and its artifact code (``sft/artifacts.py``) accepts the fused file and records
the same size, sha256 and tensor contract ktconvert's kt_adapter_manifest.json holds."""

from __future__ import annotations

import json

import pytest

from ktconvert.convert.lora import convert_lora
from ktconvert.errors import InputError
from lora_helpers import fused, kt_kernel_convert, kt_kernel_dir, nonexpert, raw_dir, run_child

CASES = {
    # name: (raw dir maker kwargs, --lora-alpha)
    "config-alpha": ({}, None),
    "flag-alpha": ({"config": {"r": 4, "target_modules": ["q_proj"]}}, 8.0),
    "no-config-f32-experts": ({"experts": fused(dtype="f32"), "others": {}, "config": {}}, 32.0),
}


@pytest.fixture(scope="module")
def upstream(tmp_path_factory):
    """Every case converted by kt-kernel's converter (merged + expert-only), in one child process."""
    kt_kernel_dir()
    root = tmp_path_factory.mktemp("lora-upstream")
    jobs = []
    for name, (kw, alpha) in CASES.items():
        src = raw_dir(root / name / "raw", **kw)
        if not kw.get("config", True):
            (src / "adapter_config.json").unlink()
        if kw.get("others") == {}:
            (src / "adapter_model.safetensors").unlink()
        jobs.append({"input": str(src), "output": str(root / name / "cv"), "expert": str(root / name / "cv-expert"),
                     "base": "tiny/base", "alpha": alpha})
    # two inputs ktconvert refuses: config alpha 8 against --lora-alpha 32, non-expert rank 8 against expert rank 4
    raw_dir(root / "alpha" / "raw", config={"r": 4, "lora_alpha": 8})
    raw_dir(root / "rank" / "raw", others=nonexpert(r=8))
    jobs += [{"input": str(root / "alpha" / "raw"), "output": str(root / "alpha" / "cv"), "base": "b", "alpha": 32.0},
             {"input": str(root / "rank" / "raw"), "output": str(root / "rank" / "cv"), "base": "b"}]
    got = kt_kernel_convert(jobs)
    assert got[:len(CASES)] == [None] * len(CASES)
    (root / "refused.json").write_text(json.dumps(dict(zip(("alpha", "rank"), got[len(CASES):]))))
    return root


@pytest.mark.parametrize("case", CASES)
def test_sglang_output_is_kt_kernel_converters_byte_for_byte(upstream, case):
    d = upstream / case
    alpha = CASES[case][1]
    convert_lora(d / "raw", d / "ours", lora_alpha=alpha, base_model_name="tiny/base")
    convert_lora(d / "raw", d / "ours-expert", lora_alpha=alpha, base_model_name="tiny/base", expert_only=True)
    for ours, theirs in (("ours", "cv"), ("ours-expert", "cv-expert")):
        for f in ("adapter_model.safetensors", "adapter_config.json"):
            assert (d / ours / f).read_bytes() == (d / theirs / f).read_bytes(), (ours, f)


def test_kt_output_goes_back_through_kt_kernel_and_its_artifact_records(upstream, tmp_path):
    """sglang -> kt (ktconvert) -> sglang (kt-kernel's converter) is the identity; kt-kernel's artifacts code accepts
    the fused file against the manifest's contract and records each file exactly as the manifest does."""
    d = upstream / "config-alpha"
    res = convert_lora(d / "cv", tmp_path / "kt")  # a converted merged adapter: the default target is kt
    assert res.direction == "sglang-merged->kt" and res.alpha == 16
    assert kt_kernel_convert([{"input": str(tmp_path / "kt"), "output": str(tmp_path / "back"), "base": "tiny/base",
                               "alpha": None}]) == [None]
    for f in ("adapter_model.safetensors", "adapter_config.json"):
        assert (tmp_path / "back" / f).read_bytes() == (d / "cv" / f).read_bytes(), f
    # the fused file is the trainer's own file byte for byte (BF16, save_file order, no metadata)
    assert (tmp_path / "kt" / "fused_expert_lora.safetensors").read_bytes() == \
        (d / "raw" / "fused_expert_lora.safetensors").read_bytes()
    man = json.loads((tmp_path / "kt" / "kt_adapter_manifest.json").read_text())
    code = r"""
import json, sys
from pathlib import Path
from kt_kernel.sft import artifacts as a
root = Path(sys.argv[1]); man = json.loads((root / "kt_adapter_manifest.json").read_text())
contract = man["artifacts"]["fused_expert_lora.safetensors"]["tensors"]
a._validate_fused_file(root / "fused_expert_lora.safetensors", contract)
print(json.dumps({n: a._artifact_record(root / n, contract if n.startswith("fused") else None)
                  for n in man["artifacts"]}))
"""
    records = json.loads(run_child(code, str(tmp_path / "kt")))
    assert records == man["artifacts"]
    assert set(records) == {"adapter_config.json", "adapter_model.safetensors", "fused_expert_lora.safetensors"}
    assert man["version"] == 1 and man["status"] == "ready" and man["lora"] == {"rank": 4, "alpha": 16.0}
    assert man["base"] == {"model_name_or_path": "tiny/base"} and man["expert_weight_format"] == "bf16"
    # ktconvert reads its own output back with the manifest verified
    assert convert_lora(tmp_path / "kt", tmp_path / "again", to="sglang").findings == []


def test_alpha_conflict_refused_where_kt_kernel_silently_keeps_the_config(upstream, tmp_path):
    """kt-kernel's converter writes the config's alpha 8 and ignores --lora-alpha 32; ktconvert refuses instead."""
    src = upstream / "alpha" / "raw"
    assert json.loads((upstream / "refused.json").read_text())["alpha"] is None
    assert json.loads((upstream / "alpha" / "cv" / "adapter_config.json").read_text())["lora_alpha"] == 8
    with pytest.raises(InputError, match=r"adapter_config.json:lora_alpha.*lora_alpha is 8, --lora-alpha says 32"):
        convert_lora(src, tmp_path / "ours", lora_alpha=32, base_model_name="b")
    assert not (tmp_path / "ours").exists()


def test_nonexpert_rank_refused_like_kt_kernel(upstream, tmp_path):
    src = upstream / "rank" / "raw"
    assert "rank mismatch" in json.loads((upstream / "refused.json").read_text())["rank"]
    with pytest.raises(InputError, match=r"q_proj.lora_A.weight.*non-expert rank 8, expert rank 4"):
        convert_lora(src, tmp_path / "ours")
    assert not (tmp_path / "ours").exists()
