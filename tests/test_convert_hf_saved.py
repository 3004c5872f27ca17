"""Checkpoints saved by Hugging Face transformers itself, in BF16, in both its per-expert and its fused
(``save_original_format=False``) form: ``keep`` copies every BF16 weight bit for bit into kernel order, Q8_0
equals quantizing the HF tensors directly, and the fused save converts to exactly the bytes the per-expert save
does."""

from __future__ import annotations

import numpy as np
import pytest

from convert_helpers import expected_gguf, read_gguf
from formats_helpers import hf_checkpoint
from ktconvert.convert import convert

pytest.importorskip("transformers")


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral", "deepseek_v3"])
def test_transformers_bf16_saves(tmp_path, family):
    from gguf import GGMLQuantizationType

    from ktconvert.quant import quantize

    split = hf_checkpoint(tmp_path, family, "split", dtype="bfloat16")
    fused = hf_checkpoint(tmp_path, family, "fused", dtype="bfloat16")
    want = expected_gguf(split, family)
    keep, _ = read_gguf(convert(split, tmp_path / "keep", type="keep").out / "model.gguf")
    assert set(keep) == set(want)
    for name, arr in want.items():
        ttype, data = keep[name]
        bf16 = (arr.view(np.uint32) >> 16).astype(np.uint16)  # the HF BF16 bits (widening to F32 was exact)
        if ttype == GGMLQuantizationType.F32:  # routers, norms, biases: F32, as llama.cpp keeps them
            assert np.array_equal(data.view(np.uint32), arr.view(np.uint32)), name
        else:
            assert ttype == GGMLQuantizationType.BF16, name
            assert data.reshape(-1).view(np.uint16).tobytes() == bf16.tobytes(), name
    q8_split = convert(split, tmp_path / "q8-split", type="Q8_0", allow_fallback=True).out / "model.gguf"  # rows of 40: F16
    q8, _ = read_gguf(q8_split)
    for name, arr in want.items():
        ttype, data = q8[name]
        t = GGMLQuantizationType(ttype).name
        assert data.reshape(-1).view(np.uint8).tobytes() == quantize(arr, t).tobytes(), name
    q8_fused = convert(fused, tmp_path / "q8-fused", type="Q8_0", allow_fallback=True).out / "model.gguf"
    fz, _ = read_gguf(q8_fused)
    assert set(fz) == set(q8) and all(fz[n][1].tobytes() == q8[n][1].tobytes() for n in q8)
