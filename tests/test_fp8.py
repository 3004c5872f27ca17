"""FP8 block-scaled input (issue 14): recognition, exact dequantization into every output, hostile input.

Expected values come from :mod:`fp8_helpers` (torch's float8 decoding, the safetensors package, a per-element
block lookup) and, for GGUF naming and stacking, from ``convert_helpers.expected_gguf`` (gguf-py's name tables),
never from ktconvert's own FP8 code.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from convert_helpers import expected_gguf
from fp8_helpers import block_of, reference_dequant, reshard_with_mtp, rewrite, tiny_fp8, write_reference_dir
from ktconvert.convert import convert, plan_conversion
from ktconvert.errors import InputError
from ktconvert.formats import open_checkpoint
from ktconvert.formats.inspect_report import build_inspect_report

FAMILIES = ("deepseek_v3", "qwen3_moe")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("fp8")


def _gguf_float(path, name):
    ck = open_checkpoint(path)
    return ck.read_float32(name).reshape(ck[name].shape)


@pytest.fixture(scope="module")
def expected(root):
    """GGUF name -> float32 a correct conversion of the exact dequantization holds, per family."""
    return {f: expected_gguf(write_reference_dir(tiny_fp8(root, f), root / f"ref-{f}"), f) for f in FAMILIES}


def test_tiny_fp8_has_edge_blocks_and_scale_dtypes(root):
    """The tiny FP8 models exercise partial blocks in both axes and the release scale types (F32 / BF16)."""
    for family, scale_dtype in (("deepseek_v3", "F32"), ("qwen3_moe", "BF16")):
        d = tiny_fp8(root, family)
        ck = open_checkpoint(d)
        bn, bk = block_of(d)
        fp8 = [n for n in ck if ck[n].dtype == "F8_E4M3"]
        assert fp8 and all(ck[n + "_scale_inv"].dtype == scale_dtype for n in fp8)
        assert any(ck[n].shape[0] % bn for n in fp8) and any(ck[n].shape[1] % bk for n in fp8)
        for n in fp8:
            assert ck[n + "_scale_inv"].shape == (math.ceil(ck[n].shape[0] / bn), math.ceil(ck[n].shape[1] / bk))


@pytest.mark.parametrize("family", FAMILIES)
def test_f32_output_is_bit_exact_dequantization(root, expected, family):
    out = convert(tiny_fp8(root, family), root / f"{family}-f32", type="F32").out / "model.gguf"
    want = expected[family]
    ck = open_checkpoint(out)
    assert set(ck) == set(want)
    for name, ref in want.items():
        got = _gguf_float(out, name)
        assert got.shape == ref.shape, name
        assert np.array_equal(got.view(np.uint32), ref.astype(np.float32).view(np.uint32)), name


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_output_is_rne_of_dequantization(root, expected, family):
    import torch

    out = convert(tiny_fp8(root, family), root / f"{family}-bf16", type="BF16").out / "model.gguf"
    ck = open_checkpoint(out)
    for name, ref in expected[family].items():
        if ck[name].dtype != "BF16":  # routers, norms, biases stay F32
            continue
        want = torch.from_numpy(np.ascontiguousarray(ref, dtype=np.float32)).to(torch.bfloat16).view(torch.int16)
        assert np.array_equal(np.asarray(ck.read(name)).view(np.int16), want.numpy()), name


def test_q8_0_output_is_ggml_quantization_of_dequantization(root, expected):
    import gguf
    from gguf import GGMLQuantizationType

    family = "deepseek_v3"
    out = convert(tiny_fp8(root, family), root / f"{family}-q8", type="Q8_0").out / "model.gguf"
    ck = open_checkpoint(out)
    n_q8 = 0
    for name, ref in expected[family].items():
        if ck[name].dtype != "Q8_0":
            continue
        n_q8 += 1
        want = gguf.quants.quantize(np.ascontiguousarray(ref, dtype=np.float32), GGMLQuantizationType.Q8_0)
        assert np.array_equal(np.asarray(ck.read(name)).reshape(-1), want.reshape(-1).view(np.uint8)), name
    assert n_q8 > 20


def test_scales_in_another_shard_and_mtp_layer(root, expected):
    """Scales stored in a second shard, an MTP layer past num_hidden_layers: the same tensors as the plain model."""
    family = "deepseek_v3"
    src = reshard_with_mtp(tiny_fp8(root, family), root / "ds3-sharded-mtp", n_layers=3)
    ck = open_checkpoint(src)
    w = "model.layers.1.mlp.experts.0.gate_proj.weight"
    assert ck[w].file.name != ck[w + "_scale_inv"].file.name
    assert any(n.startswith("model.layers.3.") and ck[n].dtype == "F8_E4M3" for n in ck)
    plan = plan_conversion(src, type="F32")
    assert any("multi-token-prediction" in n for n in plan.notes)
    out = convert(src, root / "ds3-sharded-f32", type="F32").out / "model.gguf"
    for name, ref in expected[family].items():
        assert np.array_equal(_gguf_float(out, name).view(np.uint32), ref.view(np.uint32)), name


def test_dequantize_bounded_rows_match_whole(root):
    """Any run of rows (starting mid-block, crossing edge blocks) dequantizes to the same values as the whole."""
    from ktconvert.formats import fp8

    d = tiny_fp8(root, "deepseek_v3")
    ck = open_checkpoint(d)
    fm = fp8.analyze_fp8(ck)
    ref = reference_dequant(d)
    w = fm.weights["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]  # 80 rows: a 16-row edge block
    assert np.array_equal(fp8.read_float32(ck, w), ref[w.name])
    for r0, r1 in ((0, 1), (5, 37), (31, 80), (64, 80), (79, 80)):
        assert np.array_equal(fp8.read_rows(ck, w, r0, r1), ref[w.name][r0:r1]), (r0, r1)
    ids = np.array([79, 3, 40, 64, 0])
    assert np.array_equal(fp8.read_row_ids(ck, w, ids), ref[w.name][ids])


def test_encode_e4m3_is_round_to_nearest_even():
    import torch

    from ktconvert.formats import fp8

    x = np.concatenate([np.linspace(-500, 500, 20001, dtype=np.float32),
                        np.float32([0.0, -0.0, 2 ** -9, 2 ** -10, 3 * 2 ** -10, 1e-6, 448, 464, 480])])
    want = torch.from_numpy(np.clip(x, -448, 448)).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    got = fp8.encode_e4m3(x)
    same = (got == want) | ((got & 0x7F) == 0) & ((want & 0x7F) == 0)  # +0 / -0
    assert same.all(), x[~same][:5]


# --- inspect -------------------------------------------------------------------------------------------------------


def test_inspect_shows_fp8_not_unknown(root):
    r = build_inspect_report(tiny_fp8(root, "qwen3_moe"), tensors=r"layers\.0\.self_attn\.q_proj")
    assert r["fp8"] == {"block": [96, 96], "block_source": "quantization_config.weight_block_size",
                        "weights": r["fp8"]["weights"], "scales": r["fp8"]["weights"], "scale_dtypes": {"BF16": 56}}
    assert "unknown" not in r["groups"] and "fp8_scales" in r["groups"]
    assert not [p for p in r["problems"] if p["kind"] == "unknown-tensors"]
    t = {x["name"]: x for x in r["tensors"]}
    assert t["model.layers.0.self_attn.q_proj.weight"]["fp8_scale"] == "model.layers.0.self_attn.q_proj.weight_scale_inv"
    assert t["model.layers.0.self_attn.q_proj.weight"]["numpy_shape"] == [256, 256]


def test_scan_checks_scales_and_dequantized_experts(root):
    def edit_ds(t, d, cfg):
        s = t["model.layers.1.mlp.experts.1.up_proj.weight_scale_inv"]
        s[0, 0], s[1, 1], s[2, 2] = np.nan, 0.0, -1.0
        t["model.layers.2.mlp.experts.2.gate_proj.weight_scale_inv"][:] = 0.0

    src = rewrite(tiny_fp8(root, "deepseek_v3"), root / "ds3-scan", edit_ds)
    r = build_inspect_report(src, scan=True)
    kinds = {(f["kind"], f["tensor"]) for f in r["scan"]["findings"]}
    up = "model.layers.1.mlp.experts.1.up_proj.weight"
    assert {("scale-nan", up + "_scale_inv"), ("scale-zero", up + "_scale_inv"),
            ("scale-negative", up + "_scale_inv"), ("nan", up)} <= kinds
    assert ("all-zero", "model.layers.2.mlp.experts.2.gate_proj.weight") in kinds
    assert r["status"] == "fail" and not r["scan"]["skipped"]
    clean = build_inspect_report(tiny_fp8(root, "deepseek_v3"), scan=True)
    assert clean["status"] == "ok" and not clean["scan"]["findings"]


# --- hostile input ---------------------------------------------------------------------------------------------------


def _refused(src, out, match, where):
    with pytest.raises(InputError, match=match) as exc:
        convert(src, out, type="Q8_0")
    assert exc.value.where == f"tensor {where}" and exc.value.path and exc.value.fix
    assert not out.exists() and not list(out.parent.glob(f".{out.name}*"))


def test_missing_scale_is_one_clear_error(root):
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    src = rewrite(tiny_fp8(root, "deepseek_v3"), root / "no-scale", lambda t, d, c: t.pop(name + "_scale_inv"))
    _refused(src, root / "no-scale-out", "has no scale tensor", name)


def test_wrong_scale_shape_is_one_clear_error(root):
    name = "model.layers.0.self_attn.o_proj.weight"

    def edit(t, d, c):
        t[name + "_scale_inv"] = np.ones((3, 3), np.float32)

    src = rewrite(tiny_fp8(root, "deepseek_v3"), root / "bad-scale", edit)
    _refused(src, root / "bad-scale-out", r"scale shape \[3, 3\] does not match", name + "_scale_inv")


def test_block_size_the_weights_do_not_fit_is_one_clear_error(root):
    def edit(t, d, c):
        c["quantization_config"]["weight_block_size"] = [128, 128]

    src = rewrite(tiny_fp8(root, "deepseek_v3"), root / "bad-block", edit)
    first = next(n for n in open_checkpoint(src) if open_checkpoint(src)[n].dtype == "F8_E4M3")
    _refused(src, root / "bad-block-out", r"weight_block_size \[128, 128\].*does not fit.*\[32, 48\]", first)


def test_malformed_block_size_is_refused(root):
    def edit(t, d, c):
        c["quantization_config"]["weight_block_size"] = [0, "x"]

    src = rewrite(tiny_fp8(root, "qwen3_moe"), root / "bad-wbs", edit)
    with pytest.raises(InputError, match="two positive integers") as exc:
        convert(src, root / "bad-wbs-out", type="F32")
    assert exc.value.where == "quantization_config.weight_block_size"
    r = build_inspect_report(src)
    assert r["status"] == "fail" and any(p["kind"] == "fp8-scale" for p in r["problems"])


def test_dry_run_plan_names_scales(root):
    plan = plan_conversion(tiny_fp8(root, "qwen3_moe"), type="Q8_0")
    d = json.loads(json.dumps(plan.to_dict()))
    segs = [s for t in d["output_tensors"] for s in t.get("segments", []) if "scale" in s]
    assert segs and all(s["block"] == [96, 96] and s["scale"] == s["source"] + "_scale_inv" for s in segs)


# --- --to hf ---------------------------------------------------------------------------------------------------------


def _logits(model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([[5, 77, 301, 12, 9, 400, 3, 250]])
    with torch.no_grad():
        return model(ids).logits.numpy()


def test_to_hf_f32_loads_in_transformers_with_the_dequantized_logits(root):
    """--to hf --type F32: HF names and layout, sharded with an index, config without quantization_config; every
    tensor bit-exact with the reference dequantization; transformers' logits equal the dequantized model's."""
    pytest.importorskip("transformers")
    from safetensors.numpy import load_file

    src = tiny_fp8(root, "deepseek_v3")
    out = convert(src, root / "ds3-hf-f32", type="F32", format="hf", shard_size="2MiB").out
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["dtype"] == "float32"
    assert (out / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["format"] == "hf" and set(manifest["files"]) >= set(index["weight_map"].values())
    got = {}
    for f in sorted(out.glob("model-*.safetensors")):
        got.update(load_file(str(f)))
    ref = reference_dequant(src)
    assert set(got) == set(ref)
    for name, want in ref.items():
        assert got[name].dtype == np.float32 and np.array_equal(got[name].view(np.uint32), want.view(np.uint32)), name
    refdir = write_reference_dir(src, root / "ds3-hf-ref")
    assert np.array_equal(_logits(out), _logits(refdir))


def test_to_hf_bf16_is_rne_and_loads(root):
    pytest.importorskip("transformers")
    import torch
    from safetensors.torch import load_file

    src = tiny_fp8(root, "qwen3_moe")
    out = convert(src, root / "q3-hf-bf16", type="BF16", format="hf").out
    got = {}
    for f in sorted(out.glob("*.safetensors")):
        got.update(load_file(str(f)))
    ref = reference_dequant(src)
    n_bf16 = 0
    for name, want in ref.items():
        if got[name].dtype == torch.bfloat16:
            n_bf16 += 1
            assert torch.equal(got[name].view(torch.int16), torch.from_numpy(want).to(torch.bfloat16).view(torch.int16)), name
        else:  # not FP8 in the input: copied as stored
            assert np.array_equal(got[name].numpy(), want), name
    assert n_bf16 == 56
    rounded = {n: (torch.from_numpy(w).to(torch.bfloat16).float().numpy() if got[n].dtype == torch.bfloat16 else w)
               for n, w in ref.items()}
    refdir = root / "q3-hf-ref"
    write_reference_dir(src, refdir)
    from safetensors.numpy import save_file

    save_file(rounded, str(refdir / "model.safetensors"))
    assert np.array_equal(_logits(out), _logits(refdir))


def test_to_hf_refuses_quant_types(root):
    from ktconvert.errors import UsageProblem

    with pytest.raises(UsageProblem, match="--to hf writes BF16, F16, F32"):
        plan_conversion(tiny_fp8(root, "qwen3_moe"), type="Q8_0", format="hf")


# --- verify -----------------------------------------------------------------------------------------------------------


def test_verify_runs_on_the_fp8_directory_as_its_dequantization(root, monkeypatch):
    """verify --weights FP8_DIR: the injected model runs on the exact dequantization, so every metric equals a run
    on the reference dequantization written as F32 (and the FP8 error against the original model's golden shows).
    Tensors are cloned after loading: torch's matmuls round differently on differently aligned buffers (a
    zero-copy slice of a shard vs a fresh array), which moved the last bits of the logits in an earlier run."""
    import ktconvert.model.ops.source as weights_source
    from convert_helpers import tiny
    from ktconvert.verify import run_verify

    read = weights_source.read_tensors
    monkeypatch.setattr(weights_source, "read_tensors", lambda p, report=None: {k: v.clone() for k, v in read(p).items()})
    family = "deepseek_v3"
    src = tiny_fp8(root, family)
    refdir = write_reference_dir(src, root / "ds3-verify-ref")
    rules = f"rules/optimize/{family}.yaml"
    runs = [run_verify(tiny(root, family), rules, f"golden/{family}", weights=w, profile="bf16").as_dict()
            for w in (src, refdir)]
    assert runs[0]["phases"] == runs[1]["phases"]
    assert 0 < runs[0]["phases"]["decode"]["logits"]["max_abs_diff"] < 1.0


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_fp8_files_match_the_recorded_sha256(family):
    import hashlib

    from ktconvert.golden.paths import load_tiny_hashes
    from ktconvert.model.tiny import tiny_fp8_files

    got = {name: hashlib.sha256(data).hexdigest() for name, data in tiny_fp8_files(family).items()}
    assert got == load_tiny_hashes()[f"{family}-fp8"]


def test_small_units_and_resume_give_the_same_bytes(root):
    """Units of a few rows (starting mid-block, ending in edge blocks) read their scale rows with them: a run under
    a tiny --max-memory, interrupted and resumed, writes the same bytes as one unit per tensor."""
    from convert_helpers import tree_bytes

    src = tiny_fp8(root, "deepseek_v3")
    whole = convert(src, root / "ds3-units-whole", type="Q8_0", max_memory="1GiB").out
    calls = []

    def stop_after_some(done, total):
        calls.append(done)
        if len(calls) == 40:
            raise KeyboardInterrupt

    out = root / "ds3-units-small"
    with pytest.raises(KeyboardInterrupt):
        convert(src, out, type="Q8_0", max_memory="96KiB", progress=stop_after_some)
    assert not out.exists()
    result = convert(src, out, type="Q8_0", max_memory="96KiB", resume=True)
    assert result.units_resumed > 0 and result.units > 100
    assert tree_bytes(out) == tree_bytes(whole)


def test_f16_scales(root, expected):
    """F16 scales (the third type releases use) dequantize exactly too."""
    def to_f16(t, d, c):
        for name in [n for n in t if n.endswith("_scale_inv")]:
            t[name], d[name] = t[name].astype(np.float16), "F16"

    src = rewrite(tiny_fp8(root, "deepseek_v3"), root / "ds3-f16-scales", to_f16)
    assert open_checkpoint(src)["model.layers.0.self_attn.o_proj.weight_scale_inv"].dtype == "F16"
    want = expected_gguf(write_reference_dir(src, root / "ref-f16-scales"), "deepseek_v3")
    out = convert(src, root / "ds3-f16-f32", type="F32").out / "model.gguf"
    for name, ref in want.items():
        assert np.array_equal(_gguf_float(out, name).view(np.uint32), ref.view(np.uint32)), name


def test_to_hf_keeps_the_mtp_layer_and_drops_every_scale(root):
    src = reshard_with_mtp(tiny_fp8(root, "deepseek_v3"), root / "ds3-hf-mtp-src", n_layers=3)
    out = convert(src, root / "ds3-hf-mtp", type="BF16", format="hf").out
    ck = open_checkpoint(out)
    assert not [n for n in ck if n.endswith("_scale_inv")]
    assert ck["model.layers.3.mlp.experts.0.gate_proj.weight"].dtype == "BF16"
    assert ck["model.layers.3.enorm.weight"].dtype == "F32"
    assert len(ck) == len([n for n in open_checkpoint(src) if not n.endswith("_scale_inv")])


def test_per_channel_fp8_beside_block_scales_is_read_per_row(root):
    """GLM-4.7-FP8's per-channel ``weight_scale`` [N, 1] is its own format (FP8_PERCHANNEL), read per row even in a
    checkpoint whose other weights are block-scaled; a ``weight_scale`` of another row count is refused, naming it."""
    from ktconvert.formats import quantized
    from ktconvert.io.dtypes import decode_float32

    name = "model.layers.0.self_attn.o_proj.weight"
    row_scale = None

    def per_channel(t, d, c):
        nonlocal row_scale
        t.pop(name + "_scale_inv")
        row_scale = np.linspace(0.5, 2.0, t[name].shape[0], dtype=np.float32).reshape(-1, 1)
        t[name + "_scale"], d[name + "_scale"] = row_scale, "F32"

    src = rewrite(tiny_fp8(root, "deepseek_v3"), root / "per-channel", per_channel)
    ck = open_checkpoint(src)
    w = quantized.require(ck).weights[name]
    assert w.fmt == "FP8_PERCHANNEL" and w.block == (1, ck[name].shape[1])
    want = decode_float32(np.asarray(ck.read(name)), "F8_E4M3") * row_scale
    assert np.array_equal(quantized.read_float32(ck, w), want)

    def misshapen(t, d, c):
        per_channel(t, d, c)
        t[name + "_scale"] = np.ones((t[name].shape[0] + 1, 1), np.float32)

    bad = rewrite(tiny_fp8(root, "deepseek_v3"), root / "per-channel-bad", misshapen)
    with pytest.raises(InputError, match="scale shape") as exc:
        plan_conversion(bad, type="F32")
    assert exc.value.where == f"tensor {name}_scale"


def test_cli_tiny_model_fp8_inspect_and_quantize_to_hf(tmp_path):
    from click.testing import CliRunner

    from ktconvert.cli import cli
    from ktconvert.golden.paths import load_tiny_hashes

    run = CliRunner()
    res = run.invoke(cli, ["tiny-model", "qwen3_moe", str(tmp_path / "m"), "--fp8", "-o", "json"], catch_exceptions=False)
    assert res.exit_code == 0 and json.loads(res.output)["sha256"] == load_tiny_hashes()["qwen3_moe-fp8"]
    res = run.invoke(cli, ["inspect", str(tmp_path / "m")], catch_exceptions=False)
    assert res.exit_code == 0 and "fp8 block-scaled  56 F8_E4M3 weight(s) with 56 _scale_inv scale(s) (BF16 56)" in res.output
    res = run.invoke(cli, ["quantize", str(tmp_path / "m"), str(tmp_path / "hf"), "--to", "hf", "--type", "F16"],
                     catch_exceptions=False)
    assert res.exit_code == 0, res.output
    ck = open_checkpoint(tmp_path / "hf")
    ref = reference_dequant(tmp_path / "m")
    for name in ("model.layers.1.mlp.experts.7.down_proj.weight", "model.layers.0.self_attn.k_proj.weight"):
        assert ck[name].dtype == "F16" and np.array_equal(np.asarray(ck.read(name)), ref[name].astype(np.float16))
    res = run.invoke(cli, ["tiny-model", "mixtral", str(tmp_path / "x"), "--fp8"])
    assert res.exit_code == 2 and "no FP8 variant" in res.output + (res.stderr or "")
