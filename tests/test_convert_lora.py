"""convert-lora: fused -> sglang -> kt byte-exact, pickles refused whatever their name (saying what they are), ranks
and shapes checked against each other and against the base model's config, nothing written on error."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from convert_helpers import tiny
from ktconvert.cli import cli
from ktconvert.convert.lora import convert_lora

E, R, H, I = 8, 4, 256, 256


def _stacked(layers=(0, 1), dtype=torch.bfloat16, seed=0, r=R) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    t = {}
    for L in layers:
        for p in ("gate", "up"):
            t[f"layers.{L}.experts.{p}_lora_a"] = torch.randn(E, r, H, generator=g).to(dtype)
            t[f"layers.{L}.experts.{p}_lora_b"] = torch.randn(E, I, r, generator=g).to(dtype)
        t[f"layers.{L}.experts.down_lora_a"] = torch.randn(E, r, I, generator=g).to(dtype)
        t[f"layers.{L}.experts.down_lora_b"] = torch.randn(E, H, r, generator=g).to(dtype)
    return t


def _write_stacked(d, tensors, alpha=16.0, base_name="tiny"):
    d.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(d / "fused_expert_lora.safetensors"))
    if alpha is not None:
        cfg = {"r": R, "lora_alpha": alpha, "peft_type": "LORA", "lora_dropout": 0.05}
        (d / "adapter_config.json").write_text(json.dumps({**cfg, "base_model_name_or_path": base_name} if base_name
                                                          else cfg))
    return d


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return tiny(tmp_path_factory.mktemp("lora-base"), "qwen3_moe") / "config.json"


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def test_stacked_to_peft_and_back_is_byte_identical(tmp_path, base):
    src = _write_stacked(tmp_path / "kt", _stacked(), base_name=None)
    r1 = convert_lora(src, tmp_path / "peft", base_config=base)
    assert r1.direction == "raw-dir->sglang-merged" and r1.rank == R and r1.layers == [0, 1] and r1.experts == E
    peft = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    stacked = load_file(str(src / "fused_expert_lora.safetensors"))
    assert len(peft) == 2 * 6 * E
    for L in (0, 1):
        for p in ("gate", "up", "down"):
            for ab, AB in (("a", "A"), ("b", "B")):
                for e in range(E):
                    got = peft[f"model.layers.{L}.mlp.experts.{e}.{p}_proj.lora_{AB}.weight"]
                    assert got.dtype == torch.bfloat16 and _bits(got) == _bits(stacked[f"layers.{L}.experts.{p}_lora_{ab}"][e])
    cfg = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert cfg["r"] == R and cfg["lora_alpha"] == 16.0 and cfg["target_modules"] == ["gate_proj", "up_proj", "down_proj"]
    assert cfg["lora_dropout"] == 0.05 and cfg["peft_type"] == "LORA"  # the input's settings are carried over
    assert cfg["base_model_name_or_path"] == str(base.parent)  # none given: the --base-model path
    r2 = convert_lora(tmp_path / "peft", tmp_path / "kt2", base_config=base)
    assert r2.direction == "sglang-expert-only->kt"
    back = load_file(str(tmp_path / "kt2" / "fused_expert_lora.safetensors"))
    assert set(back) == set(stacked) and all(_bits(back[k]) == _bits(stacked[k]) for k in stacked)


def test_peft_with_prefix_and_attention_loras(tmp_path, base):
    """A PEFT save (base_model.model. prefix, attention LoRAs beside the experts) stacks into kt-kernel's form and
    keeps the non-expert LoRAs in adapter_model.safetensors."""
    g = torch.Generator().manual_seed(1)
    t = {}
    for L in (0, 1):
        t[f"base_model.model.model.layers.{L}.self_attn.q_proj.lora_A.weight"] = torch.randn(R, H, generator=g)
        t[f"base_model.model.model.layers.{L}.self_attn.q_proj.lora_B.weight"] = torch.randn(256, R, generator=g)
        for e in range(E):
            for p, (a, b) in {"gate_proj": ((R, H), (I, R)), "up_proj": ((R, H), (I, R)),
                              "down_proj": ((R, I), (H, R))}.items():
                t[f"base_model.model.model.layers.{L}.mlp.experts.{e}.{p}.lora_A.weight"] = torch.randn(*a, generator=g)
                t[f"base_model.model.model.layers.{L}.mlp.experts.{e}.{p}.lora_B.weight"] = torch.randn(*b, generator=g)
    src = tmp_path / "peft"
    src.mkdir()
    save_file(t, str(src / "adapter_model.safetensors"))
    (src / "adapter_config.json").write_text(json.dumps({"r": R, "lora_alpha": 32,
                                                         "target_modules": ["q_proj", "gate_proj", "up_proj", "down_proj"]}))
    res = convert_lora(src, tmp_path / "kt", base_config=base)
    assert res.form == "peft" and res.direction == "peft->kt"
    assert res.files == ["adapter_config.json", "adapter_model.safetensors", "fused_expert_lora.safetensors",
                         "kt_adapter_manifest.json"]
    kt = load_file(str(tmp_path / "kt" / "fused_expert_lora.safetensors"))
    assert kt["layers.1.experts.down_lora_b"].shape == (E, H, R)
    assert torch.equal(kt["layers.1.experts.down_lora_b"][5],
                       t["base_model.model.model.layers.1.mlp.experts.5.down_proj.lora_B.weight"].bfloat16())
    rest = load_file(str(tmp_path / "kt" / "adapter_model.safetensors"))
    # kt-kernel's training dir keeps PEFT's own prefix on the non-expert part; the fused file is BF16
    assert set(rest) == {f"base_model.model.model.layers.{L}.self_attn.q_proj.lora_{x}.weight" for L in (0, 1) for x in "AB"}
    assert kt["layers.0.experts.gate_lora_a"].dtype == torch.bfloat16
    assert torch.equal(kt["layers.0.experts.gate_lora_a"][2],
                       t["base_model.model.model.layers.0.mlp.experts.2.gate_proj.lora_A.weight"].bfloat16())
    cfg = json.loads((tmp_path / "kt" / "adapter_config.json").read_text())
    assert cfg["target_modules"] == ["q_proj"] and cfg["lora_alpha"] == 32  # experts are kt-kernel's, not PEFT's
    assert [f.where for f in res.findings] == ["dtype F32"]  # rounded to BF16, said so


def _run(*args):
    return CliRunner().invoke(cli, ["convert-lora", *map(str, args)])


def _refused(tmp_path, res, *expect, code=3):
    assert res.exit_code == code, res.output
    line = res.stderr.strip()
    assert "\n" not in line and line.startswith("ktconvert: error: "), res.stderr
    for s in expect:
        assert s in line, (s, line)
    assert not (tmp_path / "out").exists() and not (tmp_path / ".out.ktconvert-partial").exists()


@pytest.mark.parametrize("name, legacy, what", [
    ("fused_expert_lora.safetensors", False, "zip archive (what torch.save writes since PyTorch 1.6), not safetensors"),
    ("adapter_model.safetensors", True, "Python pickle (what legacy torch.save writes), not safetensors"),
    ("adapter.bin", False, "zip archive (what torch.save writes since PyTorch 1.6), not a checkpoint ktconvert reads"),
    ("adapter.pt", True, "Python pickle (what legacy torch.save writes), not a checkpoint ktconvert reads"),
])
def test_pickle_refused_whatever_its_name(tmp_path, name, legacy, what):
    p = tmp_path / name
    torch.save(_stacked(layers=(0,)), p, _use_new_zipfile_serialization=not legacy)
    _refused(tmp_path, _run(p, tmp_path / "out", "--lora-alpha", 8), what, "never unpickles", str(p))


def test_directory_with_only_a_pickle(tmp_path):
    d = tmp_path / "adapter"
    d.mkdir()
    torch.save(_stacked(layers=(0,)), d / "adapter_model.bin")
    _refused(tmp_path, _run(d, tmp_path / "out"), "only PyTorch pickles", "adapter_model.bin")


def _edit(tmp_path, fn, alpha=16.0):
    t = _stacked()
    fn(t)
    return _write_stacked(tmp_path / "kt", t, alpha)


@pytest.mark.parametrize("case, edit, expect", [
    ("rank-mismatch", lambda t: t.__setitem__("layers.1.experts.up_lora_b", torch.zeros(E, I, R + 1, dtype=torch.bfloat16)),
     ["layers.1.experts.up_lora_b is [8, 256, 5]", "make it [8, 256, 4]"]),
    ("expert-count-mismatch", lambda t: t.__setitem__("layers.0.experts.down_lora_a", torch.zeros(E - 1, R, I, dtype=torch.bfloat16)),
     ["layers.0.experts.down_lora_a is [7, 4, 256]"]),
    ("missing-tensor", lambda t: t.pop("layers.1.experts.gate_lora_b"), ["layer 1 has no gate_lora_b"]),
    ("not-3d", lambda t: t.__setitem__("layers.0.experts.gate_lora_a", torch.zeros(R, H, dtype=torch.bfloat16)),
     ["layers.0.experts.gate_lora_a is [4, 256]; stacked LoRA tensors are 3-D"]),
    ("unknown-expert-tensor", lambda t: t.__setitem__("layers.0.experts.gate_lora_c", torch.zeros(1, dtype=torch.bfloat16)),
     ["tensor layers.0.experts.gate_lora_c", "an expert tensor of neither form"]),
])
def test_inconsistent_stacked_adapter(tmp_path, base, case, edit, expect):
    src = _edit(tmp_path, edit)
    _refused(tmp_path, _run(src, tmp_path / "out", "--base-config", base), *expect)


def test_rank_disagrees_with_adapter_config(tmp_path):
    src = _write_stacked(tmp_path / "kt", _stacked(r=8))
    _refused(tmp_path, _run(src, tmp_path / "out"), "adapter_config.json:r", "r is 4 but the expert tensors have rank 8")


@pytest.mark.parametrize("family, expect", [
    ("deepseek_v3", "layer 0 is a dense layer in the base model"),
    ("mixtral", None),
])
def test_checked_against_base_config(tmp_path, family, expect):
    cfg = tiny(tmp_path / "m", family) / "config.json"
    src = _write_stacked(tmp_path / "kt", _stacked())
    res = _run(src, tmp_path / "out", "--base-config", cfg)
    if expect:
        _refused(tmp_path, res, expect)
    else:  # Mixtral too: sglang-kt reads only mlp.experts.E.{gate,up,down}_proj (block_sparse_moe...w1 is refused)
        assert res.exit_code == 0, res.output
        names = load_file(str(tmp_path / "out" / "adapter_model.safetensors"))
        assert "model.layers.1.mlp.experts.7.down_proj.lora_B.weight" in names
        cfg = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
        assert cfg["target_modules"] == ["gate_proj", "up_proj", "down_proj"]


def test_geometry_disagrees_with_base(tmp_path):
    cfg = json.loads((tiny(tmp_path / "m", "qwen3_moe") / "config.json").read_text())
    cfg["num_local_experts"] = 16
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    src = _write_stacked(tmp_path / "kt", _stacked())
    _refused(tmp_path, _run(src, tmp_path / "out", "--base-config", tmp_path / "cfg.json"),
             "layer 0: experts is 8 but the base model's config says 16")


def test_missing_expert_in_peft(tmp_path, base):
    convert_lora(_write_stacked(tmp_path / "kt", _stacked()), tmp_path / "peft")
    t = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    del t["model.layers.1.mlp.experts.6.up_proj.lora_A.weight"]
    save_file(t, str(tmp_path / "peft" / "adapter_model.safetensors"))
    _refused(tmp_path, _run(tmp_path / "peft", tmp_path / "out", "--base-config", base),
             "layer 1 up lora_A: 1 of 8 experts missing (first: expert 6)")


def test_alpha_required_without_config(tmp_path):
    src = _write_stacked(tmp_path / "kt", _stacked(), alpha=None)
    _refused(tmp_path, _run(src, tmp_path / "out", "--base-model-name-or-path", "m"), "no lora_alpha", "--lora-alpha",
             code=2)
    _refused(tmp_path, _run(src, tmp_path / "out", "--lora-alpha", 8), "base_model_name_or_path",
             "--base-model-name-or-path", code=2)
    res = _run(src, tmp_path / "out", "--lora-alpha", 8, "-o", "json", "--base-model-name-or-path", "m")
    assert res.exit_code == 0 and json.loads(res.stdout)["direction"] == "raw-dir->sglang-merged"
    assert json.loads((tmp_path / "out" / "adapter_config.json").read_text())["lora_alpha"] == 8


def test_output_rules(tmp_path):
    src = _write_stacked(tmp_path / "kt", _stacked())
    cfg = json.loads((src / "adapter_config.json").read_text())
    (src / "adapter_config.json").write_text(json.dumps({**cfg, "base_model_name_or_path": "m"}))
    res = _run(src, src / "inside")
    assert res.exit_code == 2 and "inside the input" in res.stderr and not (src / "inside").exists()
    assert _run(src, tmp_path / "out").exit_code == 0
    res = _run(src, tmp_path / "out")
    assert res.exit_code == 2 and "already exists" in res.stderr
    assert _run(src, tmp_path / "out", "--force").exit_code == 0
    assert np.array_equal(sorted(p.name for p in (tmp_path / "out").iterdir()),
                          ["adapter_config.json", "adapter_model.safetensors"])



def test_a_file_input_s_parent_is_not_the_input(tmp_path):
    # DIR/adapter.safetensors -> DIR/out is a sibling, not inside the input; DIR itself, which --force would
    # delete with the adapter in it, is still refused
    src = _write_stacked(tmp_path / "kt", _stacked())
    adapter = src / "fused_expert_lora.safetensors"
    res = _run(adapter, src / "out")
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in (src / "out").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    before = sorted(p.name for p in src.iterdir())
    res = _run(adapter, src, "--force")
    assert res.exit_code == 2 and "the input lies inside the output directory" in res.stderr, res.output
    assert sorted(p.name for p in src.iterdir()) == before

def test_safetensors_header_length_that_looks_like_a_pickle_opcode(tmp_path):
    """A safetensors file whose header is 1152 bytes starts 0x80 0x04, like a protocol-4 pickle: it must still be
    read as safetensors (this refused ~1 KB LoRA adapters before)."""
    from ktconvert.formats import open_checkpoint
    from ktconvert.formats.safetensors_write import layout_safetensors, write_safetensors

    tensors = [("w", "F32", (2,), 8)]
    pad = next(n for n in range(2000) if len(layout_safetensors(tensors, {"p": "x" * n})[0]) == 8 + 1152)
    p = tmp_path / "a.safetensors"
    write_safetensors(p, [(*tensors[0], lambda: iter([bytes(8)]))], {"p": "x" * pad})
    assert p.read_bytes()[:2] == b"\x80\x04"
    assert list(open_checkpoint(p)) == ["w"]


def test_nonfinite_adapter_is_refused_unless_allowed(tmp_path):
    def poison(t):
        t["layers.1.experts.up_lora_b"][3, 7, 2] = float("nan")

    src = _edit(tmp_path, poison)
    cfg = json.loads((src / "adapter_config.json").read_text())
    (src / "adapter_config.json").write_text(json.dumps({**cfg, "base_model_name_or_path": "m"}))
    _refused(tmp_path, _run(src, tmp_path / "out"), "tensor layers.1.experts.up_lora_b", "non-finite value nan",
             "at index [3, 7, 2]", "--allow-nonfinite")
    res = _run(src, tmp_path / "out", "--allow-nonfinite")
    assert res.exit_code == 0, res.output
    assert sorted(p.suffix for p in (tmp_path / "out").iterdir()) == [".json", ".safetensors"]
