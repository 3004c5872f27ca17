"""The suite's verdicts do not depend on how torch runs on this CPU.

The golden-vs-reference comparisons must give the same verdict whatever float32 path torch takes: one thread or
two (other blockings and summation orders), and with torch's deterministic algorithms on (other kernels where
torch has them). A bound that one of these flips would flip on the other kind of machine too (AMD Zen with
AVX-512 BF16/VNNI, or Intel Xeon with AMX), so this is the local proof that the suite is CPU-neutral.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from ktconvert.golden import golden_root, read_golden
from ktconvert.model import FAMILIES, from_pretrained
from numeric import bound, close, max_diff

SETTINGS = list(itertools.product((1, 2), (False, True)))  # (threads, deterministic algorithms)


def _run(model, ids, threads: int, deterministic: bool):
    threads_before, det_before = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(deterministic)
    try:
        with torch.no_grad():
            return model(ids)
    finally:
        torch.set_num_threads(threads_before)
        torch.use_deterministic_algorithms(det_before)


@pytest.mark.parametrize("family", FAMILIES)
def test_golden_verdicts_hold_under_every_thread_count_and_determinism(family, tiny_root):
    golden = read_golden(golden_root() / family)
    model = from_pretrained(tiny_root / family)
    ids = torch.from_numpy(golden.input_ids)
    verdicts, spread = {}, {}
    for threads, det in SETTINGS:
        out = _run(model, ids, threads, det)
        pairs = [("logits", out.logits, golden.logits)]
        pairs += [(f"hidden {i}", h, golden.hidden_states[i]) for i, h in enumerate(out.hidden_states)]
        verdicts[(threads, det)] = {name: close(got, want) for name, got, want in pairs}
        spread[(threads, det)] = {name: max_diff(got, want) / bound(want) for name, got, want in pairs}
    first = next(iter(verdicts.values()))
    assert all(v == first for v in verdicts.values()), verdicts
    assert all(first.values()), spread
    # and with room to spare: the worst comparison uses under half its bound under every setting
    worst = max(max(s.values()) for s in spread.values())
    assert worst < 0.5, spread


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_verify_verdict_and_near_ties_are_the_same_at_one_and_two_threads(family, tiny_root, tmp_path):
    from ktconvert.convert import convert
    from ktconvert.model.inject import EmulationOptions
    from ktconvert.io.resources import rules_dir
    from ktconvert.verify import run_verify

    gguf = convert(tiny_root / family, tmp_path / "q8", type="Q8_0").out / "model.gguf"
    reports = {}
    for threads in (1, 2):
        rep = run_verify(tiny_root / family, rules_dir() / "optimize" / f"{family}.yaml", golden_root() / family,
                         weights=gguf, profile="q8_0", options=EmulationOptions(), threads=threads)
        reports[threads] = rep
    one, two = reports[1], reports[2]
    assert one.passed and two.passed
    for name in ("prefill", "decode"):
        a, b = one.phase(name).logits.summary(), two.phase(name).logits.summary()
        assert a["top1_near_ties"] == b["top1_near_ties"]
        assert a["top1_agreement"] == b["top1_agreement"]
