"""``quantize --lora``: the adapter merged in float32 while streaming. ``--to hf --type F32`` equals
``W + alpha/r * B @ A`` computed here with torch from the checkpoint and the adapter (1e-6 relative; untouched
tensors bit-equal); kt-amx output equals the kt-amx conversion of that merged checkpoint byte for byte; the manifest
records the adapter's files and sha256; an adapter of another model is refused before anything is written."""

from __future__ import annotations

import hashlib
import json
import re

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from ktconvert.cli import cli


def _q(*args):
    return CliRunner().invoke(cli, ["quantize", *map(str, args)])


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("q-lora")
    for fam, name in (("qwen3_moe", "m"), ("deepseek_v3", "ds")):
        res = CliRunner().invoke(cli, ["tiny-model", fam, str(root / name), "--lora", str(root / f"{name}-lora")])
        assert res.exit_code == 0, res.output
    res = _q(root / "m", root / "merged", "--type", "F32", "--to", "hf", "--lora", root / "m-lora")
    assert res.exit_code == 0, res.output
    return root


def test_f32_equals_the_merged_weights(env):
    w = load_file(str(env / "m" / "model.safetensors"))
    out = {}
    for f in (env / "merged").glob("*.safetensors"):
        out.update(load_file(str(f)))
    fused = load_file(str(env / "m-lora" / "fused_expert_lora.safetensors"))
    peft = load_file(str(env / "m-lora" / "adapter_model.safetensors"))
    cfg = json.loads((env / "m-lora" / "adapter_config.json").read_text())
    s = cfg["lora_alpha"] / cfg["r"]
    adapted = 0
    for k, v in w.items():
        v = v.float()
        m = re.match(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$", k)
        a = f"base_model.model.{k[:-len('.weight')]}.lora_A.weight"
        if m:
            L, e, p = m.group(1), int(m.group(2)), m.group(3)
            delta = s * fused[f"layers.{L}.experts.{p}_lora_b"][e].float() @ fused[f"layers.{L}.experts.{p}_lora_a"][e].float()
        elif a in peft:
            delta = s * peft[a.replace("lora_A", "lora_B")] @ peft[a]
        else:
            assert torch.equal(out[k].float(), v), k
            continue
        ref = v + delta
        assert out[k].dtype == torch.float32
        assert ((out[k] - ref).norm() / ref.norm()).item() <= 1e-6, k
        assert (delta.abs().max() > 1e-3).item(), k  # the adapter moves this weight
        adapted += 1
    assert adapted == 2 * 8 * 3 + 2  # every expert of both MoE layers, and o_proj of both layers
    man = json.loads((env / "merged" / "manifest.json").read_text())["lora"]
    assert man["r"] == 4 and man["alpha"] == 8.0 and man["adapted"] == adapted
    for name, rec in man["files"].items():
        assert rec["sha256"] == hashlib.sha256((env / "m-lora" / name).read_bytes()).hexdigest()


def test_kt_amx_with_lora_is_the_kt_amx_of_the_merged_checkpoint(env):
    assert _q(env / "m", env / "a1", "--to", "kt-amx", "--type", "AMXINT8", "--lora", env / "m-lora").exit_code == 0
    assert _q(env / "merged", env / "a2", "--to", "kt-amx", "--type", "AMXINT8").exit_code == 0
    shards = sorted(p.name for p in (env / "a1").glob("*.safetensors"))
    assert shards and shards == sorted(p.name for p in (env / "a2").glob("*.safetensors"))
    for name in shards:
        a, b = load_file(str(env / "a1" / name)), load_file(str(env / "a2" / name))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


def test_adapter_of_another_model_refused(env, tmp_path):
    res = _q(env / "m", tmp_path / "out", "--type", "F32", "--lora", env / "ds-lora")
    assert res.exit_code == 3 and "this adapter was trained for another model" in res.stderr
    assert res.stderr.count("\n") == 1 and list(tmp_path.iterdir()) == []
    res = _q(env / "m", tmp_path / "out", "--type", "F32", "--lora-alpha", "8")
    assert res.exit_code == 2 and "--lora-alpha without --lora" in res.stderr
