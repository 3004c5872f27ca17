"""A unit's bytes reach its file whole: the arrays of a kt-amx group go out in one pwritev, end to end, and a
write the kernel cuts short (any buffer, anywhere) is continued where it stopped."""

from __future__ import annotations

import os

import numpy as np

from ktconvert.convert import worker


def test_pwrite_lays_arrays_end_to_end_through_short_writes(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    parts = [rng.integers(0, 256, n, dtype=np.uint8) for n in (7, 0, 33, 1, 64)]
    parts.append(rng.standard_normal(5).astype(np.float32))
    want = b"".join(p.tobytes() for p in parts)
    path = tmp_path / "out.bin"
    path.write_bytes(b"\xee" * (len(want) + 20))
    real, calls = os.pwritev, []

    def short(fd, bufs, offset):  # the kernel may write less than asked: at most 5 bytes a call here
        calls.append(len(bufs))
        left, cut = 5, []
        for b in bufs:
            cut.append(b[:left])
            left -= len(cut[-1])
        return real(fd, cut, offset)

    monkeypatch.setattr(os, "pwritev", short)
    try:
        worker._pwrite(str(path), parts, 10)
        worker._pwrite(str(path), np.frombuffer(b"xy", np.uint8), 0)
    finally:
        worker.close_all()
    data = path.read_bytes()
    assert data[:2] == b"xy" and data[2:10] == b"\xee" * 8
    assert data[10:10 + len(want)] == want and data[10 + len(want):] == b"\xee" * 10
    assert len(calls) >= len(want) // 5 and max(calls) > 1  # several buffers per call, continued after each cut
