"""One unit of work: a run of rows of one output tensor, read from the input, converted, written at its offset.

Runs in the main process (``jobs=1``) or in worker processes; it opens what it needs by path and caches it per
process, so a task is only a few small objects. Everything a unit allocates is proportional to its rows, which
the executor sizes from the memory budget. Runs of whole input rows are read with large ``pread`` calls into one
reused buffer per process (other access, a column band or a row permutation, goes through short-lived memory
maps; the units of a group read around the page cache have every read done one ahead by a thread into a second
buffer, a large unit's in chunks it converts one by one: :func:`_reading_ahead`), and the process keeps the heap
memory it frees for the next unit (:mod:`ktconvert.io.heap`), so resident memory does not grow with the checkpoint
and no unit faults in the pages the last one used.
"""

from __future__ import annotations

import functools
import math
import multiprocessing.context
import os
import signal
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from ktconvert.convert.items import PlanTensor, Segment
from ktconvert.errors import EnvironmentProblem, InputError
from ktconvert.formats import fp8, kt_amx, open_checkpoint, quantized
from ktconvert.formats.imatrix import read_imatrix
from ktconvert.formats.lora_delta import lora_delta
from ktconvert.formats.transforms import tile_columns
from ktconvert.io.dtypes import FLOAT_DTYPES, INT_DTYPES, decode_float32, raw_view
from ktconvert.io.files import ALIGN, ReadAhead, ReadBuffer, WriteBehind, open_direct, pread_into
from ktconvert.io.heap import keep_freed_memory
from ktconvert.quant import bf16_to_float32, dequantize, quantize
from ktconvert.convert.kt_amx_io import dequant_rows
from ktconvert.convert.kt_amx_io import pack_group


@dataclass(frozen=True)
class Task:
    """What a worker needs for one unit; ``out_path`` is the output file (in the partial directory); ``run`` tells
    the runs apart in a long-lived worker (:func:`run_group_synced`); ``direct``: its group reads its input around
    the page cache (``O_DIRECT``, where the filesystem allows it), each read done ahead by a thread
    (:func:`_reading_ahead`); only for a unit that hashes the bytes it reads (:func:`reads_are_ranges`)."""

    unit: int
    src: str
    out_path: str
    tensor: PlanTensor
    r0: int
    r1: int
    run: str = ""
    direct: bool = False


_CHECKPOINTS: dict = {}
_FDS: dict = {}
_DFDS: dict = {}  # the output files open with O_DIRECT (:func:`_direct_fd`)
_RUN = [""]


def _checkpoint(path: str):
    ck = _CHECKPOINTS.get(path)
    if ck is None:

        ck = _CHECKPOINTS[path] = open_checkpoint(path)
    return ck


def _fd(path: str) -> int:
    fd = _FDS.get(path)
    if fd is None:
        fd = _FDS[path] = os.open(path, os.O_WRONLY)
    return fd


def _direct_fd(path: str) -> int | None:
    """``path`` open for writes around the page cache, or ``None`` where its filesystem refuses them."""
    if path not in _DFDS:
        fd = open_direct(path, os.O_WRONLY)
        if fd is None:
            return None
        _DFDS[path] = fd
    return _DFDS[path]


def close_all() -> None:
    if _BEHIND[0] is not None:  # (its writes are done or failed: a run flushes each group before reporting it)
        _BEHIND[0].close()
        _BEHIND[0] = None
    for fd in [*_FDS.values(), *_DFDS.values()]:
        os.close(fd)
    _FDS.clear()
    _DFDS.clear()
    _CHECKPOINTS.clear()
    for b in (_BUF, _BUF2, _BUF3, _XBUF, _QBUF, _WBUF, _WBUF2):
        b.release()


class _WorkerProcess(multiprocessing.context.SpawnProcess):
    """A spawned worker that starts with SIGINT blocked: Ctrl-C goes to the whole process group, and a worker
    still importing would die of it with a traceback. The parent keeps it pending while it starts one (blocked in
    the starting thread only, so the parent still gets its KeyboardInterrupt); the worker, which inherits the
    mask, ignores it for good in :func:`ignore_interrupts`. The converting process alone reports an interrupt."""

    def start(self) -> None:
        before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            super().start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, before)


