"""AMXINT8/AMXINT4 layers held as picked experts (``verify --kernel`` under ``--max-memory``): the child's object
holds ``C`` of the layer's ``E`` experts, and each forward reads only the experts its tokens pick, in groups of tokens
whose picks fit (docs/kt-kernel.md, "Memory").

* the forward is bit for bit the whole layer's, both methods, prefill (many tokens, several groups) and decode
  (one token), layer after layer through one reused object; a call whose picks the object holds reads nothing;
* the bytes the ``--max-memory`` plan counts are the capacity's, not the layer's: a DeepSeek-V3-shaped AMXINT4 layer
  (256 experts, H 7168, I 2048: 5.6 GB) fits a 4 GiB budget;
* the child's peak over a mid-size layer (E 64, H 1024, I 512) with a capacity of 4 grows by about 4 experts, not
  the layer.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from kernel_helpers import batch, require_kernel
from ktconvert.kernel import KernelRefused, KernelSession, f32_to_bf16_bits
from ktconvert.kernel.kttree import merge_kt_tree
from test_kernel_ktamx_load import _experts, _write_ktamx

GIB = 2**30


@pytest.mark.parametrize("method", ["AMXINT8", "AMXINT4"])
def test_picked_experts_forward_bit_for_bit_as_the_whole_layer(tmp_path, method):
    require_kernel()
    rng = np.random.default_rng(11)
    e, k, h, i, cap = 16, 2, 256, 256, 4
    calls = [batch(tokens=40, hidden=h, experts=e, k=k, seed=s) for s in (1, 2)]  # prefill: mat_mul in the whole
    calls += [batch(tokens=1, hidden=h, experts=e, k=k, seed=s) for s in (3, 4)]  # layer (40 > 4E/K), groups of
    tree, amx = tmp_path / "tree", tmp_path / "amx"                                # at most 2 tokens here
    with KernelSession(method, threadpools=2, threads=2) as s:
        for layer in range(2):
            s.quantize_ktamx_layer(tree, layer, *_experts(rng, e, h, i), top_k=k)
            s.unload(f"save{layer}")
        merge_kt_tree(tree, amx)
        for n, layer in enumerate([0, 1]):
            s.load_ktamx_layer(f"W{n}", amx, layer, experts=e, top_k=k, hidden=h, inter=i)
            s.load_ktamx_layer(f"P{n}", amx, layer, experts=e, top_k=k, hidden=h, inter=i, capacity=cap)
            before = s.expert_loads
            for x, ids, w in calls:
                want = s.forward(f"W{n}", f32_to_bf16_bits(x), ids, w)
                got = s.forward(f"P{n}", f32_to_bf16_bits(x), ids, w)
                assert np.array_equal(want, got), (method, layer, ids.shape)
            assert s.expert_loads - before >= 20  # a prefill call of 40 tokens needs 20 groups of 2 at least
            x, ids, w = calls[-1]
            before = s.expert_loads
            for again in (ids, ids[:, ::-1].copy()):  # the same picks again, in another order: nothing is read
                assert np.array_equal(s.forward(f"W{n}", f32_to_bf16_bits(x), again, w),
                                      s.forward(f"P{n}", f32_to_bf16_bits(x), again, w))
            assert s.expert_loads == before
            s.unload(f"W{n}")
            s.unload(f"P{n}")
        with pytest.raises(KernelRefused, match="capacity of 1 experts cannot hold one token's 2 picks"):
            s.load_ktamx_layer("bad", amx, 0, experts=e, top_k=k, hidden=h, inter=i, capacity=1)


def test_a_picked_layer_writes_the_files_of_the_experts_picked_only(tmp_path):
    """The kernel reads a picked slot's experts from the layer's ``.kt`` files: only the experts a forward picks get
    theirs written (a DeepSeek-V3-shaped AMXINT4 layer is 5.6 GB; before, the whole layer was written to the scratch
    folder at each load, 84% of the child's time in the benchmark's verify). The next layer of the slot starts
    over: an expert it picks is written from that layer, never read from the one before."""
    import re

    require_kernel()
    e, h, i, k, cap = 16, 256, 256, 2, 4
    amx = [tmp_path / f"amx{layer}" for layer in range(2)]
    for layer in range(2):
        _write_ktamx(amx[layer], layer, e, h, i, rng=np.random.default_rng(layer))
    x, _, w = batch(tokens=1, hidden=h, experts=e, k=k, seed=5)
    with KernelSession("AMXINT8") as s:
        def experts_on_disk():
            return {int(re.search(r"_(\d+)_\d+Byte_", f.name).group(1)) for f in s._dir.rglob("*.kt")}

        outs = []
        for layer, ids in ((0, [[3, 9]]), (1, [[9, 12]])):
            s.load_ktamx_layer(f"P{layer}", amx[layer], layer, experts=e, top_k=k, hidden=h, inter=i, capacity=cap)
            assert experts_on_disk() <= {3, 9}  # nothing new written at load
            picks = np.asarray(ids, dtype=np.int64)
            outs.append(s.forward(f"P{layer}", f32_to_bf16_bits(x), picks, w))
            s.unload(f"P{layer}")
        assert experts_on_disk() == {3, 9, 12}
        # expert 9 of layer 1 was written again for layer 1: the same output as layer 1 loaded whole
        s.load_ktamx_layer("W1", amx[1], 1, experts=e, top_k=k, hidden=h, inter=i)
        assert np.array_equal(outs[1], s.forward("W1", f32_to_bf16_bits(x), np.asarray([[9, 12]]), w))


def test_the_child_holds_the_capacity_not_the_layer(tmp_path):
    """A mid-size AMXINT8 layer (E 64, H 1024, I 512: 96.5 MiB) in a slot of 4 experts: the child's peak grows by
    about 4 experts and the kernel's activation buffers over a prefill and a decode, not by the layer."""
    require_kernel()
    e, h, i, cap = 64, 1024, 512, 4
    layer_bytes = _write_ktamx(tmp_path / "amx", 0, e, h, i, rng=np.random.default_rng(0))
    expert = layer_bytes // e
    x, ids, w = batch(tokens=32, hidden=h, experts=e)
    x1, ids1, w1 = batch(tokens=1, hidden=h, experts=e, seed=1)
    with KernelSession("AMXINT8") as s:
        base = s.memory()["hwm"]  # kt-kernel imported, nothing loaded
        s.load_ktamx_layer("L", tmp_path / "amx", 0, experts=e, top_k=2, hidden=h, inter=i, capacity=cap)
        s.forward("L", f32_to_bf16_bits(x), ids, w)
        s.forward("L", f32_to_bf16_bits(x1), ids1, w1)
        grew = s.memory()["hwm"] - base
        assert s.expert_loads >= 16  # 32 tokens of 2 picks in groups of at most 4 experts
    print(f"layer {layer_bytes / 2**20:.1f} MiB, {cap} experts {cap * expert / 2**20:.1f} MiB; child VmHWM grew "
          f"{grew / 2**20:.1f} MiB")
    assert grew < cap * expert + 12 * 2**20  # measured on this AMD EPYC: 15.7 MiB for 6.0 MiB of experts (the
    # whole layer grew it by 104.3 MiB: tests/test_kernel_ktamx_load.py)


