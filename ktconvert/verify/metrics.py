"""Numeric comparison of candidate outputs with golden ones (numpy, float64 accumulation).

Conventions follow llama.cpp where it has one: NMSE is ``sum (a - b)^2 / sum a^2`` with ``a`` the reference
(test-backend-ops); KL divergence is golden || candidate over the full softmax (llama-perplexity truncates
the base distribution to log-probabilities above -16 because it stores them in 16 bits; goldens here are
float32, so nothing is dropped); percentiles interpolate linearly, as llama-perplexity's do.
"""

from __future__ import annotations

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
    """Per-position comparison of logits ``[T, V]`` and its summary."""

    max_abs: np.ndarray  # [T]
    nmse: np.ndarray  # [T]
    kl: np.ndarray  # [T] KL(golden || candidate), nats
    top1: np.ndarray  # [T] bool
    topk_overlap: np.ndarray  # [T] |topk(golden) ∩ topk(candidate)| / k
    k: int

    def summary(self) -> dict:
        t = len(self.kl)
        worst = int(np.nanargmax(self.max_abs)) if t and not np.all(np.isnan(self.max_abs)) else 0
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
            "top1_agreement": _f(np.mean(self.top1)) if t else 1.0,
            "first_top1_mismatch": int(np.argmin(self.top1)) if t and not self.top1.all() else None,
            "topk": self.k,
            "topk_overlap_mean": _f(np.mean(self.topk_overlap)) if t else 1.0,
            "topk_overlap_min": _f(np.min(self.topk_overlap)) if t else 1.0,
        }

    def per_position(self) -> list[dict]:
        return [
            {"position": i, "max_abs_diff": _f(self.max_abs[i]), "nmse": _f(self.nmse[i]), "kl": _f(self.kl[i]),
             "top1": bool(self.top1[i]), "topk_overlap": _f(self.topk_overlap[i])}
            for i in range(len(self.kl))
        ]


def _f(x) -> float:
    return float(x)  # NaN/inf stay as they are here; the report renders them as null


def compare_logits(golden: np.ndarray, cand: np.ndarray, k: int) -> LogitStats:
    """Compare ``[T, V]`` logits position by position (NaN propagates into every metric of its position)."""
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
    return LogitStats(max_abs, nm, kl, top1, overlap, k)


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
