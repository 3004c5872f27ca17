"""A fast 64-bit checksum (numba) for the resume journal's record of each unit's input bytes.

Why not sha256: the journal's digest only has to notice that an input byte changed between an interrupted run
and its resume (a file rewritten in place with its size and mtime kept); nobody forges it. sha256 runs at about
1-1.5 GB/s per core here, slower than the kt-amx packer and the page cache, so hashing every input byte with it
cost more CPU than converting them. This checksum runs at memory speed: eight independent lanes over 64-byte
blocks, each word folded in with two 64-bit multiplies and a rotation (so every bit of a word reaches every
bit of its lane, and a changed word always changes its lane: each step is a bijection of the lane for a fixed
word and of the word for a fixed lane), the lanes and the length mixed at the end. Written from that
description, little-endian words (the byte order of every platform ktconvert runs on).

Streaming gives the same value however the bytes are cut into ``update`` calls.
"""

from __future__ import annotations

import numpy as np

from ._jit import _njit

_P1 = np.uint64(0x9E3779B185EBCA87)
_P2 = np.uint64(0xC2B2AE3D27D4EB4F)
_P3 = np.uint64(0x165667B19E3779F9)
_R31, _R33 = np.uint64(31), np.uint64(33)
_LANES = 8
_BLOCK = 8 * _LANES  # bytes per block


@_njit(nogil=True, error_model="numpy", fastmath=False, boundscheck=False)
def _blocks(words, acc):
    """Fold ``words`` (uint64, a multiple of 8 of them) into the eight lanes ``acc``."""
    a0, a1, a2, a3, a4, a5, a6, a7 = acc[0], acc[1], acc[2], acc[3], acc[4], acc[5], acc[6], acc[7]
    for i in range(0, words.size, 8):
        x = a0 + words[i] * _P2
        a0 = ((x << _R31) | (x >> _R33)) * _P1
        x = a1 + words[i + 1] * _P2
        a1 = ((x << _R31) | (x >> _R33)) * _P1
        x = a2 + words[i + 2] * _P2
        a2 = ((x << _R31) | (x >> _R33)) * _P1
        x = a3 + words[i + 3] * _P2
        a3 = ((x << _R31) | (x >> _R33)) * _P1
        x = a4 + words[i + 4] * _P2
        a4 = ((x << _R31) | (x >> _R33)) * _P1
        x = a5 + words[i + 5] * _P2
        a5 = ((x << _R31) | (x >> _R33)) * _P1
        x = a6 + words[i + 6] * _P2
        a6 = ((x << _R31) | (x >> _R33)) * _P1
        x = a7 + words[i + 7] * _P2
        a7 = ((x << _R31) | (x >> _R33)) * _P1
    acc[0], acc[1], acc[2], acc[3], acc[4], acc[5], acc[6], acc[7] = a0, a1, a2, a3, a4, a5, a6, a7


def _mix(h: int) -> int:
    m = (1 << 64) - 1
    h ^= h >> 33
    h = (h * int(_P2)) & m
    h ^= h >> 29
    h = (h * int(_P3)) & m
    return h ^ (h >> 32)


class Checksum:
    """``update(bytes-like)`` as often as needed, then ``hexdigest()``: 16 hex digits."""

    def __init__(self):
        self._acc = (np.arange(1, _LANES + 1, dtype=np.uint64) * _P3)
        self._tail = b""
        self._n = 0

    def update(self, data) -> None:
        b = memoryview(data).cast("B")
        self._n += len(b)
        if self._tail:
            take = min(len(b), _BLOCK - len(self._tail))
            self._tail += bytes(b[:take])
            b = b[take:]
            if len(self._tail) < _BLOCK:
                return
            _blocks(np.frombuffer(self._tail, dtype="<u8"), self._acc)
            self._tail = b""
        whole = len(b) // _BLOCK * _BLOCK
        if whole:
            words = np.frombuffer(b[:whole], dtype="<u8")
            if not words.flags.aligned:  # a view at an odd address: numba wants aligned words
                words = words.copy()
            _blocks(words, self._acc)
        self._tail = bytes(b[whole:])

    def hexdigest(self) -> str:
        acc = self._acc.copy()
        if self._tail:
            _blocks(np.frombuffer(self._tail.ljust(_BLOCK, b"\0"), dtype="<u8"), acc)
        m = (1 << 64) - 1
        h = (self._n * int(_P1)) & m
        for a in acc.tolist():
            h = (((h ^ _mix(a)) * int(_P1)) & m)
            h = ((h << 27) | (h >> 37)) & m
        return f"{_mix(h):016x}"
