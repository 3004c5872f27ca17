"""Parity tier: ``ktconvert quantize --imatrix`` writes the tensors ``llama-quantize --imatrix`` writes.

llama.cpp's own tools are built from the pinned source into the cache (tests/llamacpp_tools.py). On the tiny
qwen3_moe (8 merged experts), ktconvert writes the F32 GGUF, ``llama-imatrix`` computes the importance matrix of a
short text on it (GGUF, and the legacy .dat), and both quantizers quantize that F32 GGUF with it: every tensor must
have the same type and the same bytes. Presets are compared with llama-quantize's ftype of the same name, ``--type
T`` with ``llama-quantize --pure``. Every key/value is compared too, llama-quantize's ``quantize.imatrix.*``
provenance keys included.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from convert_helpers import tiny
from llamacpp_tools import run_tool
from test_parity_llamacpp import differences

pytestmark = pytest.mark.interop

TEXT = ("The quick brown fox jumps over the lazy dog while the river runs to the sea. "
        "Numbers such as 3, 14, 159 and 2653 appear between words; so do commas, colons: and questions? ") * 12


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, llama_tools):
    """(F32 GGUF, GGUF imatrix, legacy .dat imatrix) of the tiny qwen3_moe."""
    from ktconvert.convert import convert

    root = tmp_path_factory.mktemp("imx-parity")
    f32 = convert(tiny(root, "qwen3_moe"), root / "f32", type="F32").out / "model.gguf"
    text = root / "text.txt"
    text.write_text(TEXT)
    imx = root / "imatrix.gguf"
    common = ["-m", str(f32), "-f", str(text), "-c", "64", "--chunks", "4", "-t", "1", "--no-ppl"]
    run_tool("llama-imatrix", [*common, "-o", str(imx)])
    dat = root / "imatrix.dat"
    run_tool("llama-imatrix", [*common, "-o", str(dat), "--output-format", "dat"])
    return f32, imx, dat


def _llama_quantize(f32: Path, imatrix: Path, out: Path, ftype: str, *flags: str) -> Path:
    run_tool("llama-quantize", [*flags, "--imatrix", str(imatrix), str(f32), str(out), ftype, "1"])
    return out


@pytest.mark.parametrize("preset", ["Q4_K_M", "Q5_K_M", "Q6_K", "Q4_0"])
def test_preset_with_imatrix_equals_llama_quantize(inputs, tmp_path, preset):
    from ktconvert.convert import convert

    f32, imx, _ = inputs
    want = _llama_quantize(f32, imx, tmp_path / "llama.gguf", preset)
    got = convert(f32, tmp_path / "ours", preset, imatrix=imx).out / "model.gguf"
    assert differences(want, got) == []
    plain = convert(f32, tmp_path / "plain", preset).out / "model.gguf"
    assert differences(want, plain) != [], "the importance matrix changed nothing: the test cannot fail"


@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "IQ4_XS",
                                   "IQ3_XXS", "IQ3_S", "IQ2_S", "IQ1_M"])
def test_type_with_imatrix_equals_llama_quantize_pure(inputs, tmp_path, qtype):
    from ktconvert.convert import convert, recipe_for_type

    f32, imx, _ = inputs
    want = _llama_quantize(f32, imx, tmp_path / "llama.gguf", recipe_for_type(qtype).file_type, "--pure")
    got = convert(f32, tmp_path / "ours", type=qtype, allow_fallback=True, imatrix=imx).out / "model.gguf"
    assert differences(want, got) == []


def test_units_across_expert_boundaries_and_two_jobs_write_the_same_bytes(inputs, tmp_path):
    """A small memory budget cuts the expert tensors into units that start and end inside experts; two workers
    quantize them: each row still gets its own expert's importances."""
    from ktconvert.convert import convert

    f32, imx, _ = inputs
    want = _llama_quantize(f32, imx, tmp_path / "llama.gguf", "Q6_K")
    result = convert(f32, tmp_path / "ours", "Q6_K", imatrix=imx, max_memory="600KiB", jobs=2)
    assert result.units > 30, result.units
    assert differences(want, result.out / "model.gguf") == []