@contextmanager
def interrupts_deferred():
    """Ctrl-C during the block raises ``KeyboardInterrupt`` when the block ends, not inside it (in the main thread;
    elsewhere a no-op). For ``Executor.submit``: a ``KeyboardInterrupt`` inside ``ProcessPoolExecutor.submit`` can
    land after the executor has made its manager thread and before it starts it, and ``shutdown()`` then fails
    joining a thread never started (CPython's ``concurrent.futures``), which turned a Ctrl-C into an internal error.
    A handler of Python's own is used, not a signal mask: the kernel may hand the signal to any thread that does
    not block it, and Python runs the handler in the main thread whichever did."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got = []
    before = signal.signal(signal.SIGINT, lambda signum, frame: got.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)
        if got and callable(before):
            before(signal.SIGINT, got[0])  # Python's default handler: KeyboardInterrupt, here
        elif got and before == signal.SIG_DFL:
            signal.raise_signal(signal.SIGINT)


class _WorkerContext(multiprocessing.context.SpawnContext):
    Process = _WorkerProcess


def worker_context() -> multiprocessing.context.SpawnContext:
    """The multiprocessing context of every local worker pool (quantize -j, gate -j): spawn (torch and forked
    workers do not mix), workers deaf to Ctrl-C. Their initializer must call :func:`ignore_interrupts`."""
    return _WorkerContext()


def ignore_interrupts() -> None:
    """In a worker of :func:`worker_context`: ignore SIGINT (dropping one sent while it started), then unblock."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def worker_init(parent: int | None = None) -> None:
    """Per worker process: one thread each (the executor runs ``jobs`` processes side by side), and exit when the
    converting process dies (a ``kill -9`` of it must not leave workers behind, blocked on their task queue).

    ``parent`` is the converting process's pid, passed in: a worker still starting up when its parent is killed
    would otherwise take its new parent (init) for the one to watch, and wait on its queue forever.
    """
    import threading

    ignore_interrupts()
    parent = parent or os.getppid()
    if os.getppid() != parent:
        os._exit(1)

    # one thread each, for torch too should anything here import it (a LoRA merge), without importing it now:
    # the quantizers are numpy and numba, and torch's import costs each worker seconds of CPU and ~150 MiB
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS"):
        os.environ[var] = "1"
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)

    def watch() -> None:
        while True:
            time.sleep(0.2)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="ktconvert-parent-watch", daemon=True).start()


def worker_warm_up() -> None:
    """A started worker's first task (:func:`ktconvert.convert.pool.workers_started`): one small compiled call,
    which loads numba's machinery (about half a CPU-second, once per process) before the first unit needs it."""
    quantize(np.zeros((1, 32), dtype=np.float32), "Q8_0")


def _convert_hashed(task: Task) -> tuple[int, str]:
    """:func:`_convert` and the :func:`source_digest` of its input: hashed from the bytes the unit read when it reads
    whole rows of plain tensors (no second read), else read again."""
    t, r0, r1 = task.tensor, task.r0, task.r1
    h = _READ_HASH[0] = _checksum() if reads_are_ranges(t, r0, r1) else None
    try:
        uid = _convert(task)
    finally:
        _READ_HASH[0] = None
    return uid, h.hexdigest() if h is not None else source_digest(_checkpoint(task.src), t, r0, r1)


def _convert(task: Task) -> int:
    """:func:`_run`, an input error without a file named after the unit's input and tensor."""
    try:
        return _run(task)
    except InputError as exc:
        if exc.path is None:
            raise InputError(exc.message, path=task.src, where=exc.where or f"tensor {task.tensor.name}",
                             fix=exc.fix) from None
        raise


@dataclass(frozen=True)
class Group:
    """Units run one after the other in one process: ``tasks`` are ``(output index, Task)`` of one or several
    outputs (several outputs' units reading the same bytes one after the other: :func:`_reading_ahead` reads those
    bytes once for all of them)."""

    tasks: tuple


def run_group(group: Group) -> list[tuple[int, int, str]]:
    """Convert and write every unit of ``group``, one after the other (a group read around the page cache read
    ahead: :func:`_reading_ahead`); returns ``(output index, unit id, input digest)`` per unit, the digest
    :func:`source_digest` of the input the unit read (what ``--resume`` checks the source against). Units reading
    the same input bytes share one digest, hashed once. Raises :class:`InputError` for bad data (NaN/Inf)."""
    out, digests = [], {}
    keep_freed_memory()
    try:
        with _reading_ahead(group):
            for k, task in group.tasks:
                key = tuple(source_ranges(_checkpoint(task.src), task.tensor, task.r0, task.r1))
                if key in digests:
                    uid = _convert(task)
                else:
                    uid, digests[key] = _convert_hashed(task)
                out.append((k, uid, digests[key]))
    finally:
        _written()  # (after a failure too: no write of this group's is left running behind the error)
    return out


