"""How close two float32 results must be when they come from different machines or different implementations.

A golden in ``golden/`` was made on one CPU; the suite runs on another (AMD Zen with AVX-512 BF16/VNNI, or Intel
Xeon with AMX). torch's float32 kernels take other paths on each (oneDNN / MKL blocking, AVX-512 vs AMX tiles,
summation order), and transformers' modules sum in other orders than ours, so the same computation lands a few
float32 ulps of its *magnitude* apart, not within a fixed absolute number: on Zen 5, glm5_next's logits (magnitude
3.7) moved by 1.27e-5 and minimax_m3_vl's layer-2 hidden state (magnitude 12.6) by 1.0e-5 from goldens made on an
Intel Xeon with AMX, while both stay within 4e-6 of their magnitude.

So every such comparison here bounds ``max |got - want|`` by ``rel * scale`` with ``scale`` the reference tensor's
largest magnitude, never less than 1.0: the models' activations are RMS-normalised to unit scale, and a tensor
that is small because large terms cancel carries the absolute rounding of those terms. ``REL`` = 1e-5 is about 84
float32 ulps at the scale (2**-23 = 1.19e-7), 2.5x the largest cross-CPU difference measured (3.4e-6 of the scale).
A test that needs more (rounding that accumulates over a longer computation) passes its own ``rel`` and says why.
"""

from __future__ import annotations

import numpy as np

REL = 1e-5


def _np(x) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor, without importing torch here
        x = x.detach().to("cpu").double().numpy()
    return np.asarray(x, dtype=np.float64)


def scale(want) -> float:
    """The magnitude a bound is relative to: the reference's largest |value|, at least 1.0."""
    w = _np(want)
    return max(1.0, float(np.max(np.abs(w)))) if w.size else 1.0


def bound(want, rel: float = REL) -> float:
    return rel * scale(want)


def max_diff(got, want) -> float:
    g, w = _np(got), _np(want)
    if g.shape != w.shape:
        raise AssertionError(f"shapes differ: {g.shape} vs {w.shape}")
    return float(np.max(np.abs(g - w))) if g.size else 0.0


def close(got, want, rel: float = REL) -> bool:
    """True when ``max |got - want| <= rel * scale(want)`` (NaN is never close)."""
    return max_diff(got, want) <= bound(want, rel)


def assert_close(got, want, what: str = "", rel: float = REL) -> None:
    d, b = max_diff(got, want), bound(want, rel)
    assert d <= b, f"{what + ': ' if what else ''}max |diff| {d:.4g} > {b:.4g} ({rel:g} x magnitude {scale(want):.4g})"


def assert_reproduces(tensors: dict, golden) -> None:
    """A run's golden tensors name the same entries as ``golden`` and each is close to its own (the bound above)."""
    assert set(tensors) == set(golden.tensors)
    for name, arr in tensors.items():
        assert_close(arr, golden.tensors[name], name)
