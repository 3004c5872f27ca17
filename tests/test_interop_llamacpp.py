"""Interop tier: llama.cpp itself loads the GGUF `ktconvert quantize` wrote and reproduces the golden logits.

This is the independent proof that our names, metadata and kernel order are the kernel's. llama-cpp-python is
built from source into a cache on first use (minutes); without it the tests skip with the reason, except under
CI, where they must run.
"""

from __future__ import annotations


import numpy as np
import pytest

import llamacpp_runner
from ktconvert import families

pytestmark = pytest.mark.interop


# the five first families at F32, Q8_0 and Q4_K; the families added later at F32 and Q8_0 (the suite's time budget;
# gpt-oss's wider expert activations (tiny.expert_gain) also put Q4_K at the q4_k profile's edge: kl_p99 0.0226/0.022)
INTEROP = [(f, q, p) for f in ("qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v2", "deepseek_v3")
           for q, p in (("F32", "f32"), ("Q8_0", "q8_0"), ("Q4_K", "q4_k"))]
INTEROP += [(f, q, p) for f in ("glm4_moe", "minimax_m2", "gpt_oss", "qwen3_5_moe", "qwen3_vl_moe", "glm_moe_dsa", "qwen3_next", "kimi_k25", "deepseek_v32",
                                "minimax_m3_vl", "glm5_next", "deepseek_v4")
            for q, p in (("F32", "f32"), ("Q8_0", "q8_0"))]


@pytest.mark.parametrize("family,qtype,profile_name", INTEROP, ids=[f"{f}-{q}-{p}" for f, q, p in INTEROP])
def test_llamacpp_reproduces_the_golden_from_our_gguf(llama_built, tmp_path, family, qtype, profile_name):
    from ktconvert.convert import convert
    from ktconvert.golden import read_golden
    from ktconvert.golden.paths import golden_root
    from ktconvert.model.tiny import write_tiny_model
    from ktconvert.verify.profile import evaluate, load_profile

    model = tmp_path / "model"
    write_tiny_model(family, model)
    gguf = convert(model, tmp_path / "converted", type=qtype, allow_fallback=True).out / "model.gguf"
    gold = read_golden(golden_root() / family)
    ids = [int(i) for i in np.asarray(gold.input_ids).reshape(-1)]
    # MiniMax-M3: llama.cpp runs its sparse attention only with flash attention on (the spec says so)
    fa = bool(families.spec(family).section("gguf").get("flash_attention"))
    got, _ = llamacpp_runner.run(gguf, ids, tmp_path, flash_attn=fa)
    want = np.asarray(gold.logits, dtype=np.float32).reshape(len(ids), -1)
    assert got.shape == want.shape
    profile = load_profile(profile_name).for_family(family)
    stats = profile.compare(want, got).summary()
    assert evaluate(profile, "llama.cpp", stats, []) == [], stats


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v2", "deepseek_v3", "glm4_moe", "minimax_m2",
                                    "gpt_oss"])
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


def _variant_logits(llama_built, tmp_path, variant, config_edit=None):
    """(llama.cpp's F32 logits of our GGUF of the deepseek_v3 tiny ``variant``, its golden, the model dir)."""
    from ktconvert.convert import convert
    from ktconvert.golden import read_golden
    from ktconvert.golden.paths import golden_root
    from ktconvert.model.tiny import write_tiny_model

    model = tmp_path / "model"
    write_tiny_model("deepseek_v3", model, variant=variant)
    gguf = convert(model, tmp_path / "converted", type="F32", allow_fallback=True).out / "model.gguf"
    gold = read_golden(golden_root() / f"deepseek_v3-{variant}")
    ids = [int(i) for i in np.asarray(gold.input_ids).reshape(-1)]
    got, _ = llamacpp_runner.run(gguf, ids, tmp_path)
    return got.astype(np.float64), np.asarray(gold.logits, dtype=np.float64).reshape(len(ids), -1), model


def _nmse(got, want) -> float:
    return float(((got - want) ** 2).sum() / (want ** 2).sum())


def test_llamacpp_reproduces_the_moonlight_golden(llama_built, tmp_path):
    """Moonlight (no q LoRA, two shared experts) as a deepseek_v3 configuration: llama.cpp agrees at F32."""
    got, want, _ = _variant_logits(llama_built, tmp_path, "moonlight")
    assert _nmse(got, want) <= 1e-4


def test_llamacpp_runs_kimi_k2_yarn_with_its_default_betas(llama_built, tmp_path):
    """Kimi-K2's rope_scaling has beta_fast = beta_slow = 1. Our GGUF carries them ({arch}.rope.scaling.yarn_beta_*),
    but llama.cpp 0.3.36's deepseek2 loader never reads those keys and runs YaRN with its defaults 32 / 1: its
    logits match the reference run with beta_fast = 32, not transformers' golden. An upstream limitation, pinned
    here so a llama.cpp that honours the keys shows up."""
    import json

    import torch

    from ktconvert.model import from_pretrained

    got, want, model = _variant_logits(llama_built, tmp_path, "kimi_k2")
    cfg = json.loads((model / "config.json").read_text())
    assert cfg["rope_scaling"]["beta_fast"] == 1.0
    cfg["rope_scaling"]["beta_fast"] = 32.0
    (model / "config.json").write_text(json.dumps(cfg))
    from ktconvert.golden import read_golden
    from ktconvert.golden.paths import golden_root

    ids = torch.from_numpy(read_golden(golden_root() / "deepseek_v3-kimi_k2").input_ids)
    with torch.no_grad():
        beta32 = from_pretrained(model)(ids).logits[0].double().numpy()
    assert _nmse(got, beta32) <= 1e-4
    assert _nmse(got, want) > 1e-3