@contextmanager
def _reading_ahead(group: Group):
    """Within the block, the reads of a group whose units read around the page cache (:attr:`Task.direct`), all of
    them in the order its units make them (:func:`_unit_reads`), done two ahead by a thread (:class:`ReadAhead`):
    the disk delivers the next reads while the last one converts, so only the group's first read is waited for, and
    reads of a few MB (a kt-amx expert) keep the disk as busy as one large read. Two, not one: with ``-j 2`` on two
    cores, a chunk read one ahead was often not there yet when the unit thread wanted it (another process's reads
    and writes share the disk), and the converting threads waited on it about a tenth of their time; two ahead
    made a Q4_K_M ``-j 2`` run about 6% faster, three ahead no faster than two (docs/measurements.md). Any other
    group: nothing."""
    tasks = [task for _, task in group.tasks if task.direct]
    if not tasks:
        yield
        return
    reads = [r for task in tasks for r in _unit_reads(_checkpoint(task.src), task)]
    with ReadAhead(reads, (_BUF, _BUF2, _BUF3)) as ahead:
        _AHEAD[0] = ahead
        try:
            yield
        finally:
            _AHEAD[0] = None


def run_group_synced(group: Group) -> list[tuple[int, int, str]]:
    """:func:`run_group` for a worker that outlives the run and may sit on another host (a Ray task): every unit's
    bytes are fsynced here before it reports done (the journal must not list bytes still in this host's cache), and
    the open files and checkpoints of an earlier run are dropped first (a --force rerun makes new files)."""
    for _, task in group.tasks:
        _check_visible(task)
    result = run_group(group)
    for path in {task.out_path for _, task in group.tasks}:
        os.fsync(_fd(path))
    return result


def _check_visible(task: Task) -> None:
    """On a long-lived (Ray) worker: drop an earlier run's open files, and refuse a path this node cannot see."""
    if task.run != _RUN[0]:
        close_all()
        _RUN[0] = task.run
    for path, what in ((task.out_path, "the output"), (task.src, "the input")):
        if not os.path.exists(path):
            import socket

            raise EnvironmentProblem(f"{what} is not visible on Ray node {socket.gethostname()}", path=path,
                                     fix="--executor ray needs SRC and OUT on a filesystem every node mounts at the same path")


def _run(task: Task) -> int:
    t = task.tensor
    if t.kt_pack is not None:
        data = pack_group(_checkpoint(task.src), t, _float_rows, _bf16_rows, _QBUF.take(t.kt_pack[5]))
        _pwrite(task.out_path, data, t.offset)
        return task.unit
    if t.const is not None:
        data = np.frombuffer(t.const, dtype=np.uint8)
    else:
        ck = _checkpoint(task.src)
        if t.copy_bytes:
            data = _raw_rows(ck, t, task.r0, task.r1)
        elif _index_table(ck, t):
            data = _int_rows(ck, t, task.r0, task.r1)
        else:  # converted and written a run of rows at a time (_cuts)
            for a, b in _cuts(ck, task):
                x = _float_rows(ck, t, a, b, _XBUF)
                _write_rows(task, _quantize(x, t, a, b), a, b)
                del x
            return task.unit
    _write_rows(task, data, task.r0, task.r1)
    return task.unit


def _write_rows(task: Task, data: np.ndarray, r0: int, r1: int) -> None:
    """Write rows ``r0..r1`` of the unit's output tensor (``data``) at their offset in its file."""
    t = task.tensor
    expect = (r1 - r0) * t.row_bytes if t.const is None else t.nbytes
    if data.nbytes != expect:
        raise AssertionError(f"{t.name}: unit produced {data.nbytes} bytes, plan says {expect}")
    _pwrite(task.out_path, data, t.offset + r0 * t.row_bytes)


#: Input bytes per chunk of a unit read around the page cache: its rows are read, converted and written a chunk at a
#: time, the next chunk read (:class:`ReadAhead`) while this one converts. Measured (docs/measurements.md, issue 35).
READ_AHEAD_CHUNK = 4 * 1024**2


