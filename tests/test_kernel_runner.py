"""The kt-kernel runner: real kernel methods on tiny-model weights, in a child process, and every refusal.

Limits below are measured on this project's machines (AMD Zen 5 with the avx512_bf16 variant; Intel Xeon with
the amx variant writes and reads the same kt-amx bytes, docs/formats/kt-amx.md) with about 3x margin; the kernel's own
rounding makes it differ from the float32 MoE by ~0.012 (Q8_0), ~0.018 (Q4_K), ~0.0035 (BF16), ~0.018
(AMXINT8), ~0.14 (AMXINT4) on the tiny qwen3_moe layer.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from kernel_helpers import batch, emulated, f32_moe, rel, require_kernel
from ktconvert.kernel import (KernelCrashed, KernelRefused, KernelSession, KernelUnavailable, bf16_bits_to_f32,
                              f32_to_bf16_bits, shape_problems, type_problems)
from ktconvert.model import load_config
from ktconvert.model.ops.source import WeightSource


@pytest.fixture(scope="module")
def q3(tiny_root):
    return tiny_root / "qwen3_moe"


@pytest.fixture(scope="module")
def quantized(q3, tmp_path_factory):
    from ktconvert.convert import convert

    root = tmp_path_factory.mktemp("kq")
    out = {}
    for t in ("Q8_0", "Q4_K", "BF16", "Q4_1"):
        convert(q3, root / t, type=t)
        out[t] = root / t / "model.gguf"
    return out


def _bf16_experts(q3, layer):
    cfg = load_config(q3)
    b = WeightSource(q3, cfg).expert_blocks(layer)
    stack = {p: f32_to_bf16_bits(np.stack([getattr(b, p).expert(e) for e in range(cfg.num_experts)]))
             for p in ("gate", "up", "down")}
    return b, stack


def test_llamafile_runs_quantize_output_like_the_emulation(q3, quantized):
    """Kernel vs float32 MoE holds for any correct kernel; kernel vs emulation was measured on the avx512_bf16
    variant (AMD Zen 5) and is asserted there only: the amx variant (Intel with AMX) may take other LLAMAFILE
    code paths whose activation rounding has not been measured."""
    info = require_kernel()
    cfg = load_config(q3)
    x, ids, w = batch()
    # kernel vs ktconvert's emulation, and vs a float32 MoE on the stored weights (measured: see module doc)
    limits = {"Q8_0": (1e-5, 0.04), "Q4_K": (0.015, 0.06), "BF16": (0.003, 0.011)}
    for qtype, (to_emu, to_f32) in limits.items():
        src = WeightSource(quantized[qtype], cfg)
        with KernelSession("LLAMAFILE") as s:
            for layer in sorted(cfg.mlp.moe_layers):
                b = src.expert_blocks(layer)
                s.load_gguf_layer(f"L{layer}", b, cfg.num_experts_per_tok)
                out = bf16_bits_to_f32(s.forward(f"L{layer}", f32_to_bf16_bits(x), ids, w))
                if info["variant"] == "avx512_bf16":
                    assert rel(out, emulated(b, x, ids, w)) < to_emu, (qtype, layer)
                assert rel(out, f32_moe(b, x, ids, w)) < to_f32, (qtype, layer)
    assert "kt_kernel" not in sys.modules and "kt_kernel_ext" not in sys.modules


def test_bf16_method_on_hf_experts(q3):
    require_kernel()
    b, st = _bf16_experts(q3, 0)
    x, ids, w = batch(tokens=70)  # more than the kernel's 64-token buffer: the session splits the batch
    with KernelSession("BF16") as s:
        s.load_bf16_layer("L0", 0, st["gate"], st["up"], st["down"], 2)
        out = bf16_bits_to_f32(s.forward("L0", f32_to_bf16_bits(x), ids, w))
    assert out.shape == x.shape
    assert rel(out, f32_moe(b, x, ids, w)) < 0.011


def test_unloaded_layers_give_their_memory_back_and_reloads_compute_the_same(q3):
    """A streamed verify loads each layer's experts when its part starts and unloads them when it ends. kt-kernel's
    copying classes never free their weight buffers, so the child reuses one MoE object per shape: loading and
    unloading many layers keeps the child's RSS where one layer puts it, and a layer loaded into a reused object (its
    staging's pages given back after each load) computes exactly what a fresh one does."""
    require_kernel()
    rng = np.random.default_rng(3)
    e, h, i = 16, 1024, 512  # 48 MiB of bf16 experts: far above the noise of the child's RSS
    layers = [{p: f32_to_bf16_bits(rng.standard_normal(shape).astype(np.float32) * 0.05)
               for p, shape in (("gate", (e, i, h)), ("up", (e, i, h)), ("down", (e, h, i)))} for _ in range(2)]
    x, ids, w = batch(tokens=5, hidden=h, experts=e)
    per_layer = sum(a.nbytes for a in layers[0].values())
    with KernelSession("BF16") as s:
        fresh = []
        for n, lay in enumerate(layers):  # both resident, each in an object of its own
            s.load_bf16_layer(f"R{n}", n, lay["gate"], lay["up"], lay["down"], 2)
            fresh.append(s.forward(f"R{n}", f32_to_bf16_bits(x), ids, w))
        s.unload("R0")
        s.unload("R1")
        base = s.memory()["rss"]
        for rep in range(6):  # streamed: one layer at a time, alternating, through the freed objects
            n = rep % 2
            lay = layers[n]
            s.load_bf16_layer(f"S{rep}", n, lay["gate"], lay["up"], lay["down"], 2)
            assert np.array_equal(s.forward(f"S{rep}", f32_to_bf16_bits(x), ids, w), fresh[n]), rep
            after = s.unload(f"S{rep}")
        assert after["rss"] < base + per_layer // 4, (after, base, per_layer)
    assert not np.array_equal(fresh[0], fresh[1])


