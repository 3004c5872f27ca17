"""Quantized release formats (MXFP4, MXFP8, RAWINT4, NVFP4, FP8 per-channel, GPTQ INT4): recognised from the
tensors, reported in logical terms, decoded exactly, converted bit-exactly, and refused with one line naming the
tensor when malformed. Tiny qwen3_moe releases (``tiny-model --quant``), one per format, shared by the module."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from fp8_helpers import rewrite
from ktconvert.cli import cli
from ktconvert.errors import InputError
from ktconvert.formats import build_inspect_report, open_checkpoint, quantized
from ktconvert.io.dtypes import decode_float32
from ktconvert.model.tiny import tiny_tensors, write_tiny_model
from ktconvert.model.tiny_release import FORMATS

FMT = {"mxfp4": "MXFP4", "mxfp8": "MXFP8", "rawint4": "RAWINT4", "nvfp4": "NVFP4", "fp8-perchannel": "FP8_PERCHANNEL",
       "gptq-int4": "GPTQ_INT4"}
GROUP = {"mxfp4": 32, "mxfp8": 32, "rawint4": 32, "nvfp4": 16, "fp8-perchannel": 256, "gptq-int4": 32}
# relative error of the encoders against the float32 tiny weights: a decoding error (nibbles swapped, offset
# missing, global scale dropped) lands far above these
ENCODE_ERROR = {"mxfp4": 0.12, "mxfp8": 0.04, "rawint4": 0.08, "nvfp4": 0.12, "fp8-perchannel": 0.04,
                "gptq-int4": 0.08}
W = "model.layers.1.mlp.experts.5.down_proj"


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    root = tmp_path_factory.mktemp("releases")
    out = {}
    for f in FORMATS:
        write_tiny_model("qwen3_moe", root / f, quant=f)
        out[f] = root / f
    return out


@pytest.mark.parametrize("fmt", FORMATS)
def test_inspect_names_the_format_scales_groups_and_logical_shapes(releases, fmt):
    r = build_inspect_report(releases[fmt], tensors=W.replace(".", r"\.") + r"\.", scan=True)
    assert r["problems"] == [] and r["scan"]["findings"] == []
    assert r["config"]["hidden_size"] == 256 and r["layers"][0]["layout"] == "hf-split"
    q = r["quantized"][FMT[fmt]]
    assert q["weights"] == (56 if fmt == "fp8-perchannel" else 48) and q["groups"] == [GROUP[fmt]]
    assert [256, 256] in q["shapes"] and all(s[1] == 256 for s in q["shapes"] if s[0] == 256)
    t = {x["name"]: x for x in r["tensors"]}[W + ".weight"]
    assert t["numpy_shape"] == [256, 256]  # logical [N, K], never the packed width
    assert t["quant"]["format"] == FMT[fmt] and t["quant"]["group"][1] == GROUP[fmt]
    ck = open_checkpoint(releases[fmt])
    assert all(c in ck for c in t["quant"]["companions"])
    assert not any(p["kind"] == "unknown-tensors" for p in r["problems"])


@pytest.mark.parametrize("fmt", FORMATS)
def test_decoding_streams_rows_and_matches_the_weights_it_encoded(releases, fmt):
    ck = open_checkpoint(releases[fmt])
    w = quantized.require(ck).weights[W + ".weight"]
    x = quantized.read_float32(ck, w)
    for r0, r1 in ((0, 1), (7, 40), (200, 256)):  # any row range reads the same values as the whole
        assert np.array_equal(quantized.read_rows(ck, w, r0, r1), x[r0:r1])
    ids = np.array([9, 3, 130, 4])
    assert np.array_equal(quantized.read_row_ids(ck, w, ids), x[ids])
    ref = tiny_tensors("qwen3_moe")[W + ".weight"]
    assert np.linalg.norm(x - ref) / np.linalg.norm(ref) < ENCODE_ERROR[fmt]


def test_decodings_by_hand_from_the_stored_bits(releases):
    """Each format's rule written out once more from its definition (not through ktconvert's decoders)."""
    def raw(fmt, suffix):
        ck = open_checkpoint(releases[fmt])
        return np.asarray(ck.read(f"{W}.{suffix}")), ck

    # MXFP4: low nibble first, E2M1 magnitude table, scale 2**(e - 127)
    codes, ck = raw("mxfp4", "weight")
    b = codes.view(np.uint8).astype(np.int64)
    nib = np.stack([b & 15, b >> 4], axis=-1).reshape(256, 256)
    mag = np.array([0, .5, 1, 1.5, 2, 3, 4, 6])[nib & 7] * np.where(nib & 8, -1.0, 1.0)
    e = np.asarray(ck.read(W + ".scale")).astype(np.int64)
    want = mag * np.repeat(2.0 ** (e - 127), 32, axis=1)
    got = quantized.read_float32(ck, ck.packed[W + ".weight"])
    assert np.array_equal(got, want.astype(np.float32))
    # RAWINT4: int32 words, 8 codes each from bit 0 up, stored +8
    words, ck = raw("rawint4", "weight_packed")
    u = words.astype(np.int64) & 0xFFFFFFFF
    q = np.stack([(u >> (4 * j)) & 15 for j in range(8)], axis=-1).reshape(256, 256) - 8
    s = decode_float32(np.asarray(ck.read(W + ".weight_scale")), "BF16").astype(np.float64)
    assert np.array_equal(quantized.read_float32(ck, ck.packed[W + ".weight"]), (q * np.repeat(s, 32, axis=1)).astype(np.float32))
    # GPTQ: qweight [K/8, N] packed along K; zero point stored minus one
    qw, ck = raw("gptq-int4", "qweight")
    u = qw.astype(np.int64) & 0xFFFFFFFF
    q = np.stack([(u >> (4 * j)) & 15 for j in range(8)], axis=1).reshape(256, 256)  # [K, N]
    z = np.asarray(ck.read(W + ".qzeros")).astype(np.int64) & 0xFFFFFFFF
    zero = np.stack([(z >> (4 * j)) & 15 for j in range(8)], axis=-1).reshape(z.shape[0], -1) + 1
    sc = np.asarray(ck.read(W + ".scales")).astype(np.float64)
    g = np.arange(256) // 32
    want = ((q - zero[g]) * sc[g]).T
    assert np.array_equal(quantized.read_float32(ck, ck.packed[W + ".weight"]), want.astype(np.float32))
    # NVFP4 (ModelOpt): fold e4m3 x scale_2 in float32 first, then times the code
    codes, ck = raw("nvfp4", "weight")
    b = codes.astype(np.int64)
    nib = np.stack([b & 15, b >> 4], axis=-1).reshape(256, 256)
    mag = (np.array([0, .5, 1, 1.5, 2, 3, 4, 6])[nib & 7] * np.where(nib & 8, -1.0, 1.0)).astype(np.float32)
    bs = decode_float32(np.asarray(ck.read(W + ".weight_scale")), "F8_E4M3")
    folded = bs * np.float32(np.asarray(ck.read(W + ".weight_scale_2")).reshape(-1)[0])
    assert np.array_equal(quantized.read_float32(ck, ck.packed[W + ".weight"]), mag * np.repeat(folded, 16, axis=1))


def test_e4m3_and_ue8m0_scales_agree_with_torch(releases):
    """The minifloat tables the FP8-family formats use equal torch's own float8 conversions."""
    torch = pytest.importorskip("torch")
    ck = open_checkpoint(releases["mxfp8"])
    s = np.asarray(ck.read(W + ".weight_scale_inv"))
    assert np.array_equal(decode_float32(s, "F8_E8M0"),
                          torch.from_numpy(s.copy()).view(torch.float8_e8m0fnu).float().numpy())
    c = np.asarray(ck.read(W + ".weight"))
    assert np.array_equal(decode_float32(c, "F8_E4M3"),
                          torch.from_numpy(c.copy()).view(torch.float8_e4m3fn).float().numpy())


