"""Round trips on the tiny models of all five families: HF -> GGUF F32 reads back bit-identical, HF -> Q8_0 /
Q4_K / Q6_K equals quantizing the HF tensors directly, GGUF -> requantized GGUF keeps every untargeted KV pair
and tensor byte-identical; fused and transposed HF layouts and legacy split GGUF give the same kernel order."""

from __future__ import annotations

import json

import numpy as np
import pytest

from convert_helpers import ARCH, FAMILIES, expected_gguf, field_bytes, hf_tensors, read_gguf, tiny
from ktconvert.convert import convert
from ktconvert.convert.recipe import F32_MATCH
from ktconvert.errors import InputError

F32_RE = __import__("re").compile(F32_MATCH)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("roundtrip")


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_to_gguf_f32_reads_back_bit_identical(root, family):
    src = tiny(root, family)
    res = convert(src, root / f"{family}-f32", type="F32")
    got, reader = read_gguf(res.out / "model.gguf")
    want = expected_gguf(src, family)
    assert set(got) == set(want)
    for name, arr in want.items():
        ttype, data = got[name]
        assert int(ttype) == 0, name
        assert data.shape == arr.shape, (name, data.shape, arr.shape)
        assert np.array_equal(data.view(np.uint32), arr.view(np.uint32)), name
    # every HF tensor is somewhere in the file, bit for bit: the stacked experts slice back into per-expert tensors
    hf = hf_tensors(src)
    n_experts = sum(1 for n in hf if ".experts." in n and "shared" not in n)
    merged = [a for n, a in want.items() if "_exps" in n]
    assert n_experts == sum(a.shape[0] for a in merged) > 0 and len(want) - len(merged) + n_experts == len(hf)
    assert reader.fields["general.architecture"].contents() == ARCH[family]


def _expected_type(name: str, shape, qtype: str) -> str:
    from ktconvert.convert.recipe import FALLBACKS
    from ktconvert.quant import block_size

    if F32_RE.search(name):
        return "F32"
    for t in (qtype, *FALLBACKS[qtype]):
        if shape[-1] % block_size(t) == 0:
            return t
    raise AssertionError(name)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("family", FAMILIES)
def test_hf_to_quantized_equals_quantizing_hf_tensors(root, family, qtype):
    from gguf import GGMLQuantizationType

    from ktconvert.quant import quantize

    src = tiny(root, family)
    if family.startswith("deepseek") and qtype != "Q8_0":  # asked for one type, rows that cannot hold it: refused
        with pytest.raises(InputError, match="its fallback .* is not allowed"):
            convert(src, root / f"{family}-{qtype}-strict", type=qtype)
    res = convert(src, root / f"{family}-{qtype}", type=qtype, allow_fallback=True)
    got, _ = read_gguf(res.out / "model.gguf")
    assert [f["tensor"] for f in res.manifest["plan"]["fallbacks"]] == \
        [t for t, (ty, _) in got.items() if ty.name not in (qtype, "F32")]
    want = expected_gguf(src, family)
    assert set(got) == set(want)
    fallbacks = 0
    for name, arr in want.items():
        ttype, data = got[name]
        t = _expected_type(name, arr.shape, qtype)
        fallbacks += t not in (qtype, "F32")
        assert ttype == GGMLQuantizationType[t], (name, ttype, t)
        direct = quantize(arr, t)
        assert np.array_equal(data.reshape(-1).view(np.uint8), direct.reshape(-1)), name
        if t == "Q8_0":  # and gguf-py's own Q8_0 quantizer, an implementation no one here wrote
            import gguf

            assert np.array_equal(data.reshape(-1).view(np.uint8), gguf.quants.quantize(arr, GGMLQuantizationType.Q8_0).reshape(-1)), name
    # DeepSeek's MLA rows (q_lora_rank 128, kv_lora_rank 64) cannot hold K-quants: they took llama.cpp's fallback
    assert (fallbacks > 0) == (family.startswith("deepseek") and qtype != "Q8_0")


def test_gguf_requantized_keeps_untargeted_kv_and_tensors_byte_identical(root, tmp_path):
    """Requantize only the routed gate/up experts of a Q8_0 GGUF to Q4_K; everything else must not move a bit."""
    from gguf import GGMLQuantizationType

    from ktconvert.quant import dequantize, quantize

    src = convert(tiny(root, "deepseek_v3"), root / "ds3-q8-src", type="Q8_0").out / "model.gguf"
    recipe = tmp_path / "experts-q4k.yaml"
    recipe.write_text("kind: convert-recipe\nname: experts-q4k\nrules:\n"
                      "  - {match: 'ffn_(gate|up)_exps', type: Q4_K}\n  - {match: '.', type: keep}\n")
    out = convert(src, tmp_path / "requant", recipe, allow_requantize=True).out / "model.gguf"  # Q8_0 -> Q4_K
    a, ra = read_gguf(src)
    b, rb = read_gguf(out)
    assert list(a) == list(b)  # same tensors, same order
    targeted = [n for n in a if "ffn_gate_exps" in n or "ffn_up_exps" in n]
    assert len(targeted) == 4
    for name, (ttype, data) in a.items():
        if name in targeted:
            assert b[name][0] == GGMLQuantizationType.Q4_K
            want = quantize(dequantize(data, GGMLQuantizationType.Q8_0), "Q4_K")
            assert np.array_equal(b[name][1].reshape(-1), want.reshape(-1)), name
        else:
            assert b[name][0] == ttype and b[name][1].tobytes() == data.tobytes(), name
    changed = {k for k in ra.fields if not k.startswith("GGUF.") and field_bytes(ra, k) != field_bytes(rb, k)}
    assert changed <= {"general.file_type"}  # recomputed: still Q8_0 here, Q8_0 holds the most bytes
    # the same keys in the same order, the two recomputed ones moved to the end as llama-quantize writes them
    # (its gguf_set_val_* appends a key it sets again)
    moved = ["general.quantization_version", "general.file_type"]
    keys = [k for k in ra.fields if not k.startswith("GGUF.")]
    assert [k for k in rb.fields if not k.startswith("GGUF.")] == [k for k in keys if k not in moved] + moved


