"""This process's glibc heap policy, set in one place: how large a freed block must be to go back to the kernel.

Two policies, for two kinds of work:

* :func:`keep_freed_memory` (a conversion): a unit allocates and frees the same few large arrays (a float32 copy
  of its rows, the quantizer's temporaries, its output bytes) and the next unit wants them again. glibc's
  defaults hand each back to the kernel when it is freed (``munmap`` above the mmap threshold, ``brk`` trimming
  at the top of the heap), so the next unit page-faults and zeroes the same memory again: measured, that was
  half the system time of a kt-amx conversion (docs/measurements.md). Keeping it costs nothing in peak resident
  size, which the largest unit sets either way.
* :func:`return_freed_memory` (a streamed model run): dropped parts must leave the process, so every block of
  128 KiB or more gets memory of its own and returns it when freed. By default glibc raises its mmap threshold
  after large frees (up to 32 MiB), so later parts come from the heap, which fragments and keeps its peak: a
  streamed run of a 400 MB model under a 16 MiB budget grew by 146 MiB that way, by 23 MiB with a fixed
  threshold (tests/test_executor.py's RSS test).

Off glibc (musl, macOS) both do nothing but return ``False``: only speed or the peak differs there.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3  # fixing it also stops glibc's dynamic raise

#: above every unit's arrays (units are capped at 256 MiB of working set: convert.execute.UNIT_CAP)
KEEP_MMAP_THRESHOLD = 512 * 1024**2
KEEP_TRIM_THRESHOLD = 1024**3
KEEP_TOP_PAD = 64 * 1024**2
#: tensors at least this large get memory of their own from the OS, returned when freed
RETURN_MMAP_THRESHOLD = 128 * 1024

_POLICY: list[str | None] = [None]


def _mallopt(settings: tuple[tuple[int, int], ...]) -> bool:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return all(mallopt(k, v) == 1 for k, v in settings)


def _set(policy: str, settings: tuple[tuple[int, int], ...]) -> bool:
    if _POLICY[0] == policy:
        return True
    ok = _mallopt(settings)
    _POLICY[0] = policy if ok else None
    return ok


def keep_freed_memory() -> bool:
    """The conversion policy (see the module docstring); idempotent and cheap to call per unit."""
    return _set("keep", ((_M_MMAP_THRESHOLD, KEEP_MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, KEEP_TRIM_THRESHOLD),
                         (_M_TOP_PAD, KEEP_TOP_PAD)))


def return_freed_memory() -> bool:
    """The streamed-model policy (see the module docstring); idempotent."""
    return _set("return", ((_M_MMAP_THRESHOLD, RETURN_MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, 128 * 1024),
                           (_M_TOP_PAD, 0)))