def test_f32_conversion_is_bit_exact_and_bf16_q8_hf_and_kt_amx_read_every_format(releases, tmp_path):
    runner = CliRunner()
    for fmt in FORMATS:
        out = tmp_path / f"{fmt}-f32"
        res = runner.invoke(cli, ["quantize", str(releases[fmt]), str(out), "--type", "F32", "--to", "safetensors"])
        assert res.exit_code == 0, res.output
        src, got = open_checkpoint(releases[fmt]), open_checkpoint(out)
        qm = quantized.require(src)
        slab = got.read_float32("blk.1.ffn_down_exps.weight")
        for e in range(8):
            x = quantized.read_float32(src, qm.weights[f"model.layers.1.mlp.experts.{e}.down_proj.weight"])
            assert np.array_equal(slab[e].view(np.uint32), x.view(np.uint32)), (fmt, e)
    for fmt, args in (("nvfp4", ["--type", "Q8_0"]), ("rawint4", ["--type", "BF16", "--to", "hf"]),
                      ("gptq-int4", ["--type", "AMXINT8", "--to", "kt-amx", "--threadpool-count", "1"])):
        res = runner.invoke(cli, ["quantize", str(releases[fmt]), str(tmp_path / f"{fmt}-o"), *args])
        assert res.exit_code == 0, (fmt, res.output)
    from ktconvert.formats import kt_amx

    src = open_checkpoint(releases["gptq-int4"])
    x = quantized.read_float32(src, src.packed["model.layers.1.mlp.experts.3.gate_proj.weight"])
    y = kt_amx.scan_dequantized(open_checkpoint(tmp_path / "gptq-int4-o"), "blk.1.ffn_gate_exps.3.numa.0.weight")
    assert np.linalg.norm(y.reshape(x.shape) - x) / np.linalg.norm(x) < 0.01  # INT8 packing of the decoded values
    hf = open_checkpoint(tmp_path / "rawint4-o")
    assert hf[W + ".weight"].dtype == "BF16" and W + ".weight_scale" not in hf
    assert "quantization_config" not in json.loads((tmp_path / "rawint4-o" / "config.json").read_text())


