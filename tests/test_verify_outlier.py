"""The expert that stands out (``localization.outlier``): the routed expert whose NMSE is the most times its own
layer's median, over at least four experts. It names one broken expert even where the quantization's error
elsewhere also breaks the limits (the DeepSeek-shaped AMXINT4 run of benchmarks/bench_verify_scale.py: the first
layer over the hidden-state limit is a later one, and that layer's worst expert is only quantization noise)."""

from __future__ import annotations

import math

from ktconvert.verify.runner import _outlier


def _rows(*nmse, tokens=3):
    return [{"expert": e, "tokens": tokens, "nmse": v} for e, v in enumerate(nmse)]


def test_a_broken_expert_stands_out_even_when_a_later_layer_is_worse_overall():
    experts = {"layer 1": _rows(0.05, 0.21, 0.047, 0.047, 0.05, 0.058),  # expert 1: gate and up swapped
               "layer 2": _rows(0.066, 0.048, 0.049, 0.035, 0.065, 0.05)}  # larger errors, none standing out
    got = _outlier(experts, 3.0)
    assert got["layer"] == "layer 1" and got["expert"] == 1 and got["tokens"] == 3
    assert math.isclose(got["median"], 0.05) and math.isclose(got["ratio"], 0.21 / 0.05)


def test_quantization_noise_alone_names_no_expert():
    experts = {"layer 1": _rows(0.056, 0.07, 0.047, 0.047, 0.05, 0.059, 0.061),
               "layer 2": _rows(0.048, 0.049, 0.035, 0.066, 0.05, 0.051)}
    assert _outlier(experts, 3.0) is None


def test_too_few_peers_make_no_median():
    assert _outlier({"layer 1": _rows(0.01, 0.01, 5.0)}, 3.0) is None


def test_an_exact_layer_names_its_one_wrong_expert_with_no_ratio():
    """F32 experts: every other expert's error is 0, so the median is 0 and the ratio has no finite value."""
    got = _outlier({"layer 0": _rows(0.0, 0.0, 0.4, 0.0, 0.0)}, 3.0)
    assert got["expert"] == 2 and got["median"] == 0.0 and got["ratio"] is None


def test_non_finite_error_ranks_highest_and_ties_go_to_the_lower_layer_and_expert():
    experts = {"layer 1": _rows(0.01, 0.01, 0.01, 0.01, None), "layer 2": _rows(0.01, 0.01, 0.01, 0.01, None)}
    got = _outlier(experts, 3.0)
    assert got["layer"] == "layer 1" and got["expert"] == 4 and got["nmse"] is None
    tie = {"layer 1": _rows(0.01, 0.05, 0.05, 0.01, 0.01)}
    assert _outlier(tie, 3.0)["expert"] == 1


def test_the_profile_sets_the_factor(tmp_path):
    from ktconvert.verify.profile import DEFAULT_EXPERT_OUTLIER, load_profile

    experts = {"layer 1": _rows(0.01, 0.01, 0.025, 0.01, 0.01)}
    assert DEFAULT_EXPERT_OUTLIER == 3.0 and _outlier(experts, DEFAULT_EXPERT_OUTLIER) is None
    base = load_profile("q8_0")
    assert base.expert_outlier == DEFAULT_EXPERT_OUTLIER
    (tmp_path / "p.yaml").write_text(open(base.source).read() + "localization:\n  expert_outlier: 2\n")
    prof = load_profile(str(tmp_path / "p.yaml"))
    assert prof.expert_outlier == 2.0 and _outlier(experts, prof.expert_outlier)["expert"] == 2
