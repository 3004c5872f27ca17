"""Checks the family test files share: verify passes a family's F32 and Q8_0 conversions, and names the layer and
module of a conversion whose experts' gate and up are exchanged in one layer (what a de-interleaving or w1/w3 mix-up
does). The family files differ only in the layer, the module's name and the rule file."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from ktconvert.golden import golden_root


def assert_verify_passes(model: Path, rules: Path, family: str, weights: Path, qtype: str) -> None:
    from ktconvert.verify import run_verify

    report = run_verify(model, rules, golden_root() / family, weights=weights)
    assert report.profile.name == qtype.lower()
    assert report.passed, [b.line() for b in report.breaches]


def swap_gate_and_up(f32_gguf: Path, out: Path, layer: int) -> Path:
    """A copy of ``f32_gguf`` with layer ``layer``'s ffn_gate_exps and ffn_up_exps exchanged."""
    from gguf import GGUFReader

    shutil.copyfile(f32_gguf, out)
    reader = GGUFReader(out, "r+")
    t = {x.name: x for x in reader.tensors}
    gate, up = t[f"blk.{layer}.ffn_gate_exps.weight"].data, t[f"blk.{layer}.ffn_up_exps.weight"].data
    g = np.array(gate)
    gate[...] = up
    up[...] = g
    reader.data.flush()
    del reader
    return out


def assert_swap_localised(model: Path, rules: Path, family: str, f32_gguf: Path, tmp_path: Path, layer: int,
                          module: str) -> None:
    """verify fails on the swapped conversion and localises it, in both phases, to ``model.layers.LAYER.MODULE``
    (the layers before it within the profile, the module's error far above its input's)."""
    from ktconvert.verify import run_verify

    broken = swap_gate_and_up(f32_gguf, tmp_path / "broken.gguf", layer)
    report = run_verify(model, rules, golden_root() / family, weights=broken)
    assert not report.passed
    for phase in report.phases:
        loc = phase.localization
        assert loc["layer"] == f"layer {layer}" and loc["module"] == f"model.layers.{layer}.{module}", (phase.name, loc)
        assert loc["module_nmse_out"] > 10 * loc["module_nmse_in"]
        assert all(v <= report.profile.hidden_nmse for _, v in phase.layers[:layer + 1])
