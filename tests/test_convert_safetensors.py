"""Kernel-order safetensors output: the same tensors as the GGUF output, quantized ones as U8 bytes with a
``.ggml_type`` scalar beside each (ktransformers' hybrid safetensors layout), sharded with an index, readable by
the safetensors package itself."""

from __future__ import annotations

import json

import pytest

from convert_helpers import read_gguf, tiny
from ktconvert.convert import convert


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("st")
    src = tiny(root, "deepseek_v3")
    gguf = convert(src, root / "gguf", "cpu-experts-Q4_K").out
    st = convert(src, root / "st", "cpu-experts-Q4_K", format="safetensors", shard_size="4MiB").out
    return src, gguf, st


def test_sharded_with_index_and_copies(outputs):
    src, _, st = outputs
    index = json.loads((st / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in st.glob("model-*.safetensors"))
    assert len(shards) > 1 and set(index["weight_map"].values()) == set(shards)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (st / name).read_bytes() == (src / name).read_bytes()
    m = json.loads((st / "manifest.json").read_text())
    assert set(m["files"]) == {*shards, "model.safetensors.index.json", "config.json", "tokenizer.json",
                               "tokenizer_config.json"}
    sizes = [(st / s).stat().st_size for s in shards]
    assert max(sizes[:-1]) <= 4 * 1024**2 + 1024**2  # a shard closes before it would pass the limit (plus header)


def test_same_bytes_as_gguf_and_type_scalars(outputs):
    import torch
    from gguf import GGMLQuantizationType
    from safetensors import safe_open

    _, gguf, st = outputs
    g, _ = read_gguf(gguf / "model.gguf")
    index = json.loads((st / "model.safetensors.index.json").read_text())["weight_map"]
    seen = set()
    for shard in sorted(set(index.values())):
        with safe_open(st / shard, framework="pt") as f:  # the safetensors package's own reader
            for name in f.keys():
                seen.add(name)
                arr = f.get_tensor(name)
                if name.endswith(".ggml_type"):
                    base = name[: -len(".ggml_type")]
                    tensor = base + ".weight" if base + ".weight" in g else base
                    assert arr.shape == () and arr.dtype == torch.int32
                    assert arr.item() == int(g[tensor][0]), name
                    continue
                ttype, data = g[name]
                assert arr.contiguous().view(torch.uint8).numpy().tobytes() == data.tobytes(), name
                want = {GGMLQuantizationType.F32: torch.float32, GGMLQuantizationType.BF16: torch.bfloat16}
                assert arr.dtype == want.get(ttype, torch.uint8), name
                if arr.dtype == torch.uint8:
                    assert tuple(arr.shape) == data.shape, name
    assert {n for n in seen if not n.endswith(".ggml_type")} == set(g)
    assert "blk.1.ffn_gate_exps.ggml_type" in seen and "blk.1.exp_probs_b.bias.ggml_type" in seen


def test_reader_sees_kernel_order_experts(outputs):
    from ktconvert.formats import detect_layout, open_checkpoint

    _, _, st = outputs
    ck = open_checkpoint(st)
    info = ck["blk.1.ffn_down_exps.weight"]  # U8 bytes on disk, described by the type its .ggml_type names
    assert info.dtype == "Q4_K" and info.shape == (8, 256, 256) and info.nbytes == 8 * 256 * 144
    assert ck.llama_names and ck.read("blk.1.ffn_down_exps.weight").shape == (8, 256, 144)
    report = detect_layout(ck)
    assert report.arch == "deepseek2"


def test_gguf_input_to_safetensors(outputs, tmp_path):
    """A GGUF goes to kernel-order safetensors with its tensors' bytes unchanged (type keep)."""
    _, gguf, _ = outputs
    st = convert(gguf / "model.gguf", tmp_path / "st", type="keep", format="safetensors").out
    from safetensors import safe_open

    g, _ = read_gguf(gguf / "model.gguf")
    with safe_open(st / "model.safetensors", framework="pt") as f:
        import torch

        names = [n for n in f.keys() if not n.endswith(".ggml_type")]
        assert set(names) == set(g)
        for n in names:
            assert f.get_tensor(n).contiguous().view(torch.uint8).numpy().tobytes() == g[n][1].tobytes(), n


@pytest.mark.parametrize("tid,stored,message", [
    (12, "F32", ".ggml_type says Q4_K but blk.0.attn_norm.weight is stored as F32"),
    (1, "F32", ".ggml_type says F16 but blk.0.attn_norm.weight is stored as F32"),
    (9999, "F32", ".ggml_type holds 9999, which is no ggml type"),
])
def test_companion_that_disagrees_with_its_tensor_is_refused(tmp_path, tid, stored, message):
    """A float tensor whose companion names another type is an error, not read one way by inspect and another by
    verify."""
    import numpy as np
    from safetensors.numpy import save_file

    from ktconvert.errors import InputError
    from ktconvert.formats import open_checkpoint

    save_file({"blk.0.attn_norm.weight": np.ones(8, np.float32),
               "blk.0.attn_norm.ggml_type": np.array(tid, np.int32)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(InputError, match=message.replace(".", r"\.", 1)) as e:
        open_checkpoint(tmp_path / "model.safetensors")
    assert "model.safetensors" in str(e.value) and "blk.0.attn_norm.ggml_type" in str(e.value)