def _cuts(ck, task: Task) -> list[tuple[int, int]]:
    """The runs of rows a quantized unit is read, converted and written in: for a unit read ahead
    (:attr:`Task.direct`), runs of about :data:`READ_AHEAD_CHUNK` input bytes, each a whole number of 4 KiB blocks
    where the row size allows (a block is then read once), but a unit that is one whole segment of a stacked
    tensor at once; any other unit at once. Any cut is exact: every type quantizes each row on its own (a K-quant's
    super-blocks run along the row)."""
    t, r0, r1 = task.tensor, task.r0, task.r1
    if not task.direct:
        return [(r0, r1)]
    meets = list(_overlaps(t, r0, r1))
    if len(t.segments) > 1 and len(meets) == 1 and meets[0][2] == meets[0][0].rows:
        return [(r0, r1)]  # one whole source tensor of a stacked one (an expert's projection): read whole, as the
        # other outputs' units of it read it in a several-output run (a kt-amx unit reads its experts whole), so
        # their group reads it once for all of them, however large the expert (DeepSeek-V3's: 28 MiB)
    rb = max(_row_bytes(ck[s.source]) for s, *_ in meets)
    step = ALIGN // math.gcd(rb, ALIGN)
    rows = max(step, READ_AHEAD_CHUNK // rb // step * step)
    return [(a, min(a + rows, r1)) for a in range(r0, r1, rows)]


def _unit_reads(ck, task: Task) -> list[tuple[tuple, functools.partial]]:
    """``(key, read)`` of every read a unit read ahead makes, in its order (:func:`_read_rows` asks for them by
    key): a kt-amx group's segments whole, a quantized unit's :func:`_cuts` segment by segment, any other (a row
    copy, an index table) its rows at once."""
    t = task.tensor
    if t.kt_pack is not None:
        spans = segments_read(t, task.r0, task.r1)
    else:
        cuts = [(task.r0, task.r1)] if t.copy_bytes or _index_table(ck, t) else _cuts(ck, task)
        spans = [(s, i, n) for a, b in cuts for s, i, n, _ in _overlaps(t, a, b)]
    return [((s.source, s.src_row + i, n), functools.partial(_direct_read, ck, s.source, s.src_row + i, n))
            for s, i, n in spans]


def _index_table(ck, t: PlanTensor) -> bool:
    """Whether ``t`` is an integer index table copied as I32 (:func:`_int_rows`), not rows converted."""
    return t.type == "I32" and ck[t.segments[0].source].dtype in INT_DTYPES


def _direct_read(ck, name: str, first: int, n: int, buf: ReadBuffer) -> np.ndarray:
    return ck.read_rows(name, first, first + n, buf, direct=True)


_IMATRICES: dict = {}
DIGEST_CHUNK = 1 << 26  # bytes hashed per read


def _quantize(x: np.ndarray, t: PlanTensor, r0: int, r1: int) -> np.ndarray:
    """Rows ``r0..r1`` of ``t`` (``x``) quantized to ``t.type``, with the importance of each row's expert when the
    plan gave the tensor an importance matrix (``quantize --imatrix``), as llama-quantize passes expert e's slice
    with expert e's rows."""
    if t.imatrix is None:  # into this process's output buffer (written out before the next unit takes it)
        out = _QBUF.take((r1 - r0) * t.row_bytes).reshape(r1 - r0, t.row_bytes)
        return quantize(x, t.type, workers=1, name=t.name, out=out).reshape(-1)
    imx = _IMATRICES.get(t.imatrix)
    if imx is None:
        imx = _IMATRICES[t.imatrix] = read_imatrix(t.imatrix)
    qw = imx.for_tensor(t.name, t.shape).reshape(-1, x.shape[-1])
    per = t.rows // qw.shape[0]
    parts = []
    for e in range(r0 // per, (r1 - 1) // per + 1):
        a, b = max(r0, e * per), min(r1, (e + 1) * per)
        parts.append(quantize(x[a - r0: b - r0], t.type, imatrix=qw[e], workers=1, name=t.name).reshape(-1))
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def source_ranges(ck, t: PlanTensor, r0: int, r1: int) -> list[tuple[str, int, int]]:
    """``(file, offset, length)`` of the input bytes that rows ``r0..r1`` of ``t`` are made from: their own rows
    for a row copy, the whole expert slab (or tensor, with its scales and every kt-amx part) otherwise."""
    out: list[tuple[str, int, int]] = []

    def whole(name: str) -> None:
        if name in ck:
            i = ck[name]
            out.append((str(i.file), i.offset, i.nbytes))

    if t.const is not None:
        return out
    for s, i, n in segments_read(t, r0, r1):
        info = ck[s.source]
        if s.op == "rows" and not s.scale:
            rb = _row_bytes(info)
            out.append((str(info.file), info.offset + (s.src_row + i) * rb, n * rb))
        elif s.op == "transpose":
            slab = info.nbytes // (info.shape[0] or 1)
            out.append((str(info.file), info.offset + s.expert * slab, slab))
        elif s.op == "kt-amx":
            L, proj, e, _, _ = kt_amx.parse_name(s.source)
            for part in range(s.parts):
                for kind in ("weight", "scale"):
                    whole(kt_amx.tensor_name(L, proj, e, part, kind))
        else:
            whole(s.source)
        if s.scale:
            whole(s.scale)
            p = ck.packed.get(s.source)
            for c in p.companions if p is not None else ():
                if c != s.scale:
                    whole(c)
    return out


def segments_read(t: PlanTensor, r0: int, r1: int) -> list[tuple[Segment, int, int]]:
    """``(segment, first row inside it, rows)`` that rows ``r0..r1`` of ``t`` are made from (a kt-amx group: every
    segment whole)."""
    if t.kt_pack is not None:
        return [(s, 0, s.rows) for s in t.segments]
    return [(s, i, n) for s, i, n, _ in _overlaps(t, r0, r1)]


def _row_bytes(info) -> int:
    """Bytes of one flat row of a stored tensor (the last numpy axis; a 0-/1-D tensor is one row)."""
    rows = 1
    for d in info.shape[:-1]:
        rows *= d
    return info.nbytes // rows if rows else info.nbytes


def _checksum():
    """A new input checksum (numba, imported on first use: planning alone never loads it)."""
    from ktconvert.quant._jit_digest import Checksum

    return Checksum()


def source_digest(ck, t: PlanTensor, r0: int, r1: int) -> str:
    """The 64-bit checksum (:mod:`ktconvert.quant._jit_digest`, 16 hex digits) of the input bytes a unit reads, read
    from the files as they are now, into this process's read buffer (the unit has just read them: they come from the
    page cache)."""
    h = _checksum()
    for path, offset, length in source_ranges(ck, t, r0, r1):
        fd = os.open(path, os.O_RDONLY)
        try:
            while length > 0:
                chunk = _BUF.take(min(length, DIGEST_CHUNK))
                got = pread_into(fd, chunk, offset)
                h.update(chunk[:got])
                if got < chunk.nbytes:
                    h.update(b"<short>")
                    break
                offset, length = offset + got, length - got
        finally:
            os.close(fd)
    return h.hexdigest()


#: A write of at least this much goes around the page cache (:class:`ktconvert.io.files.WriteBehind`: its whole
#: 4 KiB blocks with ``O_DIRECT``, its partial blocks through the page cache): a kt-amx expert's 0.8 MB (AMXINT4)
#: to 1.6 MB (AMXINT8), a quantized unit's rows. Copying into page cache pages and ext4's per-block accounting of
#: them were the largest part of a kt-amx run's system time once its reads went around the cache; at 1 MiB,
#: AMXINT4's experts still went through it (docs/measurements.md, issue 35).
DIRECT_WRITE_MIN = 256 * 1024


def _behind() -> WriteBehind:
    """This process's writer of units' bytes around the page cache (made on first use)."""
    if _BEHIND[0] is None:
        _BEHIND[0] = WriteBehind((_WBUF, _WBUF2))
    return _BEHIND[0]


def _written() -> None:
    """Every unit's bytes given to :func:`_pwrite` so far are in their files (before a group reports them done)."""
    if _BEHIND[0] is not None:
        _BEHIND[0].flush()


def _pwrite(path: str, data: np.ndarray | list[np.ndarray], offset: int) -> None:
    """Write ``data`` (an array, or arrays laid end to end: no joined copy through the page cache) at ``offset``;
    :data:`DIRECT_WRITE_MIN` bytes or more around the page cache, where the filesystem allows it."""
    views = [memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8)) for a in
             (data if isinstance(data, list) else [data])]
    fd = _fd(path)  # an OSError (disk full, read-only) goes up as is: the executor names OUT and the fix
    behind = _behind()
    if path in behind.refused and path in _DFDS:  # this filesystem is written through the page cache from now on
        os.close(_DFDS.pop(path))
    direct = _direct_fd(path) if sum(len(v) for v in views) >= DIRECT_WRITE_MIN else None
    behind.write(path, fd, direct, views, offset)
    if WRITE_HOOK[0] is not None:
        WRITE_HOOK[0](path, offset, views)