def test_command_line_equals_llama_quantize(inputs, tmp_path):
    """The same through ``ktconvert quantize``'s options as through llama-quantize's."""
    from click.testing import CliRunner

    from ktconvert.cli import cli

    f32, imx, _ = inputs
    want = _llama_quantize(f32, imx, tmp_path / "llama.gguf", "Q4_K_M", "--tensor-type", "attn_k=Q5_K",
                           "--exclude-weights", "ffn_gate")
    res = CliRunner().invoke(cli, ["quantize", str(f32), str(tmp_path / "ours"), "--recipe", "Q4_K_M", "--imatrix",
                                   str(imx), "--tensor-type", "attn_k=Q5_K", "--exclude-weights", "ffn_gate"])
    assert res.exit_code == 0, res.stderr
    assert differences(want, tmp_path / "ours" / "model.gguf") == []


def test_legacy_dat_imatrix_equals_llama_quantize(inputs, tmp_path):
    from ktconvert.convert import convert

    f32, _, dat = inputs
    want = _llama_quantize(f32, dat, tmp_path / "llama.gguf", "Q4_K_M")
    got = convert(f32, tmp_path / "ours", "Q4_K_M", imatrix=dat).out / "model.gguf"
    assert differences(want, got) == []


OVERRIDES = {
    "tensor-type": (["--tensor-type", "ffn_.*_exps=Q2_K", "--tensor-type", "attn_q=Q5_K"],
                    {"tensor_types": ("ffn_.*_exps=Q2_K", "attn_q=Q5_K")}),
    "tensor-type equal to the mix's type": (["--tensor-type", "ffn_down_exps=Q4_K"],
                                            {"tensor_types": ("ffn_down_exps=Q4_K",)}),
    "output-tensor-type": (["--output-tensor-type", "q8_0"], {"output_tensor_type": "Q8_0"}),
    "token-embedding-type": (["--token-embedding-type", "q4_k"], {"token_embedding_type": "Q4_K"}),
    "leave-output-tensor": (["--leave-output-tensor"], {"leave_output_tensor": True}),
    "pure": (["--pure"], {"pure": True}),
}


@pytest.mark.parametrize("case", list(OVERRIDES))
def test_override_with_imatrix_equals_llama_quantize(inputs, tmp_path, case):
    """Each of llama-quantize's per-tensor options on the Q4_K_M mix, with the importance matrix."""
    from ktconvert.convert import convert, load_recipe, with_overrides

    f32, imx, _ = inputs
    flags, kw = OVERRIDES[case]
    want = _llama_quantize(f32, imx, tmp_path / "llama.gguf", "Q4_K_M", *flags)
    got = convert(f32, tmp_path / "ours", with_overrides(load_recipe("Q4_K_M"), **kw), imatrix=imx).out / "model.gguf"
    assert differences(want, got) == []


@pytest.mark.parametrize("flag,names", [("--include-weights", ("ffn_down", "attn_q")),
                                        ("--exclude-weights", ("_exps",))])
def test_include_exclude_weights_equal_llama_quantize(inputs, tmp_path, flag, names):
    from ktconvert.convert import convert

    f32, imx, _ = inputs
    flags = [x for n in names for x in (flag, n)]
    want = _llama_quantize(f32, imx, tmp_path / "llama.gguf", "Q4_K_M", *flags)
    kw = {"include_weights" if flag == "--include-weights" else "exclude_weights": names}
    got = convert(f32, tmp_path / "ours", "Q4_K_M", imatrix=imx, **kw).out / "model.gguf"
    assert differences(want, got) == []
    whole = convert(f32, tmp_path / "whole", "Q4_K_M", imatrix=imx).out / "model.gguf"
    assert differences(want, whole) != [], "the selection changed nothing: the test cannot fail"