def test_gguf_keep_everything_is_a_byte_copy(root, tmp_path):
    src = convert(tiny(root, "qwen3_moe"), root / "q3-q6-src", type="Q6_K").out / "model.gguf"
    out = convert(src, tmp_path / "same", type="keep").out / "model.gguf"
    assert out.read_bytes() == src.read_bytes()


def _save_fused(src, dst, transposed: bool):
    """The tiny checkpoint re-saved with transformers 5's fused experts ([E,2I,H] + [E,H,I]) or transposed."""
    from ktconvert.formats.safetensors_write import to_bytes

    dst.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (dst / f).write_bytes((src / f).read_bytes())
    cfg = json.loads((src / "config.json").read_text())
    t = hf_tensors(src)
    E = cfg.get("num_experts") or cfg.get("num_local_experts")
    out = {}
    for L in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{L}.mlp.experts"
        gate = np.stack([t.pop(f"{p}.{e}.gate_proj.weight") for e in range(E)])
        up = np.stack([t.pop(f"{p}.{e}.up_proj.weight") for e in range(E)])
        down = np.stack([t.pop(f"{p}.{e}.down_proj.weight") for e in range(E)])
        gu = np.concatenate([gate, up], axis=1)
        out[f"{p}.gate_up_proj"] = np.ascontiguousarray(gu.transpose(0, 2, 1)) if transposed else gu
        out[f"{p}.down_proj"] = np.ascontiguousarray(down.transpose(0, 2, 1)) if transposed else down
    out.update(t)
    (dst / "model.safetensors").write_bytes(to_bytes(out, {"format": "pt"}))
    return dst


@pytest.mark.parametrize("transposed", [False, True], ids=["fused-E2IH", "fused-EH2I"])
def test_fused_hf_layouts_give_the_same_kernel_order(root, tmp_path, transposed):
    src = tiny(root, "qwen3_moe")
    ref = convert(src, root / "q3-split-q8", type="Q8_0").out / "model.gguf" if not (root / "q3-split-q8").exists() \
        else root / "q3-split-q8" / "model.gguf"
    fused = _save_fused(src, tmp_path / "fused", transposed)
    out = convert(fused, tmp_path / "out", type="Q8_0").out / "model.gguf"
    a, _ = read_gguf(ref)
    b, _ = read_gguf(out)
    assert set(a) == set(b)
    for name in a:
        assert a[name][1].tobytes() == b[name][1].tobytes(), name


def test_legacy_split_gguf_is_merged_into_exps(tmp_path):
    """A legacy per-expert GGUF written by gguf-py (blk.L.ffn_gate.E.weight) becomes blk.L.ffn_gate_exps.weight:
    the per-expert Q8_0/F16 slabs stacked byte for byte."""
    from formats_helpers import gguf_from_hf

    src = gguf_from_hf(tmp_path, "qwen3_moe", legacy_split=True) / "model.gguf"
    out = convert(src, tmp_path / "merged", type="keep").out / "model.gguf"
    a, _ = read_gguf(src)
    b, _ = read_gguf(out)
    for L in (0, 1, 2):
        for proj in ("gate", "up", "down"):
            per = [a[f"blk.{L}.ffn_{proj}.{e}.weight"] for e in range(8)]
            ttype, data = b[f"blk.{L}.ffn_{proj}_exps.weight"]
            assert ttype == per[0][0]
            assert data.tobytes() == b"".join(d.tobytes() for _, d in per)
    assert not any(".ffn_gate.0." in n for n in b)


def test_gguf_tensor_no_naming_map_knows_is_carried_through(tmp_path):
    """A llama.cpp tensor outside the naming maps (rope_freqs) stays under its name, its bytes untouched."""
    from formats_helpers import write_gguf

    rng = np.random.default_rng(0)
    src = write_gguf(tmp_path / "x.gguf", "qwen3moe", {"token_embd.weight": rng.standard_normal((16, 64), np.float32),
                                                        "rope_freqs.weight": rng.standard_normal(32, np.float32)})
    out = convert(src, tmp_path / "out", type="Q8_0").out / "model.gguf"
    a, _ = read_gguf(src)
    b, _ = read_gguf(out)
    assert b["rope_freqs.weight"][1].tobytes() == a["rope_freqs.weight"][1].tobytes()
    assert b["token_embd.weight"][0].name == "Q8_0"