def _overlaps(t: PlanTensor, r0: int, r1: int):
    """``(segment, first row inside the segment, rows, position in the unit)`` for segments meeting [r0, r1)."""
    for s in t.segments:
        a, b = max(r0, s.start), min(r1, s.start + s.rows)
        if a < b:
            yield s, a - s.start, b - a, a - r0


_BUF = ReadBuffer()  # this process's one read buffer: every unit's rows land in the same pages
# and its unit's float32 rows and quantized bytes: fresh arrays per unit were fresh pages per unit, zeroed by the
# kernel on first touch (13% of a Q4_K_M run's CPU time, in the converting process's unit thread, whose malloc
# arena hands large blocks back when they are freed)
_XBUF, _QBUF = ReadBuffer(), ReadBuffer()
_BUF2, _BUF3 = ReadBuffer(), ReadBuffer()  # the other buffers of a group read ahead (:func:`_reading_ahead`)
# a unit's output blocks gathered for their write around the page cache, two in turn (:func:`_pwrite`)
_WBUF, _WBUF2 = ReadBuffer(), ReadBuffer()
_BEHIND: list = [None]  # this process's WriteBehind (:func:`_behind`)
#: the running group's reads done ahead of their use (:class:`ReadAhead`), when it reads so
_AHEAD: list = [None]
#: in the converting process during a local run, what is handed the bytes each unit writes (the output hashes:
#: execute.py ``_OutputHashes.written``), so they need not be read back; ``None`` elsewhere
WRITE_HOOK: list = [None]


