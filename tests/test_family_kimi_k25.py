"""Kimi K2.5 / K2.6 (kimi_k25) beyond the family-parametrised tests: the tiny model is in the releases' layout
(language_model.model.layers.*, KimiK25ForConditionalGeneration, not what transformers 5.23's save_pretrained writes),
the vision tower of a release is left out of every reading, the GGUF is llama.cpp's deepseek2, and the K2.6 variant
(the releases' remote-code config spelling) reads as K2.5 and matches its own transformers golden."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from convert_helpers import assert_q8_0_matches_llama_quantize
from ktconvert.cli import cli
from ktconvert.families import normalize_config
from ktconvert.model.tiny import tiny_config, tiny_tensors, write_tiny_model
from numeric import assert_close

FAMILY = "kimi_k25"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("kimi")
    write_tiny_model(FAMILY, root / "k25")
    write_tiny_model(FAMILY, root / "k26", variant="kimi_k26")
    return root


def test_tiny_model_is_in_the_published_layout():
    names = set(tiny_tensors(FAMILY))
    assert "language_model.model.layers.1.mlp.experts.7.down_proj.weight" in names
    assert {"language_model.model.embed_tokens.weight", "language_model.model.norm.weight",
            "language_model.lm_head.weight"} <= names
    assert not [n for n in names if not n.startswith("language_model.") or ".blocks." in n]
    for variant in (None, "kimi_k26"):
        cfg = tiny_config(FAMILY, variant)
        assert cfg["architectures"] == ["KimiK25ForConditionalGeneration"] and cfg["model_type"] == "kimi_k25"


def test_k26_release_spelling_reads_as_the_family_config():
    """The remote-code spelling (text model_type kimi_k2, rope_scaling + rope_theta, vt_* vision keys) gives the same
    text model as transformers' spelling; only the release's YaRN betas differ."""
    base, k26 = normalize_config(tiny_config(FAMILY)), normalize_config(tiny_config(FAMILY, "kimi_k26"))
    assert k26.family == base.family == FAMILY and k26.spec.gguf_arch == "deepseek2"
    assert (k26.rope.beta_fast, k26.rope.beta_slow) == (1.0, 1.0) and (base.rope.beta_fast, base.rope.beta_slow) == (32.0, 1.0)
    same = lambda c: {k: v for k, v in c.__dict__.items() if k not in ("raw", "rope", "bos_token_id", "eos_token_id")}
    assert same(k26) == same(base)
    assert k26.routing.n_group == k26.routing.topk_group == 1 and k26.routing.routed_scaling_factor == 2.827 and k26.mlp.moe_layers == (1, 2)


def test_k26_reference_matches_its_transformers_golden(models):
    import torch

    from ktconvert.golden import read_golden
    from ktconvert.golden.paths import golden_root
    from ktconvert.model import from_pretrained

    gold = read_golden(golden_root() / f"{FAMILY}-kimi_k26")
    assert gold.manifest["model"]["tiny_model"] == f"{FAMILY}-kimi_k26"
    with torch.no_grad():
        got = from_pretrained(models / "k26")(torch.from_numpy(gold.input_ids)).logits.numpy()
    assert_close(got, gold.logits, "logits")


def _inspect(path) -> dict:
    res = CliRunner().invoke(cli, ["inspect", str(path), "-o", "json"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def _with_vision_tower(src, dst):
    """The tiny model plus tensors under the releases' vision-tower and projector names."""
    import shutil

    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    tensors["vision_tower.encoder.blocks.0.wqkv.weight"] = np.ones((96, 32), np.float32)
    tensors["mm_projector.proj.0.weight"] = np.ones((32, 128), np.float32)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_a_release_vision_tower_is_left_out_of_inspect_convert_and_the_reference(models, tmp_path):
    import torch

    from gguf import GGUFReader

    from ktconvert.convert import convert, plan_conversion
    from ktconvert.model import from_pretrained

    full = _with_vision_tower(models / "k25", tmp_path / "with-vision")
    report = _inspect(full)
    assert report["architecture"]["arch"] == "deepseek2"
    assert [p for p in report["problems"] if p["severity"] != "info"] == []
    assert any("outside the language model" in n for n in plan_conversion(full, type="F32").notes)
    names = {t.name for t in GGUFReader(convert(full, tmp_path / "f32", type="F32").out / "model.gguf").tensors}
    plain = {t.name for t in GGUFReader(convert(models / "k25", tmp_path / "plain", type="F32").out / "model.gguf").tensors}
    assert names == plain and "blk.2.exp_probs_b.bias" in names and "output.weight" in names
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        assert torch.equal(from_pretrained(full)(ids).logits, from_pretrained(models / "k25")(ids).logits)


def test_inspect_is_clean_on_the_tiny_models_and_their_gguf(models, tmp_path):
    from ktconvert.convert import convert

    for name in ("k25", "k26"):
        for path in (models / name, convert(models / name, tmp_path / name, type="Q8_0").out / "model.gguf"):
            report = _inspect(path)
            assert [p for p in report["problems"] if p["severity"] != "info"] == [], report["problems"]
            assert report["architecture"]["arch"] == "deepseek2"


