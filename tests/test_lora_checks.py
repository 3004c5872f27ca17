"""convert-lora's checks: one test per finding (each names the tensor or field, and an error leaves nothing
written), none on a correct adapter; the manifest verified; DeepSeek-V4 MXFP4 left as is; the legacy form refused."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from convert_helpers import tiny
from ktconvert.cli import cli
from ktconvert.convert.lora import convert_lora
from lora_helpers import fused, nonexpert, raw_dir

# the tiny qwen3_moe: 8 experts, H 256, I 256, MoE layers 0 and 1
TINY = {"e": 8, "h": 256, "i": 256, "layers": (0, 1)}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return tiny(tmp_path_factory.mktemp("lora-base"), "qwen3_moe")


def _run(*args):
    return CliRunner().invoke(cli, ["convert-lora", *map(str, args)])


def _refused(tmp_path, res, *expect):
    assert res.exit_code == 3, res.output
    line = res.stderr.strip()
    assert "\n" not in line and line.startswith("ktconvert: error: "), res.stderr
    for s in expect:
        assert s in line, (s, line)
    assert not (tmp_path / "out").exists() and not (tmp_path / ".out.ktconvert-partial").exists()


def test_correct_adapter_has_no_finding(tmp_path, base):
    src = raw_dir(tmp_path / "raw", experts=fused(**TINY))
    res = _run(src, tmp_path / "out", "--base-model", base, "-o", "json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["findings"] == [] and res.stderr == ""


def _edited(tmp_path, **kw):
    return raw_dir(tmp_path / "raw", **kw)


def test_nan(tmp_path):
    t = fused()
    t["layers.2.experts.down_lora_a"][1, 2, 3] = float("inf")
    _refused(tmp_path, _run(_edited(tmp_path, experts=t), tmp_path / "out"), "tensor layers.2.experts.down_lora_a",
             "non-finite value inf at index [1, 2, 3]")


def test_zero_lora_b_in_one_projection_has_no_effect(tmp_path):
    t = fused()
    t["layers.2.experts.up_lora_b"].zero_()
    res = _run(_edited(tmp_path, experts=t), tmp_path / "out")
    assert res.exit_code == 0, res.output
    assert res.stderr.strip() == ("ktconvert: warning: tensor layers.2.experts.up_lora_b: lora_B is all zero: this "
                                  "layer's projection has no effect (check that training updated it)")


def test_zero_adapter_has_no_effect_at_all(tmp_path):
    t = {k: (v.zero_() if k.endswith("_b") else v) for k, v in fused().items()}
    res = _run(_edited(tmp_path, experts=t), tmp_path / "out")
    assert res.exit_code == 0 and res.stderr.count("\n") == 1, res.stderr
    assert "lora_B is all zero in every layer and projection: the expert LoRA has no effect" in res.stderr


def test_alpha_zero_scales_to_nothing(tmp_path):
    src = _edited(tmp_path, config={"r": 4, "lora_alpha": 0, "base_model_name_or_path": "b"})
    res = _run(src, tmp_path / "out")
    assert res.exit_code == 0 and "adapter_config.json:lora_alpha: lora_alpha is 0" in res.stderr, res.stderr


def test_config_rank(tmp_path):
    src = _edited(tmp_path, config={"r": 8, "lora_alpha": 16, "base_model_name_or_path": "b"})
    _refused(tmp_path, _run(src, tmp_path / "out"), "adapter_config.json:r", "r is 8 but the expert tensors have rank 4")


def test_nonexpert_rank(tmp_path):
    _refused(tmp_path, _run(_edited(tmp_path, others=nonexpert(r=2)), tmp_path / "out"),
             "tensor base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", "non-expert rank 2, expert rank 4")


def test_stray_key_in_fused_file(tmp_path):
    t = fused()
    t["model.layers.0.self_attn.q_proj.lora_A.weight"] = torch.zeros(4, 64, dtype=torch.bfloat16)
    _refused(tmp_path, _run(_edited(tmp_path, experts=t), tmp_path / "out"),
             "tensor model.layers.0.self_attn.q_proj.lora_A.weight", "a stray tensor in fused_expert_lora.safetensors")


def test_unknown_key_in_adapter_model(tmp_path):
    others = {**nonexpert(), "base_model.model.lm_head.weight": torch.zeros(8, 64)}
    _refused(tmp_path, _run(_edited(tmp_path, others=others), tmp_path / "out"),
             "tensor base_model.model.lm_head.weight", "not a LoRA A/B tensor")


@pytest.mark.parametrize("key, value", [("use_rslora", True), ("use_dora", True),
                                        ("rank_pattern", {"q_proj": 8}), ("alpha_pattern", {"q_proj": 32})])
def test_peft_option_the_kernel_has_not(tmp_path, key, value):
    src = _edited(tmp_path, config={"r": 4, "lora_alpha": 16, key: value})
    _refused(tmp_path, _run(src, tmp_path / "out"), f"adapter_config.json:{key}", f"{key} is set")


def test_f32_adapter_rounded_to_bf16(tmp_path):
    res = _run(_edited(tmp_path, experts=fused(dtype="f32")), tmp_path / "out")
    assert res.exit_code == 0 and "warning: dtype F32: F32 expert LoRA: sglang-kt casts" in res.stderr


@pytest.mark.parametrize("kw, expect", [
    ({"layers": (1,)}, ["layer 0", "MoE layer(s) [0] have no expert LoRA", "KeyError"]),
    ({"e": 4}, ["layer 0: experts is 4 but the base model's config says 8"]),
    ({"h": 128}, ["layer 0: hidden size H is 128 but the base model's config says 256"]),
    ({"i": 128}, ["layer 0: expert intermediate size I is 128 but the base model's config says 256"]),
    ({"layers": (0, 1, 5)}, ["tensor layers.5.experts.gate_lora_a", "layer 5 is beyond the base model's"]),
])
def test_base_model_geometry(tmp_path, base, kw, expect):
    src = _edited(tmp_path, experts=fused(**{**TINY, **kw}))
    _refused(tmp_path, _run(src, tmp_path / "out", "--base-model", base), *expect)


def test_dense_layer_untouched(tmp_path):
    ds = tiny(tmp_path / "m", "deepseek_v3")  # layer 0 is dense
    cfg = json.loads((ds / "config.json").read_text())
    src = _edited(tmp_path, experts=fused(layers=(0, 1), e=cfg["n_routed_experts"], h=cfg["hidden_size"],
                                          i=cfg["moe_intermediate_size"]))
    _refused(tmp_path, _run(src, tmp_path / "out", "--base-model", ds), "layer 0 is a dense layer in the base model")


# --- kt_adapter_manifest.json ------------------------------------------------------------------------------------


def _manifest(d, **over):
    arts = {}
    for n in ("adapter_config.json", "adapter_model.safetensors", "fused_expert_lora.safetensors"):
        b = (d / n).read_bytes()
        arts[n] = {"size": len(b), "sha256": hashlib.sha256(b).hexdigest()}
    man = {"version": 1, "status": "ready", "expert_weight_format": "bf16", "base": {"model_name_or_path": "b"},
           "lora": {"rank": 4, "alpha": 16.0}, "artifacts": arts, **over}
    (d / "kt_adapter_manifest.json").write_text(json.dumps(man))
    return man


def test_manifest_verified_and_alpha_taken_from_it(tmp_path):
    src = _edited(tmp_path, config={"r": 4, "target_modules": ["q_proj"]})  # no lora_alpha, no base name
    _manifest(src)
    r = convert_lora(src, tmp_path / "out")
    assert r.alpha == 16.0 and r.findings == []
    cfg = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert cfg["lora_alpha"] == 16.0 and cfg["base_model_name_or_path"] == "b"


@pytest.mark.parametrize("edit, expect", [
    (lambda d, m: (d / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 16, "x": 1})),
     "kt_adapter_manifest.json:artifacts.adapter_config.json.size"),
    (lambda d, m: save_file(fused(seed=5), str(d / "fused_expert_lora.safetensors")),
     "kt_adapter_manifest.json:artifacts.fused_expert_lora.safetensors.sha256"),
    (lambda d, m: _manifest(d, lora={"rank": 8, "alpha": 16.0}), "kt_adapter_manifest.json:lora.rank"),
    (lambda d, m: _manifest(d, lora={"rank": 4, "alpha": 32.0}), "kt_adapter_manifest.json:lora.alpha"),
    (lambda d, m: _manifest(d, status="saving"), "kt_adapter_manifest.json:status"),
])
def test_manifest_conflicts(tmp_path, edit, expect):
    src = _edited(tmp_path, config={"r": 4, "lora_alpha": 16, "base_model_name_or_path": "b"})
    edit(src, _manifest(src))
    _refused(tmp_path, _run(src, tmp_path / "out"), expect)


def test_deepseek_v4_mxfp4_left_as_is(tmp_path):
    src = _edited(tmp_path, experts=fused(r=8), others=nonexpert(r=8),
                  config={"r": 8, "lora_alpha": 16, "base_model_name_or_path": "b"})
    _manifest(src, expert_weight_format="mxfp4", lora={"rank": 8, "alpha": 16.0})
    before = sorted(p.name for p in src.iterdir())
    res = _run(src, tmp_path / "out")
    assert res.exit_code == 0, res.output
    assert "DeepSeek-V4 MXFP4 adapter" in res.stdout and "serves this raw directory as is with --lora-paths" in res.stdout
    assert not (tmp_path / "out").exists() and sorted(p.name for p in src.iterdir()) == before
    _manifest(src, expert_weight_format="mxfp4", lora={"rank": 4, "alpha": 16.0})
    _refused(tmp_path, _run(src, tmp_path / "out"), "kt_adapter_manifest.json:lora", "exactly rank 8, alpha 16.0")


def test_legacy_lora_experts_refused_with_the_reason(tmp_path):
    d = tmp_path / "legacy"
    d.mkdir()
    save_file({"base_model.model.model.layers.1.mlp.lora_experts.0.le_gate.weight": torch.zeros(8, 8)},
              str(d / "adapter_model.safetensors"))
    _refused(tmp_path, _run(d, tmp_path / "out"), "legacy lora_experts form", "neither sglang-kt 0.7.2")


@pytest.mark.parametrize("form", ["fused-file", "sglang-merged", "sglang-expert-only", "peft"])
def test_every_form_reads_back_to_the_same_fused_tensors(tmp_path, form):
    """fused file alone, converted merged / expert-only dirs and a PEFT per-expert save all give the trainer's
    fused file back, byte for byte, through --to kt."""
    src = raw_dir(tmp_path / "raw")
    if form == "fused-file":
        inp = src / "fused_expert_lora.safetensors"
        extra = ["--lora-alpha", 16, "--base-model-name-or-path", "b"]
    else:
        convert_lora(src, tmp_path / "sg", expert_only=form == "sglang-expert-only")
        inp, extra = tmp_path / "sg", []
        if form == "peft":
            from safetensors.torch import load_file

            t = load_file(str(inp / "adapter_model.safetensors"))
            save_file({f"base_model.model.{k}": v for k, v in t.items()}, str(inp / "adapter_model.safetensors"))
    res = _run(inp, tmp_path / "out", "--to", "kt", "-o", "json", *extra)
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["form"] == form
    assert (tmp_path / "out" / "fused_expert_lora.safetensors").read_bytes() == \
        (src / "fused_expert_lora.safetensors").read_bytes()