def test_experts_without_data_and_missing_entries_equal_llama_quantize(inputs, tmp_path):
    """llama-imatrix's file with expert 3 of blk.0.ffn_down_exps never reached (count 0: importance 1) and
    blk.1.attn_q without an entry (quantized without one): both quantizers treat them alike."""
    import gguf
    import numpy as np

    from ktconvert.convert import convert

    f32, imx, _ = inputs
    src = gguf.GGUFReader(imx)
    edited = tmp_path / "edited.imatrix.gguf"
    w = gguf.GGUFWriter(str(edited), arch="")
    w.kv_data[0].pop("general.architecture", None)
    w.add_string("general.type", "imatrix")
    w.add_array("imatrix.datasets", ["text.txt"])
    w.add_uint32("imatrix.chunk_count", int(src.fields["imatrix.chunk_count"].contents()))
    w.add_uint32("imatrix.chunk_size", int(src.fields["imatrix.chunk_size"].contents()))
    for t in src.tensors:
        if t.name.startswith("blk.1.attn_q.weight."):
            continue
        data = np.array(t.data, dtype=np.float32).reshape(tuple(reversed([int(n) for n in t.shape])))
        if t.name == "blk.0.ffn_down_exps.weight.counts":
            data[3] = 0.0
        w.add_tensor(t.name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    want = _llama_quantize(f32, edited, tmp_path / "llama.gguf", "Q4_K_M")
    result = convert(f32, tmp_path / "ours", "Q4_K_M", imatrix=edited)
    assert differences(want, result.out / "model.gguf") == []
    m = result.manifest["imatrix"]
    assert m["no_data"] == {"blk.0.ffn_down_exps.weight": [3]} and "blk.1.attn_q.weight" in m["tensors_without"]
    unedited = convert(f32, tmp_path / "unedited", "Q4_K_M", imatrix=imx).out / "model.gguf"
    changed = {d.split(":")[0] for d in differences(want, unedited)}
    assert {"tensor blk.0.ffn_down_exps.weight", "tensor blk.1.attn_q.weight"} <= changed, changed


def _deepen(hf: Path, out: Path, n_layers: int) -> Path:
    """The tiny model with ``n_layers`` layers: layer i a copy of layer i % 2 (llama-quantize's first-eighth rules
    need 8 layers or more)."""
    import json
    import shutil

    from safetensors.numpy import load_file, save_file

    shutil.copytree(hf, out)
    cfg = json.loads((out / "config.json").read_text())
    tensors = load_file(out / "model.safetensors")
    deep = {k: v for k, v in tensors.items() if not k.startswith("model.layers.")}
    for i in range(n_layers):
        prefix = f"model.layers.{i % cfg['num_hidden_layers']}."
        deep.update({f"model.layers.{i}." + k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)})
    cfg["num_hidden_layers"] = n_layers
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(deep, str(out / "model.safetensors"))
    return out


def test_q4_0_first_eighth_ffn_down_with_imatrix_equals_llama_quantize(llama_tools, tmp_path):
    """With an importance matrix llama-quantize writes the ffn_down of layers < n_layer/8 as Q4_1 in its Q4_0 mix
    (without one it does not): 8 layers, layer 0's ffn_down_exps."""
    from ktconvert.convert import convert

    hf = _deepen(tiny(tmp_path, "qwen3_moe"), tmp_path / "deep", 8)
    f32 = convert(hf, tmp_path / "f32", type="F32").out / "model.gguf"
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    imx = tmp_path / "deep.imatrix.gguf"
    run_tool("llama-imatrix", ["-m", str(f32), "-f", str(text), "-c", "64", "--chunks", "2", "-t", "1", "--no-ppl",
                               "-o", str(imx)])
    want = _llama_quantize(f32, imx, tmp_path / "llama.gguf", "Q4_0")
    result = convert(f32, tmp_path / "ours", "Q4_0", imatrix=imx)
    assert differences(want, result.out / "model.gguf") == []
    types = {t["name"]: t["type"] for t in result.manifest["tensors"]}
    assert types["blk.0.ffn_down_exps.weight"] == "Q4_1" and types["blk.1.ffn_down_exps.weight"] == "Q4_0"
    plain = convert(f32, tmp_path / "plain", "Q4_0")
    assert {t["name"]: t["type"] for t in plain.manifest["tensors"]}["blk.0.ffn_down_exps.weight"] == "Q4_0"
