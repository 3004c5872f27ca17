"""Byte spans of tensor data inside one file: both header parsers refuse tensors whose data overlaps."""

from __future__ import annotations

from typing import Iterable

from ktconvert.errors import InputError


def check_overlaps(spans: Iterable[tuple[int, int, str]], path: str, fix: str) -> None:
    """``spans`` are ``(begin, end, tensor name)``; empty tensors are ignored."""
    ordered = sorted(s for s in spans if s[1] > s[0])
    for (b0, e0, n0), (b1, _e1, n1) in zip(ordered, ordered[1:]):
        if b1 < e0:
            raise InputError(f"data overlaps tensor {n0} (bytes {b0}..{e0})", path=path,
                             where=f"tensor {n1} @ byte {b1}", fix=fix)
