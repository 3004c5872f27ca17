"""GLM-5 (glm_moe_dsa) beyond the family-parametrised tests: the DSA indexer's selection decides the golden, MLA's
kv_b_proj is written as llama.cpp's glm-dsa needs it (attn_k_b / attn_v_b, one KV head), the indexer's GGUF keys, and
byte parity with llama.cpp's quantizer."""

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

FAMILY = "glm_moe_dsa"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    out = tmp_path_factory.mktemp("glm") / "model"
    write_tiny_model(FAMILY, out)
    return out


@pytest.fixture(scope="module")
def f32(model, tmp_path_factory):
    from ktconvert.convert import convert

    return convert(model, tmp_path_factory.mktemp("glmf32") / "out", type="F32").out / "model.gguf"


def test_the_indexer_selection_decides_the_golden(model):
    """index_topk 28 of up to 31 keys: attending to every key instead moves the logits far past the 1e-5 the
    reference keeps to transformers, so the golden checks the sparse selection itself."""
    import torch

    from ktconvert.model import from_pretrained

    gold = read_golden(golden_root() / FAMILY)
    m = from_pretrained(model)
    ids = torch.from_numpy(gold.input_ids)
    with torch.no_grad():
        sparse = m(ids).logits.numpy()
        for layer in m.model.layers:
            layer.self_attn.indexer.topk = 10**6
        dense = m(ids).logits.numpy()
    assert_close(sparse, gold.logits, "logits")
    assert np.abs(dense - gold.logits).max() > 0.1


def test_gguf_is_llamacpps_absorbed_mla_with_the_indexer(model, f32):
    from gguf import GGUFReader

    from ktconvert.model.weights import read_tensors

    r = GGUFReader(f32)
    kv = r.fields
    assert kv["general.architecture"].contents() == "glm-dsa"
    assert kv["glm-dsa.attention.head_count_kv"].contents() == 1
    assert kv["glm-dsa.attention.key_length"].contents() == 64 + 32  # kv_lora_rank + qk_rope_head_dim
    assert kv["glm-dsa.attention.key_length_mla"].contents() == 64 + 32  # qk_nope + qk_rope
    assert kv["glm-dsa.attention.value_length_mla"].contents() == 64
    assert [kv[f"glm-dsa.attention.indexer.{k}"].contents() for k in ("head_count", "key_length", "top_k")] == [12, 64, 28]
    assert kv["glm-dsa.attention.indexer.types"].contents() == [True, True, True]
    got = {t.name: np.asarray(t.data) for t in r.tensors}
    kv_b = read_tensors(model)["model.layers.1.self_attn.kv_b_proj.weight"].numpy().reshape(4, 64 + 64, 64)
    np.testing.assert_array_equal(got["blk.1.attn_k_b.weight"], kv_b[:, :64].transpose(0, 2, 1))
    np.testing.assert_array_equal(got["blk.1.attn_v_b.weight"], kv_b[:, 64:])
    assert "blk.1.attn_kv_b.weight" not in got


@pytest.mark.interop
def test_q8_0_is_byte_identical_to_llamacpps_quantizer(llama_built, f32, model, tmp_path):
    assert_q8_0_matches_llama_quantize(model, f32, tmp_path)


@pytest.mark.parametrize("change,where", [
    ({"indexer_types": ["full", "shared", "full"]}, "indexer_types"),
    ({"index_head_dim": 16}, "index_head_dim"),
    ({"q_lora_rank": None}, "q_lora_rank"),
])
def test_bad_indexer_config_is_one_error_naming_the_key(change, where):
    raw = {**tiny_config(FAMILY), **change}
    with pytest.raises(InputError) as exc:
        normalize_config(raw, path="config.json")
    assert exc.value.where == where and "config.json" in str(exc.value)
