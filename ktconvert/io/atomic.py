"""Atomic output, the one way every command writes: a directory is built as a hidden sibling and renamed into
place only when complete, so nothing with the final name is ever partial; an existing output is replaced only
with ``--force``; an output is never written inside its input, nor an input inside the output that ``--force``
would delete. Small files are written durably (flushed and fsynced) so a crash cannot leave them torn."""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

from ktconvert.errors import EnvironmentProblem, UsageProblem

PARTIAL_SUFFIX = ".ktconvert-partial"


def partial_dir(out: Path) -> Path:
    """Where ``out`` is built before the rename (also what ``--resume`` continues)."""
    out = Path(out)
    return out.parent / f".{out.name}{PARTIAL_SUFFIX}"


def guard_output(out: Path, *, inputs: Iterable[Path] = (), force: bool = False) -> None:
    """Refuse to write inside an input, over an input, or over an existing non-empty output without ``force``.

    ``inputs`` are the input files and the directories that count as input (the checkpoint directory, the
    folder of a shard set): the output may not lie inside any of them, nor contain one."""
    out = Path(out)
    out_r = out.resolve()
    roots = {Path(p).resolve() for p in inputs}
    for r in sorted(roots):
        if out_r == r or r in out_r.parents:
            raise UsageProblem("the output would be written inside the input", path=str(out),
                               fix="choose an output directory outside the input")
    for r in sorted(roots):
        if out_r in r.parents:
            raise UsageProblem("the input lies inside the output directory, which --force would delete",
                               path=str(out), fix="choose another output directory")
    if out.exists() and not out.is_dir():
        raise UsageProblem("output exists and is not a directory", path=str(out), fix="choose another output path")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise UsageProblem("output already exists", path=str(out), fix="pass --force to replace it, or choose a new name")


def write_durable(path: Path, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in ``path`` durable (best effort: some filesystems refuse)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def sha256_file(path: Path, chunk: int = 16 * 1024**2) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for b in iter(lambda: fh.read(chunk), b""):
            h.update(b)
    return h.hexdigest()


def replace_dir(partial: Path, out: Path, *, force: bool) -> None:
    """Rename the complete ``partial`` to ``out``; an existing ``out`` is moved aside first and removed after, so
    at every instant ``out`` is either the old output or the new one."""
    old = None
    if out.exists():
        if out.is_dir() and any(out.iterdir()) and not force:
            raise UsageProblem("output appeared while writing", path=str(out), fix="pass --force to replace it")
        old = out.parent / f".{out.name}.ktconvert-old"
        if old.exists():
            shutil.rmtree(old)
        os.replace(out, old)
    os.replace(partial, out)
    fsync_dir(out.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


#: errno values that mean "the destination cannot take the output" (not: the input is bad).
WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG)


def write_failure(exc: OSError, out: Path, *, resumable: bool = False) -> EnvironmentProblem:
    """The one-line error for an output that cannot be written (disk full, read-only, not permitted), naming OUT
    and what to do; ``resumable``: the finished part was kept for ``--resume``."""
    again = "rerun with --resume (the finished part is kept)" if resumable else "rerun"
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        fix = f"free space on the disk holding it, or choose an OUT on another disk, then {again}"
    elif exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        fix = "choose an OUT in a directory you can write to (this one is read-only or not yours)"
    else:
        fix = f"check the destination, then {again}"
    return EnvironmentProblem(f"cannot write the output: {exc.strerror or exc}", path=str(out), fix=fix)


@contextmanager
def atomic_dir(out: Path, *, force: bool = False) -> Iterator[Path]:
    """Yield an empty hidden sibling of ``out`` to fill; on success it becomes ``out``, on any error (or
    interrupt) it is removed and ``out`` is untouched."""
    out = Path(out)
    tmp = partial_dir(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    except OSError as exc:
        if exc.errno in WRITE_ERRNOS:
            raise write_failure(exc, out) from None
        raise
    try:
        yield tmp
        fsync_dir(tmp)
        replace_dir(tmp, out, force=force)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError) and exc.errno in WRITE_ERRNOS:
            raise write_failure(exc, out) from None
        raise


def replace_files(directory: Path, files: dict[str, bytes]) -> None:
    """Write ``files`` into an existing ``directory``, each under a temporary name renamed when all are
    written: a reader sees every file old or new, never torn."""
    directory.mkdir(parents=True, exist_ok=True)
    tmps = {name: directory / f".{name}{PARTIAL_SUFFIX}" for name in files}
    try:
        for name, data in files.items():
            write_durable(tmps[name], data)
        for name in files:
            os.replace(tmps[name], directory / name)
        fsync_dir(directory)
    finally:
        for p in tmps.values():
            if p.exists():
                p.unlink()
