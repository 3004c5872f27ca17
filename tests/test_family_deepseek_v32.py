"""DeepSeek-V3.2 (deepseek_v32) beyond the family-parametrised tests: the DSA indexer's selection and its half-split
rope decide the golden, MLA's kv_b_proj is written as llama.cpp's deepseek32 needs it (attn_k_b / attn_v_b, one KV
head), the indexer's GGUF keys, and byte parity with llama.cpp's quantizer."""

from __future__ import annotations

import numpy as np
import pytest

from convert_helpers import assert_q8_0_matches_llama_quantize
from ktconvert.errors import InputError
from ktconvert.families import normalize_config
from ktconvert.golden import read_golden
from ktconvert.golden.paths import golden_root
from ktconvert.model.tiny import tiny_config, write_tiny_model
from numeric import assert_close

FAMILY = "deepseek_v32"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    out = tmp_path_factory.mktemp("ds32") / "model"
    write_tiny_model(FAMILY, out)
    return out


@pytest.fixture(scope="module")
def f32(model, tmp_path_factory):
    from ktconvert.convert import convert

    return convert(model, tmp_path_factory.mktemp("ds32f32") / "out", type="F32").out / "model.gguf"


def test_the_indexer_selection_and_its_rope_decide_the_golden(model):
    """index_topk 26 of up to 31 keys, the indexer's rope in halves (GLM-5's is in interleaved pairs): attending to
    every key, or rotating the indexer as GLM-5 does, moves the logits far past the 1e-5 the reference keeps."""
    import torch

    from ktconvert.model import from_pretrained
    from ktconvert.model.modules import apply_rope_interleaved

    gold = read_golden(golden_root() / FAMILY)
    m = from_pretrained(model)
    ids = torch.from_numpy(gold.input_ids)
    with torch.no_grad():
        sparse = m(ids).logits.numpy()
        for layer in m.model.layers:
            layer.self_attn.indexer.rope = apply_rope_interleaved
        glm_rope = m(ids).logits.numpy()
        for layer in m.model.layers:
            layer.self_attn.indexer.topk = 10**6
        dense = m(ids).logits.numpy()
    assert_close(sparse, gold.logits, "logits")
    assert np.abs(glm_rope - gold.logits).max() > 0.1
    assert np.abs(dense - gold.logits).max() > 0.1


def test_gguf_is_llamacpps_absorbed_mla_with_the_indexer(model, f32):
    from gguf import GGUFReader

    from ktconvert.model.weights import read_tensors

    r = GGUFReader(f32)
    kv = r.fields
    assert kv["general.architecture"].contents() == "deepseek32"
    assert kv["deepseek32.attention.head_count_kv"].contents() == 1
    assert kv["deepseek32.attention.key_length"].contents() == 64 + 16  # kv_lora_rank + qk_rope_head_dim
    assert kv["deepseek32.attention.key_length_mla"].contents() == 32 + 16  # qk_nope + qk_rope
    assert kv["deepseek32.attention.value_length_mla"].contents() == 32
    assert [kv[f"deepseek32.attention.indexer.{k}"].contents() for k in ("head_count", "key_length", "top_k")] == [32, 64, 26]
    assert "deepseek32.attention.indexer.types" not in kv  # V3.2's config has no indexer_types: every layer its own
    assert [kv[f"deepseek32.expert_group_{k}count"].contents() for k in ("", "used_")] == [4, 2]
    got = {t.name: np.asarray(t.data) for t in r.tensors}
    kv_b = read_tensors(model)["model.layers.1.self_attn.kv_b_proj.weight"].numpy().reshape(4, 32 + 32, 64)
    np.testing.assert_array_equal(got["blk.1.attn_k_b.weight"], kv_b[:, :32].transpose(0, 2, 1))
    np.testing.assert_array_equal(got["blk.1.attn_v_b.weight"], kv_b[:, 32:])
    assert "blk.1.attn_kv_b.weight" not in got and "blk.2.indexer.k_norm.bias" in got


def test_inspect_names_the_architecture_from_the_config(model, f32):
    """The tensor names are glm-dsa's too: config.json (or a GGUF's general.architecture) decides."""
    import json

    from click.testing import CliRunner

    from ktconvert.cli import cli

    for path in (model, f32):
        res = CliRunner().invoke(cli, ["inspect", str(path), "-o", "json"], catch_exceptions=False)
        assert res.exit_code == 0, res.output
        report = json.loads(res.stdout)
        assert report["architecture"]["arch"] == "deepseek32"
        assert [p for p in report["problems"] if p["severity"] != "info"] == []


@pytest.mark.interop
def test_q8_0_is_byte_identical_to_llamacpps_quantizer(llama_built, f32, model, tmp_path):
    assert_q8_0_matches_llama_quantize(model, f32, tmp_path)


@pytest.mark.parametrize("change,where", [
    ({"index_head_dim": 8}, "index_head_dim"),
    ({"q_lora_rank": None}, "q_lora_rank"),
    ({"index_topk": 0}, "index_topk"),  # the count validator names the field itself
])
def test_bad_indexer_config_is_one_error_naming_the_key(change, where):
    raw = {**tiny_config(FAMILY), **change}
    with pytest.raises(InputError) as exc:
        normalize_config(raw, path="config.json")
    assert exc.value.where == where and "config.json" in str(exc.value)