def test_the_budget_counts_the_capacity_of_a_picked_layer(tmp_path):
    """A streamed verify (``--max-memory``) holds a kt-amx layer over 1 GiB as picked experts, and what the plan
    counts for the child is the capacity's experts. A DeepSeek-V3-shaped AMXINT4 layer (256 experts of I 2048, H 7168,
    top 8; its header over a sparse file) is 5.3 GiB whole; picked it fits a 4 GiB budget. A resident run, or a
    layer of at most 1 GiB (Qwen3-30B-A3B-shaped AMXINT8: 0.56 GiB), holds the whole layer."""
    from ktconvert.kernel.verify_op import KernelRuntime

    e, k, h, i = 256, 8, 7168, 2048
    layer_bytes = _write_ktamx(tmp_path / "ds", 0, e, h, i, sparse=True, bits=4)
    cfg = SimpleNamespace(num_experts=e, num_experts_per_tok=k, hidden_size=h,
                          mlp=SimpleNamespace(moe_intermediate_size=i))
    blocks = SimpleNamespace(layer=0)
    rt = KernelRuntime("kt-kernel", kt_weights=tmp_path / "ds", streamed=True)
    assert rt.auto_profile(cfg) == "kt-amxint4"
    cap = rt.capacity("AMXINT4", cfg, 0)
    held = rt._child_bytes("AMXINT4", blocks, None, cap)
    assert cap == 2 * k and held == layer_bytes // e * cap
    print(f"DeepSeek-V3-shaped AMXINT4 layer {layer_bytes / GIB:.2f} GiB; {cap} picked experts {held / GIB:.3f} GiB")
    assert held < 4 * GIB < layer_bytes
    resident = KernelRuntime("kt-kernel", kt_weights=tmp_path / "ds")
    assert resident.capacity("AMXINT4", cfg, 0) is None
    assert resident._child_bytes("AMXINT4", blocks, None, None) == layer_bytes
    qwen_bytes = _write_ktamx(tmp_path / "qwen", 0, 128, 2048, 768, sparse=True)
    qwen = SimpleNamespace(num_experts=128, num_experts_per_tok=8, hidden_size=2048,
                           mlp=SimpleNamespace(moe_intermediate_size=768))
    assert qwen_bytes < GIB
    assert KernelRuntime("kt-kernel", kt_weights=tmp_path / "qwen", streamed=True).capacity("AMXINT8", qwen, 0) is None
