"""What every reader checks before it reads: the path is a regular file (a device such as /dev/zero, a FIFO or
a socket would block or never end) of a size such a file can have; and the one way bulk data is read: large
``preadv`` calls into a reused, page-aligned buffer (:class:`ReadBuffer`, :func:`read_exact`), through the page cache
or, for reads large enough to run at the disk's rate on their own, around it (:func:`read_direct`)."""

from __future__ import annotations

import errno
import os
import stat
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from ktconvert.errors import InputError

if TYPE_CHECKING:  # numpy is imported where a buffer is made: check-rules and inspect stay without it
    import numpy as np


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


ALIGN = 4096  # the page size: buffers start on a page, so the kernel copies whole pages into them


HUGE = 2 * 1024**2  # a transparent huge page (x86-64, arm64 with 4 KiB pages)


class ReadBuffer:
    """A grow-only, page-aligned byte buffer reused for every read of a process: reading into the same memory
    again costs no page faults (a fresh array per read faults in and zeroes every page of it first).

    It is an anonymous mapping of whole huge pages, asked to be backed by them (``MADV_HUGEPAGE``, where the kernel
    has transparent huge pages in ``madvise`` or ``always`` mode): an ``O_DIRECT`` read pins the pages it reads into
    (:func:`read_direct`), 512 times fewer of them, and the first touch faults in 2 MiB at a time. Where the kernel
    declines, it is the same memory in 4 KiB pages."""

    def __init__(self) -> None:
        self._raw = self._view = None

    def release(self) -> None:
        """Give the memory back (a later ``take`` allocates again; the mapping goes with its last view)."""
        self._raw = self._view = None

    def take(self, nbytes: int) -> np.ndarray:
        """A writable uint8 view of the first ``nbytes`` (valid until the next ``take``)."""
        import mmap

        import numpy as np

        if self._view is None or nbytes > self._view.size:
            size = -(-max(nbytes, 1) // HUGE) * HUGE
            self._raw = mmap.mmap(-1, size + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # (+ room to start
            # on a huge page boundary; private: a shared one is shmem, which has huge pages of its own setting)
            if hasattr(mmap, "MADV_HUGEPAGE"):
                self._raw.madvise(mmap.MADV_HUGEPAGE)
            whole = np.frombuffer(self._raw, dtype=np.uint8)
            skip = -whole.ctypes.data % HUGE
            self._view = whole[skip: skip + size]
        return self._view[:nbytes]


def pread_into(fd: int, out: np.ndarray | memoryview, offset: int, *, block: int = 1) -> int:
    """Fill ``out`` (a writable contiguous buffer) from ``fd`` at ``offset`` with as few ``preadv`` calls as the
    kernel allows; returns the bytes read (fewer than asked only at the end of the file). ``block``: a read that
    ends off a multiple of it is the end of the file (an ``O_DIRECT`` descriptor's partial last block: asking
    again at an unaligned offset is an error on some filesystems)."""
    view = memoryview(out).cast("B")
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done: done + (1 << 30)]], offset + done)
        done += n
        if n == 0 or n % block:
            break
    return done


