"""What every reader checks before it reads: the path is a regular file (a device such as /dev/zero, a FIFO or
a socket would block or never end) of a size such a file can have."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ktconvert.errors import InputError


def regular_file_size(path: Path, what: str = "file", *, limit: int | None = None, fix: str | None = None) -> int:
    """The size of ``path``; an InputError if it is missing, not a regular file, or larger than ``limit``."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise InputError(f"{what} not found", path=str(path), fix=fix) from None
    except OSError as exc:
        raise InputError(f"cannot read {what}: {exc.strerror}", path=str(path), fix=fix) from None
    if stat.S_ISDIR(st.st_mode):
        raise InputError(f"{what} is a directory", path=str(path), fix=fix)
    if not stat.S_ISREG(st.st_mode):
        kind = ("a FIFO" if stat.S_ISFIFO(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode)
                else "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else "not a regular file")
        raise InputError(f"{what} is {kind}, not a regular file; refused unread", path=str(path),
                         fix=fix or "pass the file itself")
    if limit is not None and st.st_size > limit:
        raise InputError(f"{what} is {st.st_size / 1e6:.1f} MB, too large to be one (limit {limit / 1e6:.0f} MB)",
                         path=str(path), fix=fix)
    return st.st_size


def read_text(path: str | os.PathLike, what: str = "text file", *, limit: int = 16 * 1024**2,
              fix: str | None = None) -> str:
    """A UTF-8 text file (a prompt file, ...), or one InputError naming it: missing, not a regular file, larger than
    ``limit``, unreadable or not UTF-8 (with the byte where decoding fails)."""
    p = Path(path)
    regular_file_size(p, what, limit=limit, fix=fix)
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise InputError(f"cannot read {what}: {exc.strerror}", path=str(p), fix=fix) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{what} is not UTF-8 text (byte {exc.start})", path=str(p), fix=fix or "save it as UTF-8") from None
