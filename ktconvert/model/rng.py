"""A frozen-stream random generator: the same bytes on every platform and every numpy version.

numpy's and torch's generators may change their streams between releases, so the tiny models draw from
splitmix64 (a fixed integer mix over a counter, wrapping modulo 2**64) and map the top 24 bits to floats
with a formula that is exact in float32. Only integer arithmetic and exactly-representable floats are
involved, so nothing depends on a library's rounding or vectorisation choices.
"""

from __future__ import annotations

import hashlib

import numpy as np

_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def stream_key(*parts: str | int) -> int:
    """A 64-bit key for a named stream: sha256 of the parts, so keys never collide by accident."""
    text = "\x1f".join(str(p) for p in parts).encode("utf-8")
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little")


def splitmix64(key: int, count: int, start: int = 0) -> np.ndarray:
    """``count`` uint64 values: element ``i`` is splitmix64's output for state ``key + (start + i + 1) * gamma``."""
    idx = np.arange(start + 1, start + count + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = np.uint64(key) + idx * _GAMMA
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        z = z ^ (z >> np.uint64(31))
    return z


def uniform_pm1(key: int, count: int) -> np.ndarray:
    """``count`` float64 values uniform in (-1, 1): ``(2k + 1) / 2**24 - 1`` for the top 24 bits ``k``.

    Every value is exactly representable in float32, so casting loses nothing.
    """
    k = (splitmix64(key, count) >> np.uint64(40)).astype(np.float64)
    return (2.0 * k + 1.0) * (2.0**-24) - 1.0


def randint(key: int, count: int, high: int) -> np.ndarray:
    """``count`` integers in ``[0, high)`` from the top 32 bits (multiply-shift, no modulo bias worth caring about)."""
    top = splitmix64(key, count) >> np.uint64(32)
    return ((top * np.uint64(high)) >> np.uint64(32)).astype(np.int64)


def permutation(key: int, n: int) -> list[int]:
    """A permutation of ``range(n)`` by Fisher-Yates over the stream (plain Python ints, no numpy shuffling)."""
    draws = [int(v) for v in (splitmix64(key, n) >> np.uint64(32))]
    perm = list(range(n))
    for i in range(n - 1, 0, -1):
        j = (draws[i] * (i + 1)) >> 32
        perm[i], perm[j] = perm[j], perm[i]
    return perm