#: the running unit's checksum of the bytes it reads, when those are exactly :func:`source_ranges` in order
_READ_HASH: list = [None]


def reads_are_ranges(t: PlanTensor, r0: int, r1: int) -> bool:
    """Whether a unit reads its input only through :func:`_read_rows`, each of :func:`source_ranges` once and in
    that order (whole rows of plain stored tensors), so hashing what it read gives :func:`source_digest` without
    reading the input a second time."""
    if t.const is not None:
        return False
    segs = t.segments if t.kt_pack is not None else [s for s, *_ in _overlaps(t, r0, r1)]
    return all(s.op == "rows" and not s.scale and not s.lora for s in segs)


def _read_rows(ck, name: str, first: int, n: int) -> np.ndarray:
    """Flat rows ``first .. first+n`` of a stored tensor, read into this process's buffer (valid until the next
    read: decode or copy them before reading again), and hashed into the unit's digest when it keeps one."""
    ahead = _AHEAD[0]
    rows = (ahead.next((name, first, n)) if ahead is not None
            else ck.read_rows(name, first, first + n, _BUF))
    if _READ_HASH[0] is not None:
        _READ_HASH[0].update(rows)
    return rows


def _rows2d(ck, name: str) -> np.ndarray:
    raw = ck.read(name)
    if raw.ndim == 0:
        return raw.reshape(1, 1)
    if raw.ndim == 1:
        return raw.reshape(1, -1)
    return raw.reshape(-1, raw.shape[-1])


def _raw_rows(ck, t: PlanTensor, r0: int, r1: int) -> np.ndarray:
    """Rows ``r0..r1`` as stored bytes (the output type equals the input type, rows are only regrouped)."""
    out = np.empty((r1 - r0, t.row_bytes), dtype=np.uint8)
    for s, i, n, pos in _overlaps(t, r0, r1):
        rows = _read_rows(ck, s.source, s.src_row + i, n).view(np.uint8).reshape(n, -1)
        if rows.shape[1] != t.row_bytes:
            raise AssertionError(f"{s.source}: row of {rows.shape[1]} bytes, {t.name} needs {t.row_bytes}")
        _check_finite_raw(rows, ck[s.source].dtype, s, i)
        out[pos: pos + n] = rows
        del rows
    return out


def _int_rows(ck, t: PlanTensor, r0: int, r1: int) -> np.ndarray:
    """Rows ``r0..r1`` of an integer index table as I32 (values outside int32 are an input error)."""
    out = np.empty((r1 - r0, t.shape[-1] if t.shape else 1), dtype="<i4")
    for s, i, n, pos in _overlaps(t, r0, r1):
        rows = _read_rows(ck, s.source, s.src_row + i, n)
        if rows.size and (rows.min() < np.iinfo(np.int32).min or rows.max() > np.iinfo(np.int32).max):
            raise InputError(f"index values {rows.min()}..{rows.max()} do not fit llama.cpp's I32",
                             path=None, where=f"tensor {s.source}", fix="check the checkpoint's index table")
        out[pos: pos + n] = rows.reshape(n, -1)
    return out.view(np.uint8).reshape(-1)


