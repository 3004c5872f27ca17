"""gpt-oss's MXFP4 release layout (``experts.{gate_up,down}_proj_{blocks,scales}``, :mod:`ktconvert.formats.
mxfp4_fused`) on the tiny release ``tiny-model gpt_oss --quant mxfp4``: recognised with its logical shapes, decoded
bit-exactly (against a decoding written here from the format's definition and against transformers 5.23's own
dequantization of the same files and against ggml's dequantization of llama.cpp's own MXFP4 conversion), converted
and verified, loaded by llama.cpp; malformed input refused in one line.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from click.testing import CliRunner

from fp8_helpers import rewrite
from transformers_helpers import transformers_523
from ktconvert.cli import cli
from ktconvert.errors import InputError
from ktconvert.formats import build_inspect_report, open_checkpoint, quantized
from ktconvert.io.resources import rules_dir
from numeric import assert_close

L1 = "model.layers.1.mlp.experts."
E, H, I = 8, 256, 256  # the tiny gpt_oss model


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    from ktconvert.model.tiny import write_tiny_model

    out = tmp_path_factory.mktemp("gpt_oss_mxfp4") / "release"
    write_tiny_model("gpt_oss", out, quant="mxfp4")
    return out


@pytest.fixture(scope="module")
def converted(release, tmp_path_factory):
    from ktconvert.convert import convert

    root = tmp_path_factory.mktemp("gpt_oss_mxfp4_q")
    return {t: convert(release, root / t, type=t).out / "model.gguf" for t in ("F32", "Q8_0")}


@pytest.fixture(scope="module")
def golden(release, tmp_path_factory):
    """transformers 5.23 run on the release (it dequantizes MXFP4 on the CPU)."""
    pytest.importorskip("transformers")
    from ktconvert.golden.generate import generate_golden

    out = tmp_path_factory.mktemp("gpt_oss_mxfp4_golden") / "golden"
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("CI", raising=False)  # goldens are refused under CI; this one is a test's own, never committed
        generate_golden(release, out)
    return out


def _stored(release) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(release / "model.safetensors"))


def _decode(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The format's definition, written out: two E2M1 codes per byte (low nibble first), times 2**(scale - 127)."""
    b = blocks.astype(np.int64)
    nib = np.stack([b & 15, b >> 4], axis=-1).reshape(*b.shape[:-1], 32)
    val = np.array([0, .5, 1, 1.5, 2, 3, 4, 6])[nib & 7] * np.where(nib & 8, -1.0, 1.0)
    val = val * 2.0 ** (scales.astype(np.int64) - 127)[..., None]
    return val.reshape(*b.shape[:-2], -1).astype(np.float32)  # [E, out, in]


