"""kt-kernel's own release methods (MXFP4, MXFP8, RAWINT4, NVFP4, FP8_PERCHANNEL, GPTQ_INT4, FP8), each reading a tiny
release as released (kt-kernel's loader, in a child process), agree with a float32 MoE on ktconvert's exact
decoding of the same files within the method's own error; a wrong decoding would be off by ~1 (see
docs/commands/quantize.md, "Through kt-kernel"). A method with no kernel on this CPU is reported by the runner (KernelRefused), then skipped.

MXFP4 and MXFP8 are renamed to the names kt-kernel's loaders read (DeepSeek-V4 ``ffn.experts.N.w1``, MiniMax-M3
``block_sparse_moe.experts.N.w1``): the formats are name-independent on ktconvert's side."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fp8_helpers import rewrite
from kernel_helpers import batch, require_kernel
from ktconvert.formats import open_checkpoint, quantized
from ktconvert.kernel.runner import KernelRefused, KernelSession, bf16_bits_to_f32, f32_to_bf16_bits
from ktconvert.model.tiny import write_tiny_model

LAYER, E, K, H, I = 1, 8, 2, 256, 256
# method -> (tiny release, backend env, expert-name rewrite, upper bound of the relative error); the bounds are
# ~3x the errors measured on AMX hardware (docs/commands/quantize.md) and far below a wrong decoding's 0.84-1.47
CASES = {
    "MXFP4": ("mxfp4", {}, ("ffn.experts", {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}), 0.03),
    "MXFP8": ("mxfp8", {}, ("block_sparse_moe.experts", {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}),
              0.03),
    "RAWINT4": ("rawint4", {}, None, 0.05),
    "NVFP4": ("nvfp4", {"KT_MXFP4_BACKEND": "avx2"}, None, 0.03),
    "FP8_PERCHANNEL": ("fp8-perchannel", {}, None, 0.03),
    "GPTQ_INT4": ("gptq-int4", {}, None, 0.06),
    "FP8": ("fp8-128", {}, None, 0.03),  # DeepSeek-V3's block FP8: 128x128 blocks, F32 scale_inv
}


def _fp8_128(src, out):
    """The tiny model with its experts as a block-FP8 release of 128x128 blocks, the only block kt-kernel's FP8
    method reads (the tiny FP8 variants use odd blocks to exercise edge blocks)."""
    from ktconvert.formats import fp8

    def edit(t, d, c):
        for name in [n for n in t if ".mlp.experts." in n and n.endswith(".weight")]:
            x = t[name] if d[name] == "F32" else (t[name].astype(np.uint32) << 16).view(np.float32)
            codes, scale = fp8.quantize(np.asarray(x, np.float32), (128, 128), "F32")
            t[name], d[name] = codes, fp8.FP8_DTYPE
            t[name + fp8.SCALE_SUFFIX], d[name + fp8.SCALE_SUFFIX] = fp8.to_bits(scale, "F32"), "F32"
        c["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                    "weight_block_size": [128, 128]}
    return rewrite(src, out, edit)


def _renamed(src, out, prefix, projs):
    def edit(t, d, c):
        for name in [n for n in t if ".mlp.experts." in n]:
            head, tail = name.split(".mlp.experts.")
            e, proj, rest = tail.split(".", 2)
            new = f"{head}.{prefix}.{e}.{projs[proj]}.{rest}"
            t[new], d[new] = t.pop(name), d.pop(name)
    return rewrite(src, out, edit)


def _experts(ck, prefix, projs):
    qm = quantized.require(ck)
    names = {p: projs.get(f"{p}_proj", f"{p}_proj") for p in ("gate", "up", "down")}
    return {p: np.stack([quantized.read_float32(ck, qm.weights[f"model.layers.{LAYER}.{prefix}.{e}.{names[p]}.weight"])
                         for e in range(E)]) for p in names}


def _f32_moe(w, x, ids, rw):
    out = np.zeros_like(x, dtype=np.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j]
            g, u = w["gate"][e] @ x[t], w["up"][e] @ x[t]
            out[t] += rw[t, j] * (w["down"][e] @ (g / (1 + np.exp(-g)) * u))
    return out


@pytest.fixture(scope="module")
def kernel():
    return require_kernel()


@pytest.mark.parametrize("method", CASES)
def test_release_method_agrees_with_the_exact_decoding(kernel, method, tmp_path):
    fmt, env, rename, bound = CASES[method]
    src = tmp_path / fmt
    if fmt == "fp8-128":
        write_tiny_model("qwen3_moe", tmp_path / "bf16")
        src = _fp8_128(tmp_path / "bf16", src)
    else:
        write_tiny_model("qwen3_moe", src, quant=fmt)
    prefix, projs = "mlp.experts", {}
    if rename is not None:
        prefix, projs = rename
        src = _renamed(src, tmp_path / f"{fmt}-named", prefix, projs)
    w = _experts(open_checkpoint(src), prefix, projs)  # decoded here, before any kernel runs (in its own process)
    batches = [batch(tokens, H, E, K, seed) for tokens, seed in ((64, 0), (3, 1))]  # a batch and a decode step
    try:
        with KernelSession(method, env=env) as s:
            s.load_release_layer("l", src, LAYER, experts=E, top_k=K, hidden=H, inter=I)
            got = [bf16_bits_to_f32(s.forward("l", f32_to_bf16_bits(x), ids, rw)).astype(np.float64)
                   for x, ids, rw in batches]
    except KernelRefused as exc:
        pytest.skip(f"{method}: {exc}")
    errs = []
    for (x, ids, rw), y in zip(batches, got):
        ref = _f32_moe(w, bf16_bits_to_f32(f32_to_bf16_bits(x)).astype(np.float64), ids, rw)
        errs.append(np.linalg.norm(y - ref) / np.linalg.norm(ref))
    print(f"{method}: relative error {max(errs):.4f} (64 and 3 tokens: {errs[0]:.4f}, {errs[1]:.4f})")
    assert max(errs) < bound


def test_verify_kernel_reads_a_release_with_its_method_and_refuses_what_its_loader_cannot_find(kernel, tmp_path):
    import json

    from click.testing import CliRunner

    from ktconvert.cli import cli

    model, rel, mx = tmp_path / "model", tmp_path / "rawint4", tmp_path / "mxfp4"
    write_tiny_model("qwen3_moe", model)
    write_tiny_model("qwen3_moe", rel, quant="rawint4")
    write_tiny_model("qwen3_moe", mx, quant="mxfp4")
    repo = Path(__file__).resolve().parents[1]
    base = ["verify", "--model", str(model), "--rules", str(repo / "rules/optimize/qwen3_moe.yaml"), "--golden",
            str(repo / "golden/qwen3_moe"), "--kernel", "both", "-o", "json", "--weights"]
    r = CliRunner().invoke(cli, base + [str(rel)])
    assert r.exit_code in (0, 1), r.output  # 1: the release's own quantization error against the float golden
    layers = json.loads(r.output)["kernel"]["layers"]
    assert {x["method"] for x in layers} == {"RAWINT4"}
    assert all(0 < v < 0.05 for x in layers for v in x["agreement"].values())  # kernel vs its emulation
    r = CliRunner().invoke(cli, base + [str(mx)])
    assert r.exit_code == 2 and "DeepSeek-V4" in r.output, r.output
    # streamed, kt-kernel's release loaders would keep every layer (it frees none): one line, before anything runs
    r = CliRunner().invoke(cli, base + [str(rel), "--max-memory", "1GiB"])
    assert r.exit_code == 2 and json.loads(r.stdout)["error"]["code"] == "KernelRefused", r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "does not stream RAWINT4 releases yet" in lines[0], r.stderr


def test_verify_kernel_runs_a_block_fp8_release_through_fp8_and_refuses_other_blocks(kernel, tmp_path):
    import json

    from click.testing import CliRunner

    from ktconvert.cli import cli

    model, odd = tmp_path / "model", tmp_path / "fp8-96"
    write_tiny_model("qwen3_moe", model)
    rel = _fp8_128(model, tmp_path / "fp8-128")
    write_tiny_model("qwen3_moe", odd, fp8=True)  # the tiny FP8 variant: 96x96 blocks, edge blocks included
    repo = Path(__file__).resolve().parents[1]
    base = ["verify", "--model", str(model), "--rules", str(repo / "rules/optimize/qwen3_moe.yaml"), "--golden",
            str(repo / "golden/qwen3_moe"), "--kernel", "both", "-o", "json", "--weights"]
    r = CliRunner().invoke(cli, base + [str(rel)])
    assert r.exit_code in (0, 1), r.output
    layers = json.loads(r.output)["kernel"]["layers"]
    assert {x["method"] for x in layers} == {"FP8"}
    assert all(0 < v < 0.03 for x in layers for v in x["agreement"].values())  # kernel vs its emulation
    r = CliRunner().invoke(cli, base + [str(odd)])
    assert r.exit_code == 2 and "128x128" in r.output and "96x96" in r.output, r.output


def test_preflight_fp8_needs_128_blocks(tmp_path):
    from ktconvert.preflight import Launch, preflight

    model, odd = tmp_path / "model", tmp_path / "fp8-96"
    write_tiny_model("qwen3_moe", model)
    rel = _fp8_128(model, tmp_path / "fp8-128")
    write_tiny_model("qwen3_moe", odd, fp8=True)

    def run(path):
        r = preflight(Launch(model_path=str(path), weight_path=str(path), method="FP8", cpuinfer="2",
                             threadpools="1", gpu_experts="0"))
        return [(f.id, f.message, f.fix) for f in r.findings]

    assert run(rel) == []
    (pid, msg, fix), = run(odd)
    assert pid == "PF166" and "96x96" in msg and "128x128" in msg