def _check_finite_raw(rows: np.ndarray, dtype: str, s: Segment, first: int) -> None:
    if dtype not in FLOAT_DTYPES:
        return
    x = _decode(raw_view(rows, dtype), dtype)
    _check_finite(x, s, first)


def _check_finite(x: np.ndarray, s: Segment, first: int) -> None:
    with np.errstate(invalid="ignore"):
        if np.isfinite(x.max()) and np.isfinite(x.min()):
            return
    r, c = (int(v) for v in np.argwhere(~np.isfinite(x))[0])
    raise InputError(f"non-finite value {x[r, c]} at row {s.src_row + first + r}, column {c}",
                     path=None, where=f"tensor {s.source}",
                     fix="the checkpoint is corrupt or was saved from a diverged run; fix or drop that tensor")


def _decode(raw: np.ndarray, dtype: str) -> np.ndarray:
    if dtype in FLOAT_DTYPES:
        return decode_float32(raw, dtype)

    return dequantize(np.asarray(raw), dtype)


def _decode_into(dst: np.ndarray, raw: np.ndarray, dtype: str) -> bool:
    """Decode ``raw`` straight into the float32 rows ``dst`` (no temporaries for the float types); returns True when
    the decode also found every value finite (BF16: one compiled pass does both), False when that is unknown."""
    if dtype == "BF16" and raw.dtype == np.uint16:
        return bf16_to_float32(raw.reshape(dst.shape), dst)
    if dtype in FLOAT_DTYPES:
        np.copyto(dst, raw.reshape(dst.shape), casting="unsafe")
    else:
        dst[...] = _decode(raw, dtype).reshape(dst.shape)
    return False


def _lora_rows(lora: tuple, rows: np.ndarray) -> np.ndarray:
    """``alpha/r * B[rows] @ A`` in float32: the adapter's delta for these rows of the adapted weight."""
    return lora_delta(lora, rows, _checkpoint)


def _post(rows: np.ndarray, s) -> None:
    """A segment's llama.cpp transform (:mod:`ktconvert.convert.transforms`), in place on its decoded rows."""
    if s.col_tile:
        rows[...] = tile_columns(rows, s.col_tile)
    if s.value == "add_one":
        rows += np.float32(1.0)
    elif s.value == "neg_exp":
        np.negative(np.exp(rows, out=rows), out=rows)


def _bf16_rows(ck, t: PlanTensor, r0: int, r1: int) -> np.ndarray | None:
    """Rows ``r0..r1`` of ``t`` as their stored bf16 bits (uint16), when every segment is whole rows of a plain
    BF16 tensor (no scale, LoRA, column pick or value map): a kt-amx expert from a BF16 checkpoint, which the
    packer reads as it is stored. ``None`` for any other source. Not checked for NaN/Inf (the packer does)."""
    segs = list(_overlaps(t, r0, r1))
    if not segs or not all(s.op == "rows" and not (s.scale or s.lora or s.col_step or s.col_tile or s.value)
                           and ck[s.source].dtype == "BF16" for s, *_ in segs):
        return None
    cols = t.shape[-1]
    if len(segs) == 1 and segs[0][2] == r1 - r0:  # the buffer itself, valid until the next read
        s, i, n, _ = segs[0]
        return _read_rows(ck, s.source, s.src_row + i, n).view(np.uint16).reshape(n, cols)
    out = np.empty((r1 - r0, cols), np.uint16)
    for s, i, n, pos in segs:
        out[pos: pos + n] = _read_rows(ck, s.source, s.src_row + i, n).view(np.uint16).reshape(n, cols)
    return out