def test_release_is_stored_as_gpt_oss_ships_it(release):
    t = _stored(release)
    assert t[L1 + "gate_up_proj_blocks"].dtype == np.uint8 and t[L1 + "gate_up_proj_blocks"].shape == (E, 2 * I, H // 32, 16)
    assert t[L1 + "gate_up_proj_scales"].dtype == np.uint8 and t[L1 + "gate_up_proj_scales"].shape == (E, 2 * I, H // 32)
    assert t[L1 + "down_proj_blocks"].shape == (E, H, I // 32, 16) and t[L1 + "down_proj_scales"].shape == (E, H, I // 32)
    assert t[L1 + "gate_up_proj_bias"].shape == (E, 2 * I) and t[L1 + "down_proj_bias"].shape == (E, H)
    assert L1 + "gate_up_proj" not in t and L1 + "down_proj" not in t
    qc = json.loads((release / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "mxfp4" and "lm_head" in qc["modules_to_not_convert"]


def test_inspect_names_the_format_and_logical_shapes_and_scan_is_clean(release):
    r = build_inspect_report(release, tensors=r"experts\.gate_up_proj", scan=True)
    assert r["problems"] == [] and r["scan"]["findings"] == []
    q = r["quantized"]["MXFP4_FUSED"]
    assert q["weights"] == 4 and q["groups"] == [32] and sorted(q["shapes"]) == [[E, H, I], [E, H, 2 * I]]
    ly = r["layers"][0]
    assert ly["layout"] == "hf-fused" and ly["orientation"] == "[E,H,2I]"
    t = {x["name"]: x for x in r["tensors"]}[L1 + "gate_up_proj"]
    assert t["numpy_shape"] == [E, H, 2 * I]  # logical, never the packed width
    assert t["quant"]["format"] == "MXFP4_FUSED" and t["quant"]["group"] == [1, 32]
    assert t["quant"]["companions"] == [L1 + "gate_up_proj_scales"]


def test_scan_flags_a_nan_scale_and_an_all_zero_expert(release, tmp_path):
    def edit(t, d, c):
        t[L1 + "down_proj_scales"] = t[L1 + "down_proj_scales"].copy()
        t[L1 + "down_proj_scales"][3, 7, 0] = 0xFF  # UE8M0's NaN
        t[L1 + "gate_up_proj_blocks"] = t[L1 + "gate_up_proj_blocks"].copy()
        t[L1 + "gate_up_proj_blocks"][4] = 0  # expert 4's gate and up decode to zeros
    r = build_inspect_report(rewrite(release, tmp_path / "nan", edit), scan=True)
    found = {(f["kind"], f["tensor"], f["expert"]) for f in r["scan"]["findings"]}
    assert ("scale-nan", L1 + "down_proj_scales", None) in found and ("nan", L1 + "down_proj", 3) in found
    assert ("all-zero", L1 + "gate_up_proj", 4) in found
    assert not any(e not in (3, 4, None) for _, _, e in found) and r["exit_code"] != 0


def test_decoding_streams_any_rows_and_matches_the_definition(release):
    ck = open_checkpoint(release)
    t = _stored(release)
    w = ck.packed[L1 + "gate_up_proj"]
    x = quantized.read_float32(ck, w)
    want = _decode(t[L1 + "gate_up_proj_blocks"], t[L1 + "gate_up_proj_scales"]).transpose(0, 2, 1)  # [E, H, 2I]
    assert x.shape == (E, H, 2 * I) and np.array_equal(x.view(np.uint32), want.view(np.uint32))
    flat = x.reshape(E * H, 2 * I)
    for r0, r1 in ((0, 1), (5, 70), (250, 700), (E * H - 3, E * H)):  # within and across experts, off the groups
        assert np.array_equal(quantized.read_rows(ck, w, r0, r1), flat[r0:r1])
    assert np.array_equal(quantized.read_cols(ck, w, 3, 1, 2 * I, 2), x[3][:, 1::2].T)  # expert 3's up rows
    assert np.array_equal(ck.read_float32(L1 + "down_proj", 2), quantized.read_float32(ck, ck.packed[L1 + "down_proj"])[2])


def test_f32_gguf_is_bit_exact_with_the_definition(release, converted):
    t = _stored(release)
    g = open_checkpoint(converted["F32"])
    for layer in (0, 1):
        p = f"model.layers.{layer}.mlp.experts."
        gu = _decode(t[p + "gate_up_proj_blocks"], t[p + "gate_up_proj_scales"])  # [E, 2I, H]: gate rows even
        down = _decode(t[p + "down_proj_blocks"], t[p + "down_proj_scales"])  # [E, H, I]
        for name, want in (("gate", gu[:, 0::2]), ("up", gu[:, 1::2]), ("down", down)):
            got = g.read_float32(f"blk.{layer}.ffn_{name}_exps.weight")
            assert np.array_equal(got.view(np.uint32), np.ascontiguousarray(want).view(np.uint32)), (layer, name)
        assert np.array_equal(g.read_float32(f"blk.{layer}.ffn_up_exps.bias"), t[p + "gate_up_proj_bias"][:, 1::2])


def test_to_hf_reads_the_release_and_kt_amx_is_refused(release, tmp_path):
    """``--to hf`` writes the decoding as transformers saves gpt-oss (fused, no quantization_config); ``--to
    kt-amx`` is refused before anything is written: kt-kernel's AMX methods compute silu(gate) * up, not gpt-oss'
    clamped SwiGLU."""
    runner = CliRunner()
    res = runner.invoke(cli, ["quantize", str(release), str(tmp_path / "hf"), "--to", "hf", "--type", "F32"])
    assert res.exit_code == 0, res.output
    src = open_checkpoint(release)
    x = quantized.read_float32(src, src.packed[L1 + "gate_up_proj"])
    hf = open_checkpoint(tmp_path / "hf")
    assert hf[L1 + "gate_up_proj"].dtype == "F32" and L1 + "gate_up_proj_blocks" not in hf
    assert np.array_equal(hf.read_float32(L1 + "gate_up_proj"), x)
    assert "quantization_config" not in json.loads((tmp_path / "hf" / "config.json").read_text())
    res = runner.invoke(cli, ["quantize", str(release), str(tmp_path / "kt"), "--to", "kt-amx", "--type", "AMXINT8",
                              "--threadpool-count", "1"])
    assert res.exit_code != 0 and "silu(gate) * up" in res.output and len(res.output.strip().splitlines()) == 1
    assert not (tmp_path / "kt").exists()


def test_transformers_dequantizes_the_release_to_our_decoding(release):
    transformers = transformers_523()
    import torch

    from ktconvert.model import from_pretrained
    from ktconvert.model.weights import read_tensors

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        hf = transformers.GptOssForCausalLM.from_pretrained(
            str(release), dtype=torch.float32, quantization_config=transformers.Mxfp4Config(dequantize=True)).eval()
        ours = read_tensors(release)
        for layer in (0, 1):
            ex = hf.model.layers[layer].mlp.experts
            for proj in ("gate_up_proj", "down_proj"):
                want = getattr(ex, proj).detach()
                assert want.dtype == torch.float32
                assert torch.equal(ours[f"model.layers.{layer}.mlp.experts.{proj}"], want), (layer, proj)
        ids = torch.tensor([[1, 5, 9, 200, 33, 7, 100, 400, 3, 9, 17, 250]])
        with torch.no_grad():
            a = hf(ids).logits
            b = from_pretrained(release).eval()(ids)
        b = getattr(b, "logits", b)
        assert_close(b, a, "logits")
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("weights", ["release", "F32", "Q8_0"])
def test_verify_passes_the_release_and_its_conversions_against_transformers_on_it(release, converted, golden,
                                                                                   weights):
    from ktconvert.verify import run_verify

    w = release if weights == "release" else converted[weights]
    report = run_verify(release, rules_dir() / "optimize" / "gpt_oss.yaml", golden, weights=w)
    assert report.profile.name == ("q8_0" if weights == "Q8_0" else "f32")
    assert report.passed, [b.line() for b in report.breaches]


@pytest.mark.interop
@pytest.mark.parametrize("qtype,profile_name", [("F32", "f32"), ("Q8_0", "q8_0")])
def test_llamacpp_runs_the_gguf_made_from_the_release(llama_built, release, converted, golden, tmp_path, qtype,
                                                      profile_name):
    import llamacpp_runner
    from ktconvert.golden import read_golden
    from ktconvert.verify.profile import evaluate, load_profile

    gold = read_golden(golden)
    ids = [int(i) for i in np.asarray(gold.input_ids).reshape(-1)]
    got, _ = llamacpp_runner.run(converted[qtype], ids, tmp_path)
    want = np.asarray(gold.logits, dtype=np.float32).reshape(len(ids), -1)
    profile = load_profile(profile_name).for_family("gpt_oss")
    stats = profile.compare(want, got).summary()
    assert evaluate(profile, "llama.cpp", stats, []) == [], stats


@pytest.mark.interop
def test_our_decoding_equals_llama_cpps_own_conversion_of_the_release(release, converted, tmp_path):
    """llama.cpp's converter repacks the release's blocks into its MXFP4 ggml type (gate/up split by row parity);
    ggml's dequantization of those is bit for bit our F32 GGUF."""
    import ggml_ref
    import llamacpp_convert
    from gguf import GGUFReader

    try:
        ref = ggml_ref.load()
        gguf = llamacpp_convert.convert(release, tmp_path / "llama.gguf")
    except ggml_ref.RefUnavailable as exc:
        if os.environ.get("CI"):
            pytest.fail(f"llama.cpp's converter and ggml's reference required under CI: {exc}")
        pytest.skip(str(exc))
    ours = open_checkpoint(converted["F32"])
    seen = 0
    for t in GGUFReader(gguf).tensors:
        if t.tensor_type.name != "MXFP4":
            continue
        x = ref.dequantize(np.asarray(t.data).reshape(-1), int(t.tensor_type)).reshape(ours[t.name].shape)
        assert np.array_equal(x.view(np.uint32), ours.read_float32(t.name).view(np.uint32)), t.name
        seen += 1
    assert seen == 6  # gate, up, down of both layers


CASES = {
    "scales missing": (lambda t, d: t.pop(L1 + "down_proj_scales"), L1 + "down_proj_blocks", "without their scales"),
    "scales misshapen": (lambda t, d: t.__setitem__(L1 + "gate_up_proj_scales", t[L1 + "gate_up_proj_scales"][:, :, :4].copy()),
                         L1 + "gate_up_proj_scales", "scales shape"),
    "stored twice": (lambda t, d: (t.__setitem__(L1 + "down_proj", np.zeros((E, I, H), np.float32)),
                                   d.__setitem__(L1 + "down_proj", "F32")), L1 + "down_proj", "stored twice"),
    "blocks misshapen": (lambda t, d: t.__setitem__(L1 + "down_proj_blocks",
                                                 t[L1 + "down_proj_blocks"].reshape(E, H, -1).copy()),
                         L1 + "down_proj_blocks", "blocks shape"),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_line_naming_the_tensor_and_nothing_is_written(release, tmp_path, case):
    edit, tensor, words = CASES[case]
    src = rewrite(release, tmp_path / "bad", lambda t, d, c: edit(t, d))
    with pytest.raises(InputError, match=words) as exc:
        quantized.require(open_checkpoint(src))
    assert exc.value.where == f"tensor {tensor}"
    out = tmp_path / "out"
    res = CliRunner().invoke(cli, ["quantize", str(src), str(out), "--type", "F32"])
    assert res.exit_code == 3 and tensor in res.output and len(res.output.strip().splitlines()) == 1, res.output
    assert not out.exists()
    assert not os.path.exists(str(out) + ".partial")