def _bad(releases, tmp_path, fmt, edit, config_edit=None):
    def both(t, d, c):
        edit(t, d)
        if config_edit:
            config_edit(c)
    return rewrite(releases[fmt], tmp_path / f"bad-{fmt}", both)


CASES = {
    "scale missing": ("rawint4", lambda t, d: t.pop(W + ".weight_scale"), None, W + ".weight_packed", "no scale"),
    "scale misshapen": ("mxfp4", lambda t, d: t.__setitem__(W + ".scale", t[W + ".scale"][:, :4].copy()), None,
                        W + ".scale", "scale shape"),
    "group does not fit": ("gptq-int4", lambda t, d: t.__setitem__(W + ".scales", t[W + ".scales"][:3].copy()),
                           None, W + ".scales", "whole groups"),
    "weight_shape disagrees": ("rawint4", lambda t, d: t.__setitem__(W + ".weight_shape",
                                                                     np.array([256, 512], np.int32)), None,
                               W + ".weight_shape", "disagrees"),
    "global scale missing": ("nvfp4", lambda t, d: t.pop(W + ".weight_scale_2"), None, W + ".weight",
                             "per-tensor scale"),
    "declared group differs": ("rawint4", lambda t, d: None,
                               lambda c: c["quantization_config"]["config_groups"]["group_0"]["weights"].update(
                                   group_size=128), "model.layers.0.mlp.experts.0.down_proj.weight_scale",
                               "group size 128"),
    "mxfp8 scale misshapen": ("mxfp8", lambda t, d: t.__setitem__(W + ".weight_scale_inv",
                                                                  t[W + ".weight_scale_inv"][:, :7].copy()), None,
                              W + ".weight_scale_inv", "MXFP8 scale shape"),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_line_naming_the_tensor_and_nothing_is_written(releases, tmp_path, case):
    fmt, edit, cedit, tensor, words = CASES[case]
    src = _bad(releases, tmp_path, fmt, edit, cedit)
    with pytest.raises(InputError, match=words) as exc:
        quantized.require(open_checkpoint(src))
    assert exc.value.where == f"tensor {tensor}"
    out = tmp_path / "out"
    res = CliRunner().invoke(cli, ["quantize", str(src), str(out), "--type", "F32"])
    assert res.exit_code == 3 and tensor in res.output and len(res.output.strip().splitlines()) == 1
    assert not out.exists()
    r = build_inspect_report(src)
    assert any(tensor in p["message"] for p in r["problems"] if p["severity"] == "error")


def test_recognised_from_tensors_not_config(releases, tmp_path):
    """A release whose config lost its quantization_config is still recognised from its tensors."""
    src = rewrite(releases["mxfp8"], tmp_path / "noqc", lambda t, d, c: c.pop("quantization_config"))
    qm = quantized.require(open_checkpoint(src))
    assert {w.fmt for w in qm.weights.values()} == {"MXFP8"}


def test_cli_tiny_model_quant_writes_the_release(tmp_path):
    res = CliRunner().invoke(cli, ["tiny-model", "deepseek_v3", str(tmp_path / "m"), "--quant", "rawint4"])
    assert res.exit_code == 0, res.output
    ck = open_checkpoint(tmp_path / "m")
    assert ck["model.layers.1.mlp.experts.0.gate_proj.weight"].dtype == "RAWINT4"
    assert "model.layers.1.mlp.experts.0.gate_proj.weight_packed" not in ck  # presented as its logical weight
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["quantization_config"]["format"] == "pack-quantized"
    bad = CliRunner().invoke(cli, ["tiny-model", "deepseek_v3", str(tmp_path / "x"), "--quant", "rawint4", "--fp8"])
    assert bad.exit_code == 2


def test_preflight_accepts_a_release_under_its_method_and_names_the_right_one(releases):
    from ktconvert.preflight import Launch, preflight

    def run(fmt, method):
        r = preflight(Launch(model_path=str(releases[fmt]), weight_path=str(releases[fmt]), method=method,
                             cpuinfer="2", threadpools="1", gpu_experts="0"))
        return [(f.id, f.message, f.fix) for f in r.findings]

    for fmt, method in (("rawint4", "RAWINT4"), ("nvfp4", "NVFP4"), ("gptq-int4", "GPTQ_INT4"),
                        ("fp8-perchannel", "FP8_PERCHANNEL")):
        assert run(fmt, method) == [], fmt
    (pid, msg, fix), = run("rawint4", "NVFP4")
    assert pid == "PF164" and "these are RAWINT4" in msg and "--kt-method RAWINT4" in fix
    (pid, msg, fix), = run("mxfp8", "FP8")  # E4M3 with _scale_inv, but UE8M0 per 1x32: not the FP8 method's
    assert pid == "PF162" and "--kt-method MXFP8" in fix
    assert [f[0] for f in run("mxfp4", "AMXINT4")] == ["PF133"]  # a release is no kt-amx dir
    (pid, msg, fix), = run("mxfp4", "MXFP4")  # HF expert names: kt-kernel's MXFP4 loader finds none
    assert pid == "PF165" and "DeepSeek-V4" in msg


def test_scan_checks_packed_scales_and_all_zero_experts(releases, tmp_path):
    def zero_nan(t, d, c):
        t[W + ".scale"] = t[W + ".scale"].copy()
        t[W + ".scale"][0, :2] = 0xFF  # UE8M0's NaN
        other = "model.layers.0.mlp.experts.2.up_proj"
        t[other + ".scale"] = t[other + ".scale"].copy()
        t[other + ".scale"][3, 1] = 0  # 2**-127: tiny, not zero, a scale the format allows
        t["model.layers.0.mlp.experts.4.gate_proj.weight"] = np.zeros_like(t["model.layers.0.mlp.experts.4.gate_proj.weight"])

    src = rewrite(releases["mxfp4"], tmp_path / "scan", zero_nan)
    r = build_inspect_report(src, scan=True)
    found = {(f["kind"], f["tensor"], f["expert"]) for f in r["scan"]["findings"]}
    assert ("scale-nan", W + ".scale", 5) in found and ("nan", W + ".weight", 5) in found
    assert ("all-zero", "model.layers.0.mlp.experts.4.gate_proj.weight", 4) in found
    assert not any(t.startswith("model.layers.0.mlp.experts.2.") for _, t, _ in found)
    assert r["exit_code"] != 0


def test_nvfp4_compressed_tensors_spelling_divides_by_its_global_scale(releases, tmp_path):
    """compressed-tensors' NVFP4 (``weight_packed`` + ``weight_global_scale``, the reciprocal) decodes as
    ``e2m1 x fl32(e4m3 / global)``: the same codes as the ModelOpt release, its scale folded by division."""
    g = np.float32(3.0)

    def to_ct(t, d, c):
        for name in [n for n in t if n.endswith(".weight_scale_2")]:
            base = name[: -len("_scale_2")]
            t[base + "_packed"], d[base + "_packed"] = t.pop(base), d.pop(base)
            t.pop(name), d.pop(name)
            t[base + "_global_scale"], d[base + "_global_scale"] = np.array([g], np.float32), "F32"

    ct = open_checkpoint(rewrite(releases["nvfp4"], tmp_path / "ct", to_ct))
    mo = open_checkpoint(releases["nvfp4"])
    p = ct.packed[W + ".weight"]
    assert p.fmt == "NVFP4" and p.stored == W + ".weight_packed" and "weight_packed" not in "".join(ct)
    bs = decode_float32(np.asarray(ct.read(W + ".weight_scale")), "F8_E4M3")
    s2 = np.float32(np.asarray(mo.read(W + ".weight_scale_2")).reshape(-1)[0])
    values = quantized.read_float32(mo, mo.packed[W + ".weight"]) / np.repeat(bs * s2, 16, axis=1)  # the e2m1 codes
    assert np.array_equal(quantized.read_float32(ct, p), values * np.repeat(bs / g, 16, axis=1))


@pytest.fixture(scope="module")
def nvfp4_w4a4(tmp_path_factory):
    """The tiny NVFP4 release as ModelOpt writes it: an F32 ``input_scale`` beside every quantized expert weight."""
    from ktconvert.model.tiny_release import tiny_release_files

    d = tmp_path_factory.mktemp("nvfp4-w4a4") / "nvfp4"  # the name of the plain release: general.name alike
    d.mkdir()
    for name, data in tiny_release_files("qwen3_moe", "nvfp4", activation_scales=True).items():
        (d / name).write_bytes(data)
    return d


def test_nvfp4_activation_scales_are_read_with_their_weight(nvfp4_w4a4):
    ck = open_checkpoint(nvfp4_w4a4)
    assert ck[W + ".input_scale"].dtype == "F32"
    qm = quantized.require(ck)
    assert qm.scales[W + ".input_scale"] == W + ".weight"  # a companion of its weight, not an unknown tensor
    assert W + ".input_scale" in quantized.describe(qm.weights[W + ".weight"])["companions"]
    assert len(quantized.activation_scales(qm)) == 48
    r = build_inspect_report(nvfp4_w4a4)
    assert r["problems"] == [] or not any(p["kind"] == "unknown-tensors" for p in r["problems"])


@pytest.mark.parametrize("args, out_name", [
    (["--type", "Q8_0"], "model.gguf"),
    (["--type", "BF16", "--to", "hf"], None),
    (["--type", "AMXINT8", "--to", "kt-amx", "--threadpool-count", "1"], None),
])
def test_nvfp4_activation_scales_are_dropped_with_a_note_and_change_nothing_else(releases, nvfp4_w4a4, tmp_path,
                                                                                args, out_name):
    # the weights are exact without the activation scale; no output keeps NVFP4 weights, so none has a place for it
    runner = CliRunner()
    res = runner.invoke(cli, ["quantize", str(nvfp4_w4a4), str(tmp_path / "with"), *args])
    assert res.exit_code == 0, res.output
    plain = runner.invoke(cli, ["quantize", str(releases["nvfp4"]), str(tmp_path / "without"), *args])
    assert plain.exit_code == 0, plain.output
    got, want = open_checkpoint(tmp_path / "with"), open_checkpoint(tmp_path / "without")
    assert sorted(n for n, _ in got.items()) == sorted(n for n, _ in want.items())
    assert not any(n.endswith("input_scale") for n, _ in got.items())
    if out_name:
        assert (tmp_path / "with" / out_name).read_bytes() == (tmp_path / "without" / out_name).read_bytes()
    notes = json.loads((tmp_path / "with" / "manifest.json").read_text())["plan"]["notes"]
    said = [n for n in notes if "input_scale" in n]
    assert len(said) == 1 and "48 NVFP4 activation scale(s)" in said[0] and "not carried" in said[0], notes


def test_a_malformed_nvfp4_activation_scale_is_refused_naming_it(nvfp4_w4a4, tmp_path):
    src = rewrite(nvfp4_w4a4, tmp_path / "bad", lambda t, d, c: t.__setitem__(W + ".input_scale", np.ones(3, np.float32)))
    with pytest.raises(InputError, match="activation scale") as exc:
        quantized.require(open_checkpoint(src))
    assert exc.value.where == f"tensor {W}.input_scale"
