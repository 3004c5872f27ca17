"""A GGUF ktconvert wrote for qwen2moe / qwen3moe loads in Hugging Face transformers' own GGUF loader, and its F32
logits equal the original model's exactly.

transformers' ``from_pretrained(..., gguf_file=...)`` refuses to run without the ``accelerate`` package, which
this project does not depend on; the test therefore calls the loader it delegates to,
``transformers.modeling_gguf_pytorch_utils.load_gguf_checkpoint`` (GGUFReader, name mapping, its Qwen2-MoE
tensor processor that rebuilds the fused experts), and loads the result strictly into a model built from the
config: every parameter must come from the GGUF.
"""

from __future__ import annotations

import pytest

from convert_helpers import tiny
from ktconvert.convert import convert

pytest.importorskip("transformers")


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe"])
def test_transformers_gguf_loader_gives_identical_f32_logits(tmp_path, family):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    src = tiny(tmp_path, family)
    out = convert(src, tmp_path / "gguf", type="F32").out
    cfg = AutoConfig.from_pretrained(src)
    original = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    parsed = load_gguf_checkpoint(str(out / "model.gguf"), return_tensors=True, model_to_load=model)
    assert parsed["config"]["model_type"] == family
    state = parsed["tensors"]
    assert set(state) == set(model.state_dict())
    model.load_state_dict(state, strict=True)
    ids = torch.tensor([[510, 5, 77, 300, 12, 9, 450, 3, 101, 7, 64, 200]])
    with torch.no_grad():
        want, got = original(ids).logits, model(ids).logits
    assert torch.equal(want, got), (want - got).abs().max().item()
