"""Atomic output, the one way every command writes: a directory is built as a hidden sibling and renamed into
place only when complete, so nothing with the final name is ever partial; an existing output is replaced only
with ``--force``; an output is never written inside its input, nor an input inside the output that ``--force``
would delete. Small files are written durably (flushed and fsynced) so a crash cannot leave them torn. A run
holds OUT's lock from its first check to its last write (:func:`claim_output`), so two runs never share an OUT."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import socket
import sys
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Iterable, Iterator

from ktconvert.errors import EnvironmentProblem, UsageProblem
from ktconvert.io.files import ReadBuffer, pread_into, read_direct

PARTIAL_SUFFIX = ".ktconvert-partial"


# --- one lock per output ----------------------------------------------------------------------------------------
# A run that writes OUT holds an advisory ``flock`` on ``.OUT.ktconvert-lock`` beside it (in
# OUT's parent, never inside OUT or its partial directory, which workers on other nodes read and write) for the
# whole run. A second run on the same OUT (plain, ``--force`` or ``--resume``) is refused naming the holder.
#
# The lock is the kernel's: it goes with the holder's last file descriptor, so a holder killed by any means
# (``kill -9``, the OOM killer) releases it, and the next run takes over the file it left.
#
# The file always holds its holder's complete record (pid, host, command): a new holder writes its record into a
# private file, locks that, and only then puts it at the lock's name (``link`` when there is none, ``rename`` over
# a file whose lock nobody holds), so a refused run never reads a half-written or a dead holder's record. Every
# holder checks, once it has the lock, that the name still points at the file it locked (a releasing holder
# unlinks the name while it still holds the lock); if not, it tries again.

LOCK_SUFFIX = ".ktconvert-lock"
_ATTEMPTS = 100  # each lost race means another process took or released the lock in between: never many


def lock_path(out: Path) -> Path:
    """The lock file of the output ``out``: a hidden sibling, like the partial directory."""
    out = Path(os.path.abspath(out))
    return out.parent / f".{out.name}{LOCK_SUFFIX}"


class OutputBusy(EnvironmentProblem):
    """Another live run holds OUT's lock (exit 3: the command is right, the environment is busy; the same command
    succeeds once the other run ends, which ``--force`` cannot change)."""

    def __init__(self, out: Path, holder: dict | None, lock: Path):
        self.holder = holder or {}
        who = _describe(self.holder)
        super().__init__(f"another ktconvert run is writing this output ({who}; lock {lock.name} beside it)",
                         path=str(out), fix="wait for that run to end or stop it, then rerun; a lock left by a "
                         "process that died is taken over by itself")


def _describe(holder: dict) -> str:
    pid, host, cmd = holder.get("pid"), holder.get("host"), holder.get("command")
    if not isinstance(pid, int) or not isinstance(host, str):
        return "a process whose record in the lock file is unreadable"
    return f"{cmd + ' ' if isinstance(cmd, str) and cmd else ''}pid {pid} on host {host}"


def _record() -> bytes:
    """This process's record for the lock file: pid, host and the command (``quantize`` for ktconvert's own)."""
    prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] not in ("", "-c") else "python"
    if prog in ("ktconvert", "__main__.py"):
        prog = next((a for a in sys.argv[1:] if not a.startswith("-")), "ktconvert")
    return (json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "command": prog}) + "\n").encode()


def _read_holder(fd: int) -> dict | None:
    try:
        data = os.pread(fd, 4096, 0)
        holder = json.loads(data.decode("utf-8"))
    except (OSError, ValueError):
        return None
    return holder if isinstance(holder, dict) else None


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _acquire(path: Path, out: Path) -> int:
    """Lock ``path`` for this process and return the descriptor that holds it, or raise :class:`OutputBusy`."""
    private = path.with_name(f"{path.name}.{os.getpid()}.{os.urandom(4).hex()}")
    fd = os.open(private, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, _record())
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a file nobody else knows: never contended
        for _ in range(_ATTEMPTS):
            try:
                os.link(private, path)  # no lock file: ours is the lock file now
                return fd
            except FileExistsError:
                pass
            try:
                other = os.open(path, os.O_RDONLY)
            except FileNotFoundError:  # released in between: try again
                continue
            try:
                try:
                    fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise OutputBusy(out, _read_holder(other), path) from None
                if _same_file(other, path):  # its holder is gone (dead, or released without unlinking): take over
                    os.replace(private, path)
                    return fd
            finally:
                os.close(other)
        raise EnvironmentProblem("the output's lock file keeps changing under this run", path=str(path),
                                 fix="check which processes write this output, then rerun")
    except BaseException:
        os.close(fd)
        raise
    finally:
        try:
            os.unlink(private)
        except FileNotFoundError:
            pass


def _make_parents(directory: Path) -> list[Path]:
    """Create ``directory`` and its missing parents; the ones created, deepest first (removed again on release
    when nothing was written into them)."""
    made = []
    d = directory
    while not d.exists() and d != d.parent:
        made.append(d)
        d = d.parent
    done: list[Path] = []
    try:
        for p in reversed(made):
            try:
                p.mkdir()
            except FileExistsError:
                continue
            done.insert(0, p)
    except BaseException:
        _remove_empty(done)
        raise
    return done


@contextmanager
def output_lock(out: str | os.PathLike) -> Iterator[Path]:
    """Hold OUT's lock for the ``with`` block; yields the lock file's path. Raises :class:`OutputBusy` when a live
    run holds it, and ``OSError`` when the directory cannot take the lock file (read-only, full: see
    :func:`ktconvert.io.atomic.claim_output`, which reports it as the output's write failure)."""
    out = Path(out)
    path = lock_path(out)
    made: list[Path] = []
    try:
        made = _make_parents(path.parent)
        fd = _acquire(path, out)
    except BaseException:
        _remove_empty(made)
        raise
    try:
        yield path
    finally:
        try:
            if _same_file(fd, path):  # unlinked while still held: no other process can hold this file now
                os.unlink(path)
        finally:
            os.close(fd)
            _remove_empty(made)


def _remove_empty(dirs: list[Path]) -> None:
    for d in dirs:
        try:
            d.rmdir()
        except OSError:
            return


def partial_dir(out: Path) -> Path:
    """Where ``out`` is built before the rename (also what ``--resume`` continues)."""
    out = Path(out)
    return out.parent / f".{out.name}{PARTIAL_SUFFIX}"


def _refuse_unwritable_name(out: Path) -> None:
    """OUT names something no run can write: a symlink to nothing (the final rename would fail after all the
    work), or a filesystem root."""
    if out.is_symlink() and not out.exists():
        raise UsageProblem(f"output is a symbolic link to {os.readlink(out)!r}, which does not exist", path=str(out),
                           fix="remove the link, or choose another output path")
    out_r = out.resolve()
    if out_r == out_r.parent:
        raise UsageProblem("output is a filesystem root", path=str(out), fix="choose a new directory as the output")


@contextmanager
def claim_output(out: Path, *, inputs: Iterable[Path] = (), force: bool = False,
                 in_place: bool = False) -> Iterator[Path]:
    """The one way a command starts writing OUT: hold OUT's lock (:func:`output_lock`) for the whole
    ``with`` block, and check OUT (:func:`guard_output`) once the lock is held, so the check sees no other run's
    half-made state. Yields OUT."""
    out = Path(out)
    _refuse_unwritable_name(out)
    held = ExitStack()
    try:
        held.enter_context(output_lock(out))
    except OSError as exc:  # the directory cannot take the lock file: read-only, full, a file in the way
        raise write_failure(exc, out) from None
    with held:
        guard_output(out, inputs=inputs, force=force, in_place=in_place)
        yield out


def guard_output(out: Path, *, inputs: Iterable[Path] = (), force: bool = False, in_place: bool = False) -> None:
    """Refuse to write inside an input, over an input, or over an existing non-empty output without ``force``
    (``in_place``: an existing directory is written into, file by file, as golden regenerates).

    ``inputs`` are the input files and the directories that count as input (the checkpoint directory, the
    folder of a shard set): the output may not lie inside any of them, nor contain one."""
    out = Path(out)
    _refuse_unwritable_name(out)
    out_r = out.resolve()
    cwd = Path.cwd().resolve()
    if not in_place and (out_r == cwd or out_r in cwd.parents):  # replacing it would pull it away under the user
        raise UsageProblem("output is the current directory or one above it", path=str(out),
                           fix="choose a new directory as the output")
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
    if out.is_dir() and not in_place and any(out.iterdir()) and not force:
        raise UsageProblem("output already exists", path=str(out), fix="pass --force to replace it, or choose a new name")


def check_output_file(path: str | os.PathLike, flag: str) -> Path:
    """Refuse, before a run starts, a file output (``--junit``, ``--plot``) that could not be written when the run
    ends: its directory missing or not a directory, or the path a directory. Returns the path."""
    p = Path(path)
    parent = Path(os.path.abspath(p)).parent
    if p.is_dir():
        raise UsageProblem("is a directory; this option names the file to write", path=str(p), where=flag,
                           fix="give a file name (e.g. report.xml) inside it")
    if not parent.is_dir():
        what = "is not a directory" if parent.exists() else "does not exist"
        raise UsageProblem(f"its directory {p.parent} {what}", path=str(p), where=flag,
                           fix="create the directory first, or name a file in an existing one")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise EnvironmentProblem(f"its directory {p.parent} is not writable", path=str(p), where=flag,
                                 fix="name a file in a directory you can write to")
    return p


def guard_output_file(path: str | os.PathLike, flag: str, *, inputs: Iterable[Path] = (), force: bool = False) -> Path:
    """:func:`check_output_file` for a command whose result is the file (``ktconvert imatrix OUT``): also refuse
    an existing file without ``force``, and a path that is an input or lies inside an input directory."""
    p = check_output_file(path, flag)
    p_r = p.resolve()
    for r in sorted({Path(i).resolve() for i in inputs}):
        if p_r == r or r in p_r.parents:
            raise UsageProblem("the output would be written over or inside an input", path=str(p), where=flag,
                               fix="choose an output path outside the inputs")
    if p.exists() and not force:
        raise UsageProblem("output already exists", path=str(p), where=flag,
                           fix="pass --force to replace it, or choose a new name")
    return p


def write_file(path: Path, data: bytes) -> None:
    """Write one file atomically (built under a temporary name beside it, renamed when complete)."""
    path = Path(path)
    replace_files(path.parent, {path.name: data})


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
    """The file's sha256, read with large ``preadv`` calls into one reused buffer (no fresh memory per chunk)."""
    h = FileSha256(path, chunk)
    h.advance(None)
    return h.hexdigest()


class FileSha256:
    """The sha256 of a file hashed front to back in pieces, as its bytes become final (``advance(to)``: hash up to
    offset ``to``, ``None`` for the end of the file): a run that writes a file out of order hashes each finished
    prefix while the rest is still being written, instead of reading the whole file again at the end.

    ``direct``: read around the page cache (:func:`ktconvert.io.files.read_direct`, where the filesystem allows it),
    for a file written so (a conversion's outputs: worker.py ``DIRECT_WRITE_MIN``): its bytes are not in the page
    cache, and reading them through it would allocate and fill pages for bytes read once."""

    def __init__(self, path: Path | str, chunk: int = 16 * 1024**2, buf: ReadBuffer | None = None, *,
                 direct: bool = False):
        self.path, self.pos, self._chunk, self._direct = path, 0, chunk, direct
        self._h = hashlib.sha256()
        self._buf = buf if buf is not None else ReadBuffer()  # one buffer may serve many files' hashers

    def advance(self, to: int | None, held: dict[int, bytes] | None = None) -> None:
        """Hash up to ``to``; ``held``: bytes of the file kept in memory by offset (taken out as they are hashed,
        not read from the file again), which another thread may add to meanwhile."""
        if to is not None and to <= self.pos:
            return
        held = held if held is not None else {}
        fd = None  # the file is opened only to be read (bytes held in memory need no open)

        def opened() -> int:
            nonlocal fd
            if fd is None:
                fd = os.open(self.path, os.O_RDONLY)
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(fd, self.pos, 0, os.POSIX_FADV_SEQUENTIAL)
            return fd

        try:
            end = os.fstat(opened()).st_size if to is None else to
            while self.pos < end:
                kept = held.pop(self.pos, None)
                if kept is not None and self.pos + len(kept) <= end:
                    self._h.update(kept)
                    self.pos += len(kept)
                    continue
                ahead = min((o for o in list(held) if o > self.pos), default=end)  # (a copy: held may grow)
                n = min(self._chunk, end - self.pos, ahead - self.pos)
                b = read_direct(self.path, self.pos, n, self._buf, what="output file") if self._direct else None
                got = n if b is not None else pread_into(opened(), b := self._buf.take(n), self.pos)
                self._h.update(b[:got])
                self.pos += got
                if got < n:
                    raise OSError(errno.EIO, f"{self.path} ends at {self.pos} bytes, {end} expected", str(self.path))
        finally:
            if fd is not None:
                os.close(fd)

    def hexdigest(self) -> str:
        return self._h.hexdigest()


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


def check_separate(outs: list[Path], where: str | None = None) -> None:
    """Refuse outputs of one run that are the same directory or lie one inside another (``where``: the option
    that named them)."""
    for a in outs:
        for b in outs:
            if a is not b and (a.resolve() == b.resolve() or a.resolve() in b.resolve().parents):
                raise UsageProblem(f"this output is {'the same as' if a.resolve() == b.resolve() else 'inside'} "
                                   f"{a}, another output of the same run", path=str(b), where=where,
                                   fix="write the outputs into separate directories side by side")


def write_dirs(outputs: list[tuple[Path, dict[str, bytes]]], *, force: bool = False) -> None:
    """Write directories of in-memory files (``[(OUT, {name: bytes})]``), every OUT claimed (:func:`claim_output`)
    and none inside another before anything is written, each built aside and renamed when all are complete."""
    outs = [Path(o) for o, _ in outputs]
    check_separate(outs)
    with ExitStack() as stack:
        for o in outs:
            stack.enter_context(claim_output(o, force=force))
        for o, (_, files) in zip(outs, outputs):
            tmp = stack.enter_context(atomic_dir(o, force=force))
            for name, data in files.items():
                (tmp / name).parent.mkdir(parents=True, exist_ok=True)
                (tmp / name).write_bytes(data)


def replace_files(directory: Path, files: dict[str, bytes]) -> None:
    """Write ``files`` into an existing ``directory``, each under a temporary name renamed when all are
    written: a reader sees every file old or new, never torn. A failure (a full disk) leaves ``directory`` as it
    was: files not replaced, a directory this call made removed; one that cannot be written is
    :func:`write_failure`'s one line."""
    made = not directory.exists()
    tmps = {name: directory / f".{name}{PARTIAL_SUFFIX}" for name in files}
    try:
        directory.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            write_durable(tmps[name], data)
        for name in files:
            os.replace(tmps[name], directory / name)
        fsync_dir(directory)
    except BaseException as exc:
        for p in tmps.values():
            if p.exists():
                p.unlink()
        if made:
            shutil.rmtree(directory, ignore_errors=True)
        if isinstance(exc, OSError) and exc.errno in WRITE_ERRNOS:
            raise write_failure(exc, directory) from None
        raise
