"""Numeric comparison of candidate outputs with golden ones (numpy, float64 accumulation).

Conventions follow llama.cpp where it has one: NMSE is ``sum (a - b)^2 / sum a^2`` with ``a`` the reference
(test-backend-ops); KL divergence is golden || candidate over the full softmax (llama-perplexity truncates
the base distribution to log-probabilities above -16 because it stores them in 16 bits; goldens here are
float32, so nothing is dropped); percentiles interpolate linearly, as llama-perplexity's do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


def nmse(ref: np.ndarray, cand: np.ndarray) -> float:
    """``sum (ref - cand)^2 / sum ref^2``; ``inf`` when ``ref`` is all zero and they differ, 0 when both are."""
    a = np.asarray(ref, dtype=np.float64)
    b = np.asarray(cand, dtype=np.float64)
    num = float(np.sum((a - b) ** 2))
    den = float(np.sum(a * a))
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / den


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    m = np.max(x, axis=-1, keepdims=True)
    z = x - m
    return z - np.log(np.sum(np.exp(z), axis=-1, keepdims=True))


def first_nonfinite(x: np.ndarray) -> tuple[int, ...] | None:
    """Index of the first NaN/Inf in C order, or None."""
    bad = ~np.isfinite(x)
    if not bad.any():
        return None
    return tuple(int(i) for i in np.unravel_index(int(np.argmax(bad.reshape(-1))), x.shape))


@dataclass
class LogitStats:
    """Per-position comparison of logits ``[T, V]`` and its summary.

    Top-1 agreement is judged only at positions whose golden top-2 gap is clear of the noise the profile accepts
    (``near_tie`` marks the others, see :func:`tie_margins`): a correct conversion may flip a near-tie on another
    CPU, so counting it would let one rounding decide a verdict. ``top1`` keeps every position (the raw count)."""

    max_abs: np.ndarray  # [T]
    nmse: np.ndarray  # [T]
    kl: np.ndarray  # [T] KL(golden || candidate), nats
    top1: np.ndarray  # [T] bool
    topk_overlap: np.ndarray  # [T] |topk(golden) ∩ topk(candidate)| / k
    k: int
    gap: np.ndarray | None = None  # [T] golden top-1 minus top-2 logit
    margin: np.ndarray | None = None  # [T] the near-tie margin at each position (logit units)
    near_tie: np.ndarray | None = None  # [T] bool: gap < margin, set aside from the judged top-1

    def __post_init__(self):
        t = len(self.kl)
        if self.gap is None:
            self.gap = np.full(t, np.inf)
        if self.margin is None:
            self.margin = np.zeros(t)
        if self.near_tie is None:
            self.near_tie = np.zeros(t, dtype=bool)

    def summary(self) -> dict:
        t = len(self.kl)
        worst = int(np.nanargmax(self.max_abs)) if t and not np.all(np.isnan(self.max_abs)) else 0
        judged = ~self.near_tie
        judged_top1 = self.top1[judged]
        mismatches = np.flatnonzero(judged & ~self.top1)
        return {
            "positions": t,
            "max_abs_diff": _f(np.max(self.max_abs)) if t else 0.0,
            "max_abs_diff_position": worst,
            "nmse_max": _f(np.max(self.nmse)) if t else 0.0,
            "nmse_max_position": int(np.nanargmax(self.nmse)) if t and not np.all(np.isnan(self.nmse)) else 0,
            "kl_mean": _f(np.mean(self.kl)) if t else 0.0,
            "kl_p99": _f(np.percentile(self.kl, 99)) if t else 0.0,
            "kl_max": _f(np.max(self.kl)) if t else 0.0,
            "kl_max_position": int(np.nanargmax(self.kl)) if t and not np.all(np.isnan(self.kl)) else 0,
            "top1_agreement": _f(np.mean(judged_top1)) if judged_top1.size else 1.0,
            "top1_agreement_raw": _f(np.mean(self.top1)) if t else 1.0,
            "top1_positions_judged": int(judged.sum()),
            "top1_near_ties": [int(i) for i in np.flatnonzero(self.near_tie)],
            "top1_near_tie_flips": [int(i) for i in np.flatnonzero(self.near_tie & ~self.top1)],
            "top1_tie_margin_max": _f(np.max(self.margin)) if t else 0.0,
            "first_top1_mismatch": int(mismatches[0]) if mismatches.size else None,
            "topk": self.k,
            "topk_overlap_mean": _f(np.mean(self.topk_overlap)) if t else 1.0,
            "topk_overlap_min": _f(np.min(self.topk_overlap)) if t else 1.0,
        }

    def per_position(self) -> list[dict]:
        return [
            {"position": i, "max_abs_diff": _f(self.max_abs[i]), "nmse": _f(self.nmse[i]), "kl": _f(self.kl[i]),
             "top1": bool(self.top1[i]), "top2_gap": _f(self.gap[i]), "near_tie": bool(self.near_tie[i]),
             "topk_overlap": _f(self.topk_overlap[i])}
            for i in range(len(self.kl))
        ]


def tie_margins(golden: np.ndarray, nmse_limit: float | None, margin: float | None = None) -> np.ndarray:
    """The near-tie margin of each position of golden logits ``[T, V]``, in logit units.

    ``margin`` (a profile's ``top1_tie_margin``) is used as is. Otherwise it is derived from the profile's
    ``nmse_max`` limit: a candidate within it has ``rms(candidate - golden) <= sqrt(nmse_max) * rms(golden)`` at
    every position, and the top-2 gap moves by about that much, so a position whose gap is below
    ``sqrt(nmse_max) * rms(golden logits at that position)`` can flip under noise the profile accepts. No limit
    and no margin: nothing is set aside."""
    a = np.asarray(golden, dtype=np.float64)
    t = a.shape[0]
    if margin is not None:
        return np.full(t, float(margin))
    if nmse_limit is None:
        return np.zeros(t)
    return math.sqrt(float(nmse_limit)) * np.sqrt(np.mean(a * a, axis=-1))


def _f(x) -> float:
    return float(x)  # NaN/inf stay as they are here; the report renders them as null


def compare_logits(golden: np.ndarray, cand: np.ndarray, k: int, margins: np.ndarray | None = None) -> LogitStats:
    """Compare ``[T, V]`` logits position by position (NaN propagates into every metric of its position).

    ``margins`` (``[T]``, from :func:`tie_margins`): positions whose golden top-2 gap is below it are near-ties,
    set aside from the judged top-1 agreement (a non-finite candidate position is never set aside)."""
    a = np.asarray(golden, dtype=np.float64)
    b = np.asarray(cand, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"logits shapes differ: golden {a.shape}, candidate {b.shape}")
    k = max(1, min(int(k), a.shape[-1]))
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.abs(a - b)
        max_abs = diff.max(axis=-1)
        num = np.sum(diff * diff, axis=-1)
        den = np.sum(a * a, axis=-1)
        nm = np.where(den > 0, num / np.where(den > 0, den, 1.0), np.where(num > 0, np.inf, 0.0))
        lp, lq = log_softmax(a), log_softmax(b)
        kl = np.sum(np.exp(lp) * (lp - lq), axis=-1)
    finite = np.isfinite(b).all(axis=-1)
    kl = np.where(finite, np.maximum(kl, 0.0), np.nan)  # rounding can give -1e-17; NaN stays NaN
    top1 = (np.argmax(a, axis=-1) == np.argmax(b, axis=-1)) & finite
    ta = np.argsort(-a, axis=-1, kind="stable")[:, :k]
    tb = np.argsort(-np.nan_to_num(b, nan=-np.inf), axis=-1, kind="stable")[:, :k]
    overlap = np.array([len(set(x.tolist()) & set(y.tolist())) / k for x, y in zip(ta, tb)])
    overlap = np.where(finite, overlap, 0.0)
    max_abs = np.where(finite, max_abs, np.nan)
    nm = np.where(finite, nm, np.nan)
    if a.shape[-1] >= 2:
        top2 = np.partition(a, a.shape[-1] - 2, axis=-1)[:, -2:]
        gap = top2[:, 1] - top2[:, 0]
    else:
        gap = np.full(a.shape[0], np.inf)
    margin = np.zeros(a.shape[0]) if margins is None else np.asarray(margins, dtype=np.float64)
    near_tie = (gap < margin) & finite
    return LogitStats(max_abs, nm, kl, top1, overlap, k, gap, margin, near_tie)


class Accumulator:
    """Running NMSE over many calls (numerator and denominator summed separately, so it equals the NMSE
    of the concatenated tensors)."""

    __slots__ = ("num", "den", "nonfinite")

    def __init__(self):
        self.num = 0.0
        self.den = 0.0
        self.nonfinite = False

    def add(self, ref: np.ndarray, cand: np.ndarray) -> None:
        a = np.asarray(ref, dtype=np.float64)
        b = np.asarray(cand, dtype=np.float64)
        if not np.isfinite(b).all():
            self.nonfinite = True
            return
        self.num += float(np.sum((a - b) ** 2))
        self.den += float(np.sum(a * a))

    @property
    def value(self) -> float:
        if self.nonfinite:
            return float("nan")
        if self.den == 0.0:
            return 0.0 if self.num == 0.0 else float("inf")
        return self.num / self.den