def read_exact(path: str | os.PathLike, offset: int, out: np.ndarray, *, what: str = "file",
               where: str | None = None) -> np.ndarray:
    """``out`` filled with the bytes of ``path`` at ``offset`` (one open, large reads, the file's readahead told
    it is read in order); an InputError naming the file when it is shorter than that or unreadable."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise InputError(f"cannot read {what}: {exc.strerror}", path=str(path), where=where) from None
    try:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, offset, out.nbytes, os.POSIX_FADV_SEQUENTIAL)
        got = pread_into(fd, out, offset)
    except OSError as exc:
        raise InputError(f"cannot read {what}: {exc.strerror}", path=str(path), where=where) from None
    finally:
        os.close(fd)
    if got != out.nbytes:
        raise InputError(f"{what} ends at byte {offset + got}, its header says data runs to {offset + out.nbytes}",
                         path=str(path), where=where, fix="the file is truncated; re-download it")
    return out


#: Filesystems (``st_dev``) that refused ``O_DIRECT`` in this process (tmpfs, some FUSE and network mounts):
#: their files are read through the page cache from then on, without asking again.
_NO_DIRECT: set[int] = set()


def open_direct(path: str | os.PathLike, flags: int) -> int | None:
    """``path`` opened with ``flags | O_DIRECT``, or ``None`` where there is no ``O_DIRECT`` (another OS, a
    filesystem that refused it in this process or refuses it now: then remembered) or the path cannot be opened
    (the caller's own access names the problem)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        dev = os.stat(path).st_dev
    except OSError:
        return None
    if dev in _NO_DIRECT:
        return None
    try:
        return os.open(path, flags | flag)
    except OSError as exc:
        if exc.errno == errno.EINVAL:  # the filesystem has no O_DIRECT
            _NO_DIRECT.add(dev)
        return None


def refused_direct(path: str | os.PathLike) -> None:
    """An ``O_DIRECT`` transfer of ``path`` was refused (``EINVAL``: an alignment its filesystem needs): its
    filesystem is read and written through the page cache from then on."""
    try:
        _NO_DIRECT.add(os.stat(path).st_dev)
    except OSError:
        pass


class WriteBehind:
    """Writes around the page cache done by a thread of its own while the caller goes on (a unit's next expert
    packs while the disk takes this one's bytes; ``pwrite`` releases the GIL), the mirror of :class:`ReadAhead`.

    :meth:`write` writes ``views`` (byte buffers laid end to end) at ``offset`` of ``path``, open as ``fd``: the
    whole 4 KiB blocks they cover are gathered into one of the staging buffers (taken in turn: a third write waits
    for the first's buffer) and written by the thread with ``direct_fd`` (the file opened by :func:`open_direct`:
    the disk reads them from this process's memory; no page cache pages allocated, filled and written back); the
    partial blocks at either end (which neighbouring writes share) are written at once through the page cache, as
    is everything without a ``direct_fd``. Except a write's trailing partial block: that is held back, and a next
    write starting where it ends (the next unit's bytes, laid after this one's) takes it as its first bytes, so the
    block shared by two units is written whole, once, around the page cache too; :meth:`flush` (and a write
    elsewhere) writes a block still held through the page cache. Where the filesystem refuses the direct write
    (``EINVAL``: an alignment it needs) the thread writes those bytes through the page cache, and the path joins
    :attr:`refused` (:func:`refused_direct`). A file written either way is the same file. :meth:`flush` waits for
    every write given so far and raises the first error of the thread (a full disk), which the next :meth:`write`
    raises too; after an error nothing more is written by the thread."""

    def __init__(self, bufs: tuple[ReadBuffer, ...]) -> None:
        import queue

        self._free: queue.SimpleQueue = queue.SimpleQueue()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        for b in bufs:
            self._free.put(b)
        self._error: list[BaseException] = []
        self.refused: set[str] = set()
        self._tail: tuple | None = None  # (path, fd, offset, bytes): a write's trailing partial block, held back
        self._thread = threading.Thread(target=self._work, name="ktconvert-write-behind", daemon=True)
        self._thread.start()

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if isinstance(job, threading.Event):  # a flush's marker: everything before it is done
                job.set()
                continue
            path, fd, direct_fd, view, offset, buf = job
            try:
                if not self._error:
                    try:
                        pwrite_all(direct_fd, [view], offset)
                    except OSError as exc:
                        if exc.errno != errno.EINVAL:
                            raise
                        refused_direct(path)
                        self.refused.add(str(path))
                        pwrite_all(fd, [view], offset)
            except BaseException as exc:  # raised in the caller's thread by flush() or the next write()
                self._error.append(exc)
            finally:
                self._free.put(buf)

    def write(self, path: str | os.PathLike, fd: int, direct_fd: int | None, views: list, offset: int) -> None:
        import numpy as np

        if self._error:
            raise self._error[0]
        held = self._tail
        if held is not None and direct_fd is not None and held[0] == path and held[2] + len(held[3]) == offset:
            self._tail = None  # this write goes on from the block held back: it starts with that block's bytes
            views, offset = [memoryview(held[3]), *views], held[2]
        else:
            self._write_tail()
        total = sum(len(v) for v in views)
        head = min(total, -offset % ALIGN)
        body = (total - head) // ALIGN * ALIGN
        if direct_fd is not None and not head and not body:  # still short of a whole block: held on
            self._tail = (path, fd, offset, b"".join(bytes(v) for v in views))
            return
        if direct_fd is None or not body:
            pwrite_all(fd, views, offset)
            return
        flat = [np.frombuffer(v, np.uint8) for v in views]
        cuts = np.cumsum([0] + [a.size for a in flat])

        def part(a: int, b: int) -> list:
            return [memoryview(x[max(a, c0) - c0: min(b, c0 + x.size) - c0])
                    for x, c0 in zip(flat, cuts[:-1]) if max(a, c0) < min(b, c0 + x.size)]

        buf = self._free.get()
        out = buf.take(body)
        np.concatenate([np.asarray(m) for m in part(head, head + body)], out=out)
        self._jobs.put((path, fd, direct_fd, memoryview(out), offset + head, buf))
        pwrite_all(fd, part(0, head), offset)
        if head + body < total:
            self._tail = (path, fd, offset + head + body, b"".join(bytes(m) for m in part(head + body, total)))

    def _write_tail(self) -> None:
        """Write the partial block held back, if any, through the page cache (no write of this writer's around the
        page cache covers its block: the next write did not go on from it)."""
        held, self._tail = self._tail, None
        if held is not None:
            pwrite_all(held[1], [memoryview(held[3])], held[2])

    def flush(self) -> None:
        """Write the partial block held back; wait for every write given so far; raise the first error of the
        thread."""
        self._write_tail()
        done = threading.Event()
        self._jobs.put(done)
        done.wait()
        if self._error:
            raise self._error[0]

    def close(self) -> None:
        """Stop the thread once the writes given so far are done (the partial block held back written first)."""
        try:
            self._write_tail()
        finally:
            self._jobs.put(None)
            self._thread.join()


def pwrite_all(fd: int, views: list, offset: int) -> None:
    """Write ``views`` (byte buffers laid end to end: one ``pwritev`` of them all, no joined copy) at ``offset``,
    as few calls as the kernel allows."""
    views = [v for v in views if len(v)]
    while views:
        batch, size = [], 0
        for v in views[:_IOV_MAX]:
            if size + len(v) > 1 << 30 and batch:
                break
            batch.append(v)
            size += len(v)
        n = os.pwritev(fd, batch, offset)
        offset += n
        while views and n >= len(views[0]):  # drop what was written, keep the rest of a buffer cut short
            n -= len(views[0])
            views.pop(0)
        if n:
            views[0] = views[0][n:]


_IOV_MAX = 1024  # buffers per pwritev (Linux's IOV_MAX)


_KEPT = threading.local()  # .fds: {path: descriptor or None} in a thread inside files_kept_open()


class files_kept_open:
    """Within the block, in this thread, :func:`read_direct` opens each file once and keeps it open (a read then
    costs no ``stat``, ``open`` and ``close`` of its own); the files are closed when the block ends."""

    def __enter__(self) -> None:
        self._outer = getattr(_KEPT, "fds", None)
        _KEPT.fds = {}

    def __exit__(self, *exc) -> None:
        fds, _KEPT.fds = _KEPT.fds, self._outer
        for fd in fds.values():
            if fd is not None:
                os.close(fd)


def read_direct(path: str | os.PathLike, offset: int, nbytes: int, buf: ReadBuffer, *, what: str = "file",
                where: str | None = None) -> np.ndarray | None:
    """``nbytes`` of ``path`` at ``offset`` read with ``O_DIRECT``: the disk writes them straight into ``buf`` (no
    copy out of the page cache, no page cache filled with bytes read once). Returns a view of ``buf`` (valid until
    its next use), or ``None`` where the filesystem refuses ``O_DIRECT`` (the caller then reads with
    :func:`read_exact`). The read covers the whole 4 KiB blocks around the range, so the view starts
    ``offset % 4096`` bytes into the buffer. A file shorter than the range is :func:`read_exact`'s InputError."""
    kept = getattr(_KEPT, "fds", None)
    if kept is None:
        fd = open_direct(path, os.O_RDONLY)
    elif (fd := kept.get(str(path), -1)) == -1:
        fd = kept[str(path)] = open_direct(path, os.O_RDONLY)
    if fd is None:
        return None  # (a path that cannot be opened at all: read_exact names the problem)
    start = offset - offset % ALIGN
    end = -(-(offset + nbytes) // ALIGN) * ALIGN
    try:
        window = buf.take(nbytes + 2 * ALIGN)[: end - start]  # the size its alignment needs at most: the buffer
        # grows for the first unit of a size, not again for one whose bytes start elsewhere in a block
        try:
            got = pread_into(fd, window, start, block=ALIGN)
        except OSError as exc:
            if exc.errno == errno.EINVAL:  # O_DIRECT opened, then refused (an alignment this filesystem needs)
                refused_direct(path)
                if kept is not None:
                    kept[str(path)] = None  # closed now, and not read so again while the block lasts
                    os.close(fd)
                    fd = None
                return None
            raise InputError(f"cannot read {what}: {exc.strerror}", path=str(path), where=where) from None
    finally:
        if kept is None and fd is not None:
            os.close(fd)
    have = got - (offset - start)
    if have < nbytes:
        raise InputError(f"{what} ends at byte {start + got}, its header says data runs to {offset + nbytes}",
                         path=str(path), where=where, fix="the file is truncated; re-download it")
    return window[offset - start: offset - start + nbytes]


class ReadAhead:
    """Reads done ahead of their use by a thread of their own, into buffers taken in turn (with ``n`` buffers,
    ``n - 1`` reads ahead: the reader holds the last one handed out), so a process decodes and converts the bytes of
    one read while the disk delivers the next (``preadv`` and the compiled kernels both release the GIL).
    ``reads``: ``(key, read)`` in the order they are used, ``read(buf)`` returning a view of ``buf``; :meth:`next`
    hands them out in that order, each valid until the next call (its buffer is then read into again). Asking
    again for the read just handed out hands it out again, and a read announced twice in a row is read once: a
    reader may go back over the bytes it has (the kt-amx packer's float32 path, to say where a NaN is), or two in a
    row read the same bytes. An error of a read (an :class:`InputError` for a truncated file) is raised by
    :meth:`next` where that read is used, and no read is started after it; leaving the ``with`` block stops the
    reads and waits for them, whatever ended the block.

    The thread is the process's read-ahead thread, started on first use and kept: a conversion makes one
    ``ReadAhead`` per group of units, hundreds a run, and a thread started and ended for each cost its start, its
    stack and its exit each time. (A ``ReadAhead`` made while another of the process is open gets a thread of its
    own.) Every file a ``ReadAhead`` reads is kept open until its last read (:class:`files_kept_open`)."""

    _lock = threading.Lock()
    _thread: threading.Thread | None = None
    _jobs = None  # (queue.SimpleQueue) the ReadAheads whose reads the kept thread is to make
    _busy = False  # whether the kept thread is making a ReadAhead's reads (a new one then gets a thread of its own)

    def __init__(self, reads: list, bufs: tuple[ReadBuffer, ...]) -> None:
        import queue

        self._reads: list = []
        for r in reads:  # a read announced again right after itself: read once
            if not self._reads or r[0] != self._reads[-1][0]:
                self._reads.append(r)
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        self._ready: queue.SimpleQueue = queue.SimpleQueue()
        for b in bufs:
            self._free.put(b)
        self._held = self._last = None
        self._stop = False
        self._done = threading.Event()
        self._kept = False
        with ReadAhead._lock:
            if ReadAhead._busy:
                threading.Thread(target=self._run, name="ktconvert-read-ahead", daemon=True).start()
                return
            if ReadAhead._thread is None or not ReadAhead._thread.is_alive():
                ReadAhead._jobs = queue.SimpleQueue()
                ReadAhead._thread = threading.Thread(target=ReadAhead._serve, args=(ReadAhead._jobs,),
                                                     name="ktconvert-read-ahead", daemon=True)
                ReadAhead._thread.start()
            ReadAhead._busy = self._kept = True
            ReadAhead._jobs.put(self)

    @staticmethod
    def _serve(jobs) -> None:
        while True:
            jobs.get()._run()

    def _run(self) -> None:
        try:
            with files_kept_open():
                self._work()
        finally:
            if self._kept:
                with ReadAhead._lock:
                    ReadAhead._busy = False
            self._done.set()

    def _work(self) -> None:
        for key, read in self._reads:
            buf = self._free.get()
            if buf is None or self._stop:
                return
            try:
                self._ready.put((key, buf, read(buf), None))
            except BaseException as exc:  # handed to the reader of these bytes, raised there
                self._ready.put((key, buf, None, exc))
                return

    def next(self, key):
        """The bytes of the next read, which must be ``key`` (a caller reading out of the announced order is a bug),
        or of the last one again."""
        if self._last is not None and self._last[0] == key:
            return self._last[1]
        self._last = None
        if self._held is not None:
            self._free.put(self._held)
            self._held = None
        got, buf, data, exc = self._ready.get()
        self._held = buf
        if exc is not None:
            raise exc
        if got != key:
            raise AssertionError(f"read {key} asked, {got} read ahead")
        self._last = (key, data)
        return data

    def close(self) -> None:
        self._stop = True
        self._free.put(None)
        self._done.wait()

    def __enter__(self) -> "ReadAhead":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
