"""llama.cpp itself loads the GGUF ktconvert writes for every family and computes the same logits as Hugging Face
transformers (float32 weights; llama.cpp's own kernels, so within 5e-3, same top-1 everywhere), and tokenizes
with the converted tokenizer exactly as the HF tokenizer does.

Needs ``llama-cpp-python`` (it builds llama.cpp from source, several minutes), so it is not part of the default
run: it skips unless ``llama_cpp`` is importable. Measured by hand with llama-cpp-python 0.3.36: max |logit
difference| 0.0009 (Qwen2/3-MoE), 0.0007 (Mixtral), 0.0015 (DeepSeek-V2), 0.0013 (DeepSeek-V3).
"""

from __future__ import annotations

import numpy as np
import pytest

from convert_helpers import FAMILIES, tiny
from ktconvert.convert import convert

pytestmark = pytest.mark.interop
llama_cpp = pytest.importorskip("llama_cpp")

IDS = [510, 5, 77, 300, 12, 9, 450, 3, 101, 7, 64, 200]


@pytest.mark.parametrize("family", FAMILIES)
def test_llama_cpp_loads_and_agrees_with_transformers(tmp_path, family):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ktconvert.model.tinytok import PROMPT_TEXT

    src = tiny(tmp_path, family)
    out = convert(src, tmp_path / "gguf", type="F32").out
    llm = llama_cpp.Llama(model_path=str(out / "model.gguf"), n_ctx=64, logits_all=True, n_threads=2, verbose=False)
    llm.eval(IDS)
    got = np.array(llm.scores[: len(IDS)])
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        want = model(torch.tensor([IDS])).logits[0].numpy()
    assert np.abs(got - want).max() < 5e-3
    assert (got.argmax(-1) == want.argmax(-1)).all()
    hf_ids = AutoTokenizer.from_pretrained(src)(PROMPT_TEXT, add_special_tokens=False)["input_ids"]
    assert llm.tokenize(PROMPT_TEXT.encode(), add_bos=False) == hf_ids