def _float_rows(ck, t: PlanTensor, r0: int, r1: int, buf: ReadBuffer | None = None) -> np.ndarray:
    """Rows ``r0..r1`` of the output tensor as float32, assembled from the segments; a NaN/Inf is reported at
    its place in the input tensor, before anything is quantized or written. ``buf``: the memory to build them in
    (valid until its next use), else a new array."""
    n_out = t.shape[-1] if t.shape else 1
    shape = (r1 - r0, n_out)
    x = np.empty(shape, np.float32) if buf is None else buf.take(4 * shape[0] * shape[1]).view(np.float32).reshape(shape)
    placed = []
    checked = True  # every row of x decoded by a pass that found it finite: no second pass needed
    for s, i, n, pos in _overlaps(t, r0, r1):
        dtype = ck[s.source].dtype
        idx = None
        if s.scale:  # a quantized release weight: exact decoding of these rows (and their scales) only
            w = ck.packed.get(s.source) or fp8.weight(ck, s.source, s.scale, s.block, s.fmt or "FP8")
            if s.op == "transpose":  # a stacked fused weight (gpt-oss MXFP4): its stored rows, no transpose made
                step = s.col_step or 1
                x[pos: pos + n] = quantized.read_cols(ck, w, s.expert, s.src_col + i * step,
                                                      s.src_col + (i + n) * step, step)
            elif s.op == "rows":
                x[pos: pos + n] = quantized.read_rows(ck, w, s.src_row + i, s.src_row + i + n)
            elif s.op == "block_t":
                x[pos: pos + n] = quantized.read_rows(ck, w, s.src_row, s.src_row + s.t_rows).T[i: i + n]
            else:
                half = s.rows // s.heads // 2
                head, rem = np.divmod(np.arange(i, i + n), 2 * half)
                idx = head * 2 * half + (rem % 2) * half + rem // 2
                x[pos: pos + n] = quantized.read_row_ids(ck, w, idx)
        elif s.op == "rows" and s.col_step:  # every col_step-th column from src_col (an interleaved bias)
            cols = s.src_col + np.arange(n_out) * s.col_step
            x[pos: pos + n] = _decode(_read_rows(ck, s.source, s.src_row + i, n)[:, cols], dtype)
        elif s.op == "rows":
            checked = _decode_into(x[pos: pos + n], _read_rows(ck, s.source, s.src_row + i, n), dtype) and checked
            if s.lora:
                x[pos: pos + n] += _lora_rows(s.lora, np.arange(s.src_row + i, s.src_row + i + n))
        else:
            if s.op == "kt-amx":

                part = dequant_rows(ck, s, i, n)
            elif s.op == "transpose":
                slab = ck.read(s.source)[s.expert]
                step = s.col_step or 1
                part = _decode(slab[:, s.src_col + i * step: s.src_col + (i + n) * step: step], dtype).T
            elif s.op == "block_t":  # columns of a block of source rows (MLA's k_b per head)
                block = _rows2d(ck, s.source)[s.src_row: s.src_row + s.t_rows]
                part = _decode(block, dtype).T[i: i + n]
            else:  # permute: llama.cpp's rope row order within each head (convert_hf_to_gguf's LlamaModel.permute)
                src = _rows2d(ck, s.source)
                half = s.rows // s.heads // 2
                o = np.arange(i, i + n)
                head, rem = np.divmod(o, 2 * half)
                idx = head * 2 * half + (rem % 2) * half + rem // 2
                part = _decode(src[idx], dtype)
                if s.lora:
                    part = part + _lora_rows(s.lora, idx)
            part = part.reshape(n, -1)
            if part.shape[1] != n_out:
                raise AssertionError(f"{s.source}: rows of {part.shape[1]}, {t.name} needs {n_out}")
            x[pos: pos + n] = part
            del part
        if s.col_tile or s.value or s.lora or s.op != "rows" or s.scale or s.col_step:
            checked = False
        if s.col_tile or s.value:
            _post(x[pos: pos + n], s)
        placed.append((s, i, n, pos, idx))
    if checked and placed:
        return x
    with np.errstate(invalid="ignore"):
        finite = np.isfinite(x.max()) and np.isfinite(x.min())
    if not finite:
        r, c = (int(v) for v in np.argwhere(~np.isfinite(x))[0])
        s, i, n, pos, idx = next(p for p in placed if p[3] <= r < p[3] + p[2])
        k = i + r - pos
        at = {"rows": lambda: f"row {s.src_row + k}, column {s.src_col + c * s.col_step if s.col_step else c}",
              "transpose": lambda: f"expert {s.expert}, row {c}, column {s.src_col + k * (s.col_step or 1)}",
              "kt-amx": lambda: f"row {s.src_row + k}, column {c} (dequantized)",
              "block_t": lambda: f"row {s.src_row + c}, column {k}",
              "permute": lambda: f"row {int(idx[r - pos])}, column {c}"}[s.op]()
        raise InputError(f"non-finite value {x[r, c]} at {at}", path=None, where=f"tensor {s.source}",
                         fix="the checkpoint is corrupt or was saved from a diverged run; fix or drop that tensor")
    return x