def test_amx_methods_on_a_ktamx_dir_the_kernel_wrote(q3, tmp_path):
    """kt-amx directories made by kt-kernel's own quantizer (the .kt tree merged to safetensors, as upstream's
    converter does), read back by name; a dir with one layer's gate parts swapped loads and gives garbage."""
    from safetensors.numpy import load_file, save_file

    from ktconvert.kernel.kttree import merge_kt_tree

    require_kernel()
    b, st = _bf16_experts(q3, 0)
    x, ids, w = batch()
    ref = f32_moe(b, x, ids, w)
    for method, limit in (("AMXINT8", 0.06), ("AMXINT4", 0.4)):
        tree, amx = tmp_path / f"tree-{method}", tmp_path / f"amx-{method}"
        with KernelSession(method, threadpools=2, threads=2) as s:
            s.quantize_ktamx_layer(tree, 0, st["gate"], st["up"], st["down"], 2)
        files = merge_kt_tree(tree, amx)
        with KernelSession(method, threadpools=2, threads=2) as s:
            s.load_ktamx_layer("L0", amx, 0, experts=8, top_k=2, hidden=256, inter=256)
            good = rel(bf16_bits_to_f32(s.forward("L0", f32_to_bf16_bits(x), ids, w)), ref)
        assert good < limit, method
        tensors = load_file(str(files[0]))
        for e in range(8):
            a, c = f"blk.0.ffn_gate_exps.{e}.numa.0.weight", f"blk.0.ffn_gate_exps.{e}.numa.1.weight"
            tensors[a], tensors[c] = tensors[c], tensors[a]
        swapped = tmp_path / f"swapped-{method}"
        swapped.mkdir()
        save_file(tensors, str(swapped / files[0].name))
        with KernelSession(method, threadpools=2, threads=2) as s:
            s.load_ktamx_layer("L0", swapped, 0, experts=8, top_k=2, hidden=256, inter=256)
            bad = rel(bf16_bits_to_f32(s.forward("L0", f32_to_bf16_bits(x), ids, w)), ref)
        assert bad > 0.5, (method, bad)


def test_llamafile_refuses_q4_1_before_loading_and_a_forced_load_is_one_clear_crash(q3, quantized):
    require_kernel()
    cfg = load_config(q3)
    b = WeightSource(quantized["Q4_1"], cfg).expert_blocks(0)
    with KernelSession("LLAMAFILE") as s:
        with pytest.raises(KernelRefused, match=r"LLAMAFILE cannot run layer 0: kt-kernel \S+ LLAMAFILE aborts .*Q4_1.*Q5_K"):
            s.load_gguf_layer("L0", b, 2)
        assert s._proc.poll() is None  # refused in this process: the child is untouched
        # what the refusal prevents: the same load sent anyway kills the child, reported as one error
        req = {"op": "load", "key": "x", "method": "LLAMAFILE", "E": 8, "top_k": 2, "H": 256, "I": 256, "layer": 0,
               "arrays": {p: s._save(getattr(b, p).data) for p in ("gate", "up", "down")},
               "types": {p: 3 for p in ("gate", "up", "down")}}
        x, ids, w = batch(tokens=1)  # a one-token (decode) forward aborts: "llamafile not supported"
        with pytest.raises(KernelCrashed, match=r"killed by SIGABRT while running layer 0 on 1 token"):
            s._call(req, "loading layer 0")
            s.loaded["x"] = {"layer": 0, "H": 256, "E": 8, "types": {}, "max_len": 64}
            s.forward("x", f32_to_bf16_bits(x), ids, w)