@pytest.mark.interop
def test_llamacpp_runs_the_k26_yarn_with_its_default_betas(llama_built, models, tmp_path):
    """As for Kimi-K2 (test_interop_llamacpp): llama.cpp 0.3.36's deepseek2 ignores the yarn_beta keys our GGUF
    carries and runs YaRN with 32 / 1, so on K2.6's beta_fast = 1 it matches the reference run with beta_fast = 32,
    not transformers' golden. Pinned so a llama.cpp that honours the keys shows up."""
    import torch

    import llamacpp_runner
    from ktconvert.convert import convert
    from ktconvert.golden import read_golden
    from ktconvert.golden.paths import golden_root
    from ktconvert.model import from_pretrained

    gold = read_golden(golden_root() / f"{FAMILY}-kimi_k26")
    ids = [int(i) for i in np.asarray(gold.input_ids).reshape(-1)]
    gguf = convert(models / "k26", tmp_path / "f32", type="F32").out / "model.gguf"
    got, _ = llamacpp_runner.run(gguf, ids, tmp_path)
    got = got.astype(np.float64)
    beta32 = tmp_path / "beta32"
    write_tiny_model(FAMILY, beta32, variant="kimi_k26")
    cfg = json.loads((beta32 / "config.json").read_text())
    cfg["text_config"]["rope_scaling"]["beta_fast"] = 32.0
    (beta32 / "config.json").write_text(json.dumps(cfg))
    with torch.no_grad():
        ref = from_pretrained(beta32)(torch.tensor([ids])).logits[0].double().numpy()
    want = np.asarray(gold.logits, dtype=np.float64).reshape(len(ids), -1)
    nmse = lambda a, b: float(((a - b) ** 2).sum() / (b ** 2).sum())
    assert nmse(got, ref) <= 1e-4
    assert nmse(got, want) > 1e-3


@pytest.mark.interop
def test_q8_0_is_byte_identical_to_llamacpps_quantizer(llama_built, models, tmp_path):
    from ktconvert.convert import convert

    f32 = convert(models / "k25", tmp_path / "f32", type="F32").out / "model.gguf"
    assert_q8_0_matches_llama_quantize(models / "k25", f32, tmp_path)


def test_deepseek_v3_rule_files_apply_to_its_classes_only():
    """K2.5's text model is built from DeepSeek-V3's classes: V3's rule files are accepted for it; V3.2's classes are
    its own (DeepseekV32*), so V3's files are refused there."""
    from conftest import REPO
    from ktconvert.errors import InputError
    from ktconvert.rules.apply import load_rules

    v3 = REPO / "rules" / "optimize" / "deepseek_v3.yaml"
    assert load_rules(v3, family=FAMILY)
    with pytest.raises(InputError, match="written for deepseek_v3"):
        load_rules(v3, family="deepseek_v32")


def test_a_rawint4_release_in_the_published_layout_reads_as_the_tiny_release(tmp_path):
    """K2.5 / K2.6 ship RAWINT4 routed experts (compressed-tensors, group 32) with quantization_config inside
    text_config and every name under language_model.*: inspect names the layout and the format, quantize writes the
    same GGUF as from the same release under model.* names, and the reference reads both alike."""
    import torch
    from gguf import GGUFReader
    from safetensors import safe_open
    from safetensors.torch import save_file

    from ktconvert import families
    from ktconvert.convert import convert
    from ktconvert.model import from_pretrained

    plain, published = tmp_path / "plain", tmp_path / "published"
    write_tiny_model(FAMILY, plain, quant="rawint4")
    write_tiny_model(FAMILY, published, quant="rawint4")
    spec = families.spec(FAMILY)
    with safe_open(plain / "model.safetensors", "pt") as f:
        meta, tensors = f.metadata(), {spec.published_name(k): f.get_tensor(k) for k in f.keys()}
    save_file(tensors, published / "model.safetensors", metadata=meta)
    cfg = json.loads((published / "config.json").read_text())
    cfg["text_config"]["quantization_config"] = cfg.pop("quantization_config")
    (published / "config.json").write_text(json.dumps(cfg))
    assert all(k.startswith("language_model.") for k in tensors)

    report = _inspect(published)
    assert [p for p in report["problems"] if p["severity"] != "info"] == []
    assert report["architecture"]["arch"] == "deepseek2"
    out = {}
    for name, src in (("plain", plain), ("published", published)):
        gguf = convert(src, tmp_path / f"{name}-f32", type="F32").out / "model.gguf"
        out[name] = {t.name: np.array(t.data) for t in GGUFReader(gguf).tensors}
    assert out["plain"].keys() == out["published"].keys()
    assert all(np.array_equal(out["plain"][k], out["published"][k]) for k in out["plain"])
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.equal(from_pretrained(published)(ids).logits, from_pretrained(plain)(ids).logits)
