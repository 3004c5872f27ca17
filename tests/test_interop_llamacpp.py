"""Interop tier: llama.cpp itself loads the GGUF `ktconvert quantize` wrote and reproduces the golden logits.

This is the independent proof that our names, metadata and kernel order are the kernel's. llama-cpp-python is
built from source into a cache on first use (minutes); without it the tests skip with the reason, except under
CI, where they must run.
"""

from __future__ import annotations


import numpy as np
import pytest

import llamacpp_runner

pytestmark = pytest.mark.interop


@pytest.mark.parametrize("qtype,profile_name", [("F32", "f32"), ("Q8_0", "q8_0"), ("Q4_K", "q4_k")])
@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v2", "deepseek_v3", "qwen3_5_moe", "qwen3_vl_moe", "glm_moe_dsa"])
def test_llamacpp_reproduces_the_golden_from_our_gguf(llama_built, tmp_path, family, qtype, profile_name):
    from ktconvert.convert import convert
    from ktconvert.golden import read_golden
    from ktconvert.golden.paths import golden_root
    from ktconvert.model.tiny import write_tiny_model
    from ktconvert.verify.metrics import compare_logits
    from ktconvert.verify.profile import evaluate, load_profile

    model = tmp_path / "model"
    write_tiny_model(family, model)
    gguf = convert(model, tmp_path / "converted", type=qtype, allow_fallback=True).out / "model.gguf"
    gold = read_golden(golden_root() / family)
    ids = [int(i) for i in np.asarray(gold.input_ids).reshape(-1)]
    got, _ = llamacpp_runner.run(gguf, ids, tmp_path)
    want = np.asarray(gold.logits, dtype=np.float32).reshape(len(ids), -1)
    assert got.shape == want.shape
    profile = load_profile(profile_name).for_family(family)
    stats = compare_logits(want, got, profile.topk).summary()
    assert evaluate(profile, "llama.cpp", stats, []) == [], stats


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v2", "deepseek_v3"])
def test_llamacpp_tokenizes_like_the_hf_tokenizer(llama_built, tmp_path, family):
    """The converted tokenizer.json (BPE) in our GGUF splits text exactly as the Hugging Face tokenizer does."""
    from transformers import AutoTokenizer

    from ktconvert.convert import convert
    from ktconvert.model.tiny import write_tiny_model
    from ktconvert.model.tinytok import PROMPT_TEXT

    model = tmp_path / "model"
    write_tiny_model(family, model)
    gguf = convert(model, tmp_path / "converted", type="Q8_0").out / "model.gguf"
    text = PROMPT_TEXT + " Experts, routers & norms: 42 tokens!"
    _, tokens = llamacpp_runner.run(gguf, [1, 2, 3], tmp_path, text=text)
    want = AutoTokenizer.from_pretrained(model)(text, add_special_tokens=False)["input_ids"]
    assert tokens == want