def test_refusals_are_pure_checks():
    assert shape_problems("LLAMAFILE", hidden=256, inter=384)[0].message.startswith("LLAMAFILE needs I % 256 == 0")
    assert "I / 256 >= threadpool count" in shape_problems("LLAMAFILE", hidden=256, inter=256, parts=2)[0].message
    assert shape_problems("LLAMAFILE", hidden=256, inter=512, parts=2) == []
    assert "(I / threadpools) % 64" in shape_problems("AMXINT8", hidden=256, inter=192, parts=2)[0].message
    assert "H % 128" in shape_problems("AMXINT4", hidden=192, inter=256)[0].message
    assert "I % threadpools" in shape_problems("AMXINT8", hidden=256, inter=256, parts=3)[0].message
    assert shape_problems("AMXINT4", hidden=256, inter=256, parts=2) == []
    assert "aborts" in type_problems("LLAMAFILE", {"gate": "Q5_1"})[0].message  # the measured table
    assert "computes wrong results on IQ4_XS" in type_problems("LLAMAFILE", {"gate": "IQ4_XS"})[0].message
    assert "has not been measured on Q8_K" in type_problems("LLAMAFILE", {"gate": "Q8_K"})[0].message
    assert "to Q4_0," in type_problems("LLAMAFILE", {"down": "IQ4_NL"}, {"down": 288})[0].fix  # rows of 288
    assert type_problems("LLAMAFILE", {"gate": "Q4_K", "up": "Q8_0", "down": "Q6_K"}) == []


def test_unknown_or_undriven_method_is_refused_without_a_child(monkeypatch):
    from ktconvert.kernel import methods

    with pytest.raises(KernelRefused, match="unknown kt-kernel method"):
        KernelSession("AMXINT3")
    # every method 0.7.2 has is driven now; a future one is refused until the runner drives it
    monkeypatch.setitem(methods.METHODS, "MOE_INT8", methods.Method("MOE_INT8", "a future format", "hf", ("X",), False))
    with pytest.raises(KernelRefused, match="not driven"):
        KernelSession("MOE_INT8")


def test_a_kt_kernel_that_cannot_be_imported_is_one_environment_error(tmp_path):
    (tmp_path / "kt_kernel.py").write_text("raise ImportError('no variant for this CPU')\n")
    import os

    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    with pytest.raises(KernelUnavailable, match="no variant for this CPU"):
        KernelSession("LLAMAFILE", env=env)


def test_probe_names_the_variant_of_this_cpu():
    """Each kind of CI machine has its own expectation: AMX CPUs select the amx variant, AVX-512 BF16 ones
    avx512_bf16 (kt-kernel's own selection; KT_KERNEL_CPU_VARIANT unset)."""
    from ktconvert.kernel.cpu import cpu_features

    info = require_kernel()
    feats = cpu_features()["features"]
    if "KT_KERNEL_CPU_VARIANT" in __import__("os").environ:
        pytest.skip("KT_KERNEL_CPU_VARIANT overrides the variant")
    if feats["amx_int8"] and feats["amx_tile"]:
        assert info["variant"] == "amx"
    elif feats["avx512_bf16"]:
        assert info["variant"] == "avx512_bf16"
    for m in ("LLAMAFILE", "AMXINT8", "AMXINT4", "BF16"):
        assert m in info["methods"]
    json.dumps(info)


def test_a_child_that_does_not_answer_is_killed_and_reported(tmp_path):
    import os

    (tmp_path / "kt_kernel.py").write_text("import time\ntime.sleep(60)\n")  # hangs at import
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    with pytest.raises(KernelCrashed, match="no answer within 2 s while starting kt-kernel"):
        KernelSession("LLAMAFILE", env=env, timeout=2)
