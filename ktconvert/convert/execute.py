"""Carry out a plan: bounded memory, ``jobs`` processes, written under a temporary name, resumable.

The output directory is built as a hidden sibling, ``.NAME.ktconvert-partial``, and renamed to ``NAME`` only
when every byte is written, checked and recorded in ``manifest.json``; nothing with the final name is ever
partial. Every output file is laid out in full before any data (headers written, size set), so units of work
(runs of rows of one tensor, sized from ``max_memory``) can be written at their offsets in any order, by any
process. A journal in the partial directory records finished units, only after their bytes have been
flushed to disk, with a hash of the input bytes each one read; ``resume`` re-checks the plan's fingerprint
against the interrupted run's, re-hashes the input of every finished unit (a byte changed under a kept mtime
would otherwise end up half old, half new) and does only the units the journal does not list.

``executor="ray"`` runs the same units as Ray tasks on a cluster (:mod:`ktconvert.cluster`), ``jobs`` at a time,
each asking Ray for one CPU and the ``max_memory / jobs`` share the units were sized to; each task writes its unit
at its offset in the shared partial directory and fsyncs it before it reports done; the journal, the manifest and
the rename stay on the driver. The partial directory does not say which executor made it, so ``resume`` continues
a local run on Ray and the other way round; the bytes are the same whoever wrote them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import time
from collections import deque
from contextlib import ExitStack
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ktconvert import __version__
from ktconvert.convert.plan import Plan, PlanTensor
from ktconvert.convert.pool import worker_pool
from ktconvert.convert.provenance import git_commit, recipe_sha256
from ktconvert.io.sizes import format_size
from ktconvert.convert.worker import (WRITE_HOOK, Group, Task, close_all, interrupts_deferred, reads_are_ranges,
                                      run_group, run_group_synced, source_digest, source_ranges)
from ktconvert.errors import EnvironmentProblem, InputError, UsageProblem
from ktconvert.formats import open_checkpoint
from ktconvert.io.atomic import (WRITE_ERRNOS, FileSha256, fsync_dir, partial_dir, replace_dir, sha256_file,
                                 write_durable, write_failure)
from ktconvert.io.files import ReadBuffer
from ktconvert.io.dtypes import FLOAT_DTYPES

STATE_DIR = ".ktconvert"
#: Units of one output are run in groups reading at least this much, read with O_DIRECT (the bytes straight from the
#: disk into the process's buffer: no page cache copy, no page cache pages allocated and freed for bytes read once):
#: consecutive units joined until they read this much (a kt-amx expert reads 3 MiB), a larger unit alone. A thread
#: does each read of a group one ahead of its use (worker.py, ``_reading_ahead``; a large unit read in chunks of
#: ``READ_AHEAD_CHUNK`` it converts one by one), so only the group's first read is waited for. Units left over at
#: the end of a run of such units, short of this much, read through the page cache one by one, where
#: :class:`_Prefetch` has the kernel read them while the unit before converts. Several outputs from one read
#: (``--output``) are grouped the same way, their units reading the same bytes one after the other and those bytes
#: read once (:func:`group_units`).
DIRECT_MIN = 16 * 1024**2
UNIT_CAP = 256 * 1024**2  # bytes of working set per unit at most: keeps progress and resume fine-grained
#: bytes of written output the converting process keeps for the output hashes at most (:meth:`_OutputHashes.written`)
HELD_MAX = 64 * 1024**2
SYNC_EVERY_S = 1.0
#: what a Ray worker process holds besides its unit (Python, ray, numpy, torch, ktconvert): its task asks Ray for
#: ``max_memory / jobs`` in all, so its units get that share less this. Measured: 301-345 MiB peak converting the
#: tiny model (tests/test_ray.py), about 80 MiB for an idle worker.
RAY_WORKER_RESERVE = 384 * 1024**2

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class Unit:
    id: int
    tensor: int
    r0: int
    r1: int
    in_bytes: int


@dataclass
class RunResult:
    """What a finished run did: the output directory, its manifest, and how much work this run did."""

    out: Path
    manifest: dict
    units: int
    units_resumed: int
    seconds: float
    in_bytes: int


def make_units(plan: Plan, max_memory: int, jobs: int, reserve: int = 0, *, shared: bool = False) -> list[Unit]:
    """Split every tensor into runs of rows whose working set fits ``max_memory / jobs`` (and :data:`UNIT_CAP`).

    The working set of a converted row is its float32 copy twice (decode and assembly) plus its input and output
    bytes; a copied row is its bytes once, plus two float32 copies when it is a float checked for NaN/Inf. The budget is halved once more for numpy's transient copies.
    ``reserve``: bytes of each job's share its process needs for itself (:data:`RAY_WORKER_RESERVE` for a Ray
    task, whose memory request is the whole share). ``shared``: the units of one output of several
    (:func:`execute_all`): no unit spans two segments (of a tensor stacked from several source tensors, such as
    the experts of a layer), so the outputs' units read the same bytes, which their group reads once
    (:func:`group_units`).
    """
    jobs = max(1, jobs)
    widest = max((_row_working_set(plan, t) for t in plan.tensors), default=0) * 2
    need = widest * jobs + reserve * jobs
    if max_memory < need:
        least = f"{-(-need // 1024)}KiB" if need < 2**30 else f"{-(-need // 2**20)}MiB"
        per = f", with {format_size(reserve)} for each Ray worker process," if reserve else ""
        raise UsageProblem(f"--max-memory {format_size(max_memory)} is below the minimum {least}: one row of the "
                           f"widest tensor with {jobs} job(s){per} needs that much", fix=f"pass --max-memory {least} or more")
    budget = max(1, min(UNIT_CAP, (max_memory // jobs - reserve) // 2))
    units = []
    for ti, t in enumerate(plan.tensors):
        rows = t.rows if t.shape else 1
        if t.const is not None:
            units.append(Unit(len(units), ti, 0, 1, 0))
            continue
        if t.written_by is not None:  # kt-amx: its group's lead unit writes it
            continue
        if t.kt_pack is not None:  # kt-amx: one expert projection, all parts, is one unit
            units.append(Unit(len(units), ti, 0, 1, plan.segment_bytes(t)))
            continue
        in_row = plan.segment_bytes(t) // rows if rows else 0
        step = max(1, budget // max(1, _row_working_set(plan, t)))
        cuts = sorted({s.start for s in t.segments if 0 < s.start < rows}) if shared else []
        for a, b in zip([0, *cuts], [*cuts, rows]):
            for r0 in range(a, b, step):
                r1 = min(b, r0 + step)
                units.append(Unit(len(units), ti, r0, r1, in_row * (r1 - r0)))
    return units


def ray_task_memory(max_memory: int, jobs: int) -> int:
    """The memory one Ray task asks for: its share of ``max_memory``, which :func:`make_units` sized the units to
    fit together with the worker process itself (:data:`RAY_WORKER_RESERVE`)."""
    return max(1, max_memory // max(1, jobs))


def _row_working_set(plan: Plan, t: PlanTensor) -> int:
    """Bytes one row of ``t`` needs while it is converted (see :func:`make_units`); 0 for what is not split."""
    if t.const is not None or t.written_by is not None or t.kt_pack is not None:
        return 0
    rows = t.rows if t.shape else 1
    in_row = plan.segment_bytes(t) // rows if rows else 0
    row_len = t.shape[-1] if t.shape else 1
    per_row = (in_row + t.row_bytes) if t.copy_bytes else (8 * row_len + in_row + t.row_bytes)
    if t.copy_bytes and t.src_dtype in FLOAT_DTYPES:  # copied floats are decoded once for the NaN/Inf check
        per_row += 8 * row_len
    return per_row


def input_roots(src: Path, files: list[Path]) -> list[Path]:
    """What counts as input for the OUT guard: the input files, and the checkpoint directory or shard set's folder."""
    roots = list(files)
    if src.resolve().is_dir():
        roots.append(src)
    elif len(files) > 1:
        roots.append(Path(files[0]).parent)
    return roots


class _State:
    """The partial directory's bookkeeping: plan fingerprint, unit list, journal of finished units."""

    def __init__(self, partial: Path):
        self.dir = partial / STATE_DIR
        self.state = self.dir / "state.json"
        self.journal = self.dir / "journal"

    def create(self, plan: Plan, units: list[Unit], fingerprint: str) -> None:
        self.dir.mkdir(parents=True)
        data = {"version": __version__, "fingerprint": fingerprint, "source": plan.source, "sources": plan.sources,
                "units": [[u.tensor, u.r0, u.r1, u.in_bytes] for u in units]}
        write_durable(self.state, json.dumps(data).encode())
        write_durable(self.journal, b"")

    def load(self, plan: Plan, fingerprint: str, where: Path) -> tuple[list[Unit], dict[int, str]]:
        """The units and the finished ones (id -> input digest), or :class:`InputError` saying why the
        interrupted run cannot be continued with this plan."""
        try:
            data = json.loads(self.state.read_text())
            units = [Unit(i, *u) for i, u in enumerate(data["units"])]
            done = {}
            for line in self.journal.read_text().splitlines():
                uid, digest = line.split()
                done[int(uid)] = digest
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise InputError(f"the interrupted run's state is unreadable ({exc})", path=str(where),
                             fix="start over with --force") from None
        changed = _source_change(data.get("sources") or [], plan.sources)
        if changed:
            raise InputError(f"the input changed since the interrupted run: {changed}", path=plan.source,
                             fix="restore the input it was started from, or start over with --force")
        if data.get("fingerprint") != fingerprint:
            raise InputError("the interrupted run was planned differently (other input, recipe, format or version)",
                             path=str(where), fix="rerun it with the same options, or start over with --force")
        return units, done

    def record(self, ids: list[tuple[int, str]]) -> None:
        if not ids:
            return
        with open(self.journal, "a") as fh:
            fh.write("".join(f"{i} {d}\n" for i, d in ids))
            fh.flush()
            os.fsync(fh.fileno())


def _source_change(before: list[dict], now: list[dict]) -> str | None:
    """Why the input files recorded by the interrupted run are not the ones there now, or ``None``."""
    old = {f["file"]: f for f in before}
    for f in now:
        o = old.pop(f["file"], None)
        if o is None:
            return f"{f['file']} was not part of it"
        if o["bytes"] != f["bytes"]:
            return f"{f['file']} was {o['bytes']} bytes, now {f['bytes']}"
        if o["header_sha256"] != f["header_sha256"]:
            return f"the header of {f['file']} differs"
        if o["mtime_ns"] != f["mtime_ns"]:
            return f"{f['file']} was modified (its mtime differs)"
    if old:
        return f"{sorted(old)[0]} is gone"
    return None


def _check_done(plan: Plan, units: list[Unit], done: dict[int, str]) -> None:
    """Re-hash the input of every finished unit: refuse when a byte changed (even with size and mtime kept)."""
    ck = open_checkpoint(plan.source)
    for u in units:
        want = done.get(u.id)
        if want is None:
            continue
        t = plan.tensors[u.tensor]
        if source_digest(ck, t, u.r0, u.r1) != want:
            src = t.segments[0].source if t.segments else t.name
            raise InputError(f"the input changed since the interrupted run: the bytes {t.name} rows {u.r0}..{u.r1} "
                             f"were converted from differ now", path=plan.source, where=f"tensor {src}",
                             fix="restore the input it was started from, or start over with --force")


def _prepare_files(plan: Plan, partial: Path, fresh: bool) -> None:
    for f in plan.files:
        p = partial / f.name
        if fresh:
            with open(p, "wb") as fh:
                fh.write(f.header)
                fh.truncate(f.size)
                fh.flush()
                os.fsync(fh.fileno())
        else:
            ok = p.is_file() and p.stat().st_size == f.size
            if ok:
                with open(p, "rb") as fh:
                    ok = fh.read(len(f.header)) == f.header
            if not ok:
                raise InputError("an output file of the interrupted run is missing or not the planned one",
                                 path=str(p), fix="start over with --force")
    for name, data in plan.extra.items():
        write_durable(partial / name, data)


def execute(plan: Plan, out: str | Path, *, max_memory: int, jobs: int = 1, resume: bool = False,
            force: bool = False, progress: Progress | None = None, executor: str = "local") -> RunResult:
    """Write ``plan`` to the directory ``out``; see the module docstring for the guarantees.

    ``resume``: continue an interrupted run of the same plan (or start one if there is none). ``force``: discard
    an interrupted run and replace an existing ``out``. ``progress(done_bytes, total_bytes)`` counts input bytes.
    ``executor``: ``local`` (``jobs`` processes here) or ``ray`` (``jobs`` Ray tasks at a time, on the cluster
    :func:`ktconvert.cluster.connect` joined).
    """
    return execute_all([(plan, out)], max_memory=max_memory, jobs=jobs, resume=resume, force=force,
                       progress=progress, executor=executor)[0]


@dataclass
class _Output:
    """One output of a run: its plan, directory, partial directory, bookkeeping and units."""

    plan: Plan
    out: Path
    units: list[Unit] = field(default_factory=list)
    done: dict[int, str] = field(default_factory=dict)  # finished units: id -> input digest
    ready: dict | None = None  # the manifest of a run that finished but was not renamed

    def __post_init__(self):
        self.out = Path(self.out)
        self.partial = partial_dir(self.out)
        self.state = _State(self.partial)
        self.fingerprint = self.plan.fingerprint()
        self.paths = [str(self.partial / f.name) for f in self.plan.files]


def execute_all(outputs: list[tuple[Plan, str | Path]], *, max_memory: int, jobs: int = 1, resume: bool = False,
                force: bool = False, progress: Progress | None = None, executor: str = "local") -> list[RunResult]:
    """Write each plan to its directory from one pass over the source (``quantize --output``): every output is
    :func:`execute`'s, with its own partial directory, journal, manifest and rename, byte for byte what a run of
    that plan alone writes. The units of all outputs run together, those reading the same source tensors in one
    task (:func:`group_units`) that reads each of them once; ``max_memory`` covers them all. Nothing is written
    before every output is checked; each output is renamed only when all of them are complete."""
    outs = [_Output(plan, out) for plan, out in outputs]
    shared = len(outs) > 1
    t0 = time.monotonic()
    for o in outs:
        if o.partial.exists() and not resume and not force:
            raise UsageProblem("an interrupted conversion to this output exists", path=str(o.partial),
                               fix="pass --resume to continue it, or --force to start over")
    for o in outs:
        if o.partial.exists() and not resume:
            shutil.rmtree(o.partial)
        if o.partial.exists() and finished_output(o.partial, o.fingerprint):  # killed between the manifest and the rename
            o.ready = _read_manifest(o.partial)
    reserve = RAY_WORKER_RESERVE if executor == "ray" else 0
    try:
        for o in outs:
            if o.ready is not None:
                continue
            if o.partial.exists():
                o.units, o.done = o.state.load(o.plan, o.fingerprint, o.partial)
                _prepare_files(o.plan, o.partial, fresh=False)
                _check_done(o.plan, o.units, o.done)
            else:
                o.units = make_units(o.plan, max_memory, jobs, reserve, shared=shared)
        for o in outs:
            if o.ready is None and not o.partial.exists():
                _check_space(o.plan, o.out)
        for o in outs:
            if o.ready is None and not o.partial.exists():
                o.partial.mkdir(parents=True)
                o.state.create(o.plan, o.units, o.fingerprint)
                _prepare_files(o.plan, o.partial, fresh=True)
                fsync_dir(o.partial.parent)
        todo = [(k, u) for k, o in enumerate(outs) for u in o.units if u.id not in o.done]
        total = sum(u.in_bytes for o in outs for u in o.units)
        done_bytes = total - sum(u.in_bytes for _, u in todo)
        if progress:
            progress(done_bytes, total)
        hashes = _OutputHashes(outs) if executor == "local" else None
        try:
            _run_units(outs, group_units(outs, todo), jobs, progress, done_bytes, total, executor, max_memory,
                       hashes)
        except BaseException as exc:
            close_all()
            if hashes is not None:
                hashes.abort()
            if isinstance(exc, InputError):
                for o in outs:
                    shutil.rmtree(o.partial, ignore_errors=True)  # bad input: nothing to resume
            raise
        finally:
            close_all()
        manifests = [o.ready if o.ready is not None else
                     _finish(o.plan, o.partial, o.fingerprint, hashes.digests(k) if hashes else None)
                     for k, o in enumerate(outs)]
        for o, m in zip(outs, manifests):
            _publish(o.partial, o.out, force, m)
    except (OSError, BrokenProcessPool, EnvironmentProblem) as exc:  # the environment failed: one line, no partial output
        close_all()
        if isinstance(exc, OSError) and exc.errno not in WRITE_ERRNOS:
            raise
        if not resume:  # kept only when --resume was asked, to continue from
            for o in outs:
                shutil.rmtree(o.partial, ignore_errors=True)
        if isinstance(exc, EnvironmentProblem):  # a Ray worker lost for good, OUT not visible on a node, no space
            raise
        if isinstance(exc, BrokenProcessPool):
            raise EnvironmentProblem(
                "a worker process died (killed, or out of memory); the run stopped",
                path=", ".join(str(o.out) for o in outs),
                fix=("rerun with --resume" if resume else "rerun") + ", with fewer --jobs or a smaller --max-memory "
                "if memory ran out") from None
        raise write_failure(exc, _failed_output(outs, exc), resumable=resume) from None
    seconds = time.monotonic() - t0
    results = []
    for k, (o, m) in enumerate(zip(outs, manifests)):
        mine = [u for j, u in todo if j == k]
        results.append(RunResult(o.out, m, len(mine), len(o.done), seconds, sum(u.in_bytes for u in mine)))
    return results


def _failed_output(outs: list[_Output], exc: OSError) -> Path:
    """The output a write error belongs to (the one whose directory holds the file it names; else the first)."""
    name = os.path.abspath(exc.filename) if isinstance(exc.filename, str) else ""
    for o in outs:
        if name.startswith(os.path.abspath(o.partial) + os.sep) or name == os.path.abspath(o.partial):
            return o.out
    return outs[0].out


def group_units(outs: list, todo: list[tuple[int, Unit]]) -> list[Group]:
    """The units to run (``(output index, unit)``) as :class:`Group` s. Units that hash the bytes they read
    (:func:`reads_are_ranges`) are joined into groups reading at least :data:`DIRECT_MIN` bytes per output, read
    around the page cache, every read one ahead of its use (:attr:`Task.direct`, worker.py's ``_reading_ahead``);
    every other unit, and a run's last units short of that, alone through the page cache. One output's units keep
    their plan order. Several outputs' units are put in the order of the bytes they read, those reading the same
    bytes one after the other (the outputs' units of one expert's projection: a several-output run cuts units at
    source-tensor boundaries), so their group reads those bytes once for all of them (:class:`ReadAhead` reads a
    read announced twice in a row once), and no group ends between them."""

    def task(k: int, u: Unit, direct: bool = False) -> tuple[int, Task]:
        o = outs[k]
        t: PlanTensor = o.plan.tensors[u.tensor]
        return k, Task(u.id, o.plan.source, o.paths[t.file], t, u.r0, u.r1, direct=direct)

    if len(outs) == 1:
        return _direct_groups(outs, todo, task, DIRECT_MIN)
    ck = open_checkpoint(outs[0].plan.source)
    first = {}
    for k, u in todo:
        r = source_ranges(ck, outs[k].plan.tensors[u.tensor], u.r0, u.r1)
        first[(k, u.id)] = (r[0][0], r[0][1]) if r else ("", -1)
    todo = sorted(todo, key=lambda ku: first[(ku[0], ku[1].id)])  # stable: the outputs in order for the same bytes
    return _direct_groups(outs, todo, task, DIRECT_MIN * len(outs), lambda k, u: first[(k, u.id)])


def _direct_groups(outs: list, todo: list[tuple[int, Unit]], task, least: int, where=None) -> list[Group]:
    """``todo`` (in the order to run) as groups: consecutive units that hash what they read (:func:`reads_are_ranges`)
    joined until they read ``least`` bytes, read around the page cache; every other unit, and a run's last units
    short of that, alone through the page cache. ``where(k, u)``: where a unit's reads start; a group does not end
    between units whose reads start at the same place (they read the same bytes)."""
    groups: list[Group] = []
    run: list[tuple[int, Unit]] = []

    def flush() -> None:
        if sum(u.in_bytes for _, u in run) >= least:
            groups.append(Group(tuple(task(k, u, True) for k, u in run)))
        else:
            groups.extend(Group((task(k, u),)) for k, u in run)
        run.clear()

    for k, u in todo:
        t = outs[k].plan.tensors[u.tensor]
        if not reads_are_ranges(t, u.r0, u.r1):
            flush()
            groups.append(Group((task(k, u),)))
            continue
        if run and sum(v.in_bytes for _, v in run) >= least and (where is None or where(k, u) != where(*run[-1])):
            flush()
        run.append((k, u))
    flush()
    return groups


def _check_space(plan: Plan, out: Path) -> None:
    """Refuse before writing when the disk holding OUT has less free space than the output needs."""
    where = out.parent
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        free = shutil.disk_usage(where).free
    except OSError:
        return
    if free < plan.out_bytes:
        raise EnvironmentProblem(f"the output needs {format_size(plan.out_bytes)}, the disk holding it has "
                                 f"{format_size(free)} free", path=str(out),
                                 fix="free space on that disk, or choose an OUT on another disk")


def _run_units(outs: list[_Output], groups: list[Group], jobs: int, progress, done_bytes, total,
               executor: str = "local", max_memory: int = 0, hashes: _OutputHashes | None = None):
    """Run the groups (``jobs`` at a time), journaling each unit in its output's journal once its bytes are on
    disk; on any failure what is done stays journaled, for ``--resume``. ``hashes`` hashes each output file's
    finished prefix as units complete."""
    paths = [p for o in outs for p in o.paths]
    if executor == "ray":  # workers elsewhere: absolute paths (the same on every node), and a run id for their caches
        run = os.urandom(8).hex()
        groups = [Group(tuple((k, dataclasses.replace(t, src=os.path.abspath(t.src),
                                                      out_path=os.path.abspath(t.out_path), run=run))
                              for k, t in g.tasks)) for g in groups]
    unit_bytes = {(k, u.id): u.in_bytes for k, o in enumerate(outs) for u in o.units}
    pending: list[list[tuple[int, str]]] = [[] for _ in outs]
    last_sync = time.monotonic()

    def record() -> None:
        _sync(paths)
        for o, p in zip(outs, pending):
            o.state.record(p)
            p.clear()

    def finished(results: list[tuple[int, int, str]]):
        nonlocal done_bytes, last_sync
        for k, uid, digest in results:
            pending[k].append((uid, digest))
            done_bytes += unit_bytes[(k, uid)]
            if hashes is not None:
                hashes.finished(k, uid)
        now = time.monotonic()
        if now - last_sync >= SYNC_EVERY_S:
            record()
            last_sync = now
        if progress:
            progress(done_bytes, total)

    if executor == "ray":
        from ktconvert import cluster

        try:
            cluster.run_tasks(cluster.connect(), run_group_synced, groups, limit=jobs, on_done=finished,
                              memory=ray_task_memory(max_memory, jobs), name="ktconvert-unit")
        except BaseException:  # as below: every unit reported done is journaled; the others run again on --resume
            for o, p in zip(outs, pending):
                o.state.record(p)
            raise
    else:
        from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

        # This process converts units in one thread of its own while its main thread journals, fsyncs and hashes
        # the output (calls that wait on the disk: the conversion goes on meanwhile). With jobs > 1, jobs - 1
        # worker processes besides: this process has imported everything already, so a worker's start-up
        # (interpreter, numpy, ktconvert, numba: about a CPU-second) and its fixed memory are paid once less. Its
        # unit thread alone uses the worker module's buffers here.
        queue = deque(groups)
        ahead = _Prefetch(outs)
        WRITE_HOOK[0] = hashes.written if hashes is not None else None
        workers = jobs - 1 if len(groups) > 1 else 0
        with ExitStack() as stack:
            here = stack.enter_context(ThreadPoolExecutor(max_workers=1, thread_name_prefix="ktconvert-unit"))
            executors = [(here, 2)]
            if workers:
                executors.append((stack.enter_context(worker_pool(workers)), 2 * workers))
            inflight: dict = {}  # future -> the executor it runs on
            try:
                while queue or inflight:
                    for ex, cap in executors:
                        while queue and sum(1 for e in inflight.values() if e is ex) < cap:
                            ahead([queue[0]])
                            with interrupts_deferred():  # not inside submit: see interrupts_deferred
                                inflight[ex.submit(run_group, queue.popleft())] = ex
                    ready, _ = wait(inflight, return_when=FIRST_COMPLETED)
                    for f in [f for f in inflight if f in ready]:  # in submission order: a failure stops after
                        inflight.pop(f)                             # every unit done before it is recorded
                        finished(f.result())
            except BaseException:  # Ctrl-C, a full disk, a dead worker: what is done stays done for --resume
                for f in inflight:
                    f.cancel()
                for ex, _ in reversed(executors):
                    ex.shutdown(wait=True, cancel_futures=True)
                record()
                raise
            finally:
                ahead.close()
                WRITE_HOOK[0] = None
    record()


class _Prefetch:
    """Ask the kernel to start reading the input of groups about to run (``posix_fadvise WILLNEED``, from a thread
    of its own: the call itself waits while the kernel queues the reads), so a unit's cold read overlaps the
    conversion of the one before instead of stalling it (the units' reads are a few MB, far more than the kernel's
    own readahead window). Page cache only: no memory of this process."""

    def __init__(self, outs: list[_Output]):
        import queue
        import threading

        self._ck = open_checkpoint(outs[0].plan.source) if outs and hasattr(os, "posix_fadvise") else None
        self._seen: set[int] = set()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        if self._ck is not None:
            threading.Thread(target=self._work, name="ktconvert-prefetch", daemon=True).start()

    def _work(self) -> None:
        fds: dict[str, int] = {}
        try:
            while (job := self._queue.get()) is not None:
                path, offset, length = job
                try:
                    fd = fds.get(path)
                    if fd is None:
                        fd = fds[path] = os.open(path, os.O_RDONLY)
                    os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
                except OSError:  # only a hint: the unit's own read reports a real problem
                    pass
        finally:
            for fd in fds.values():
                os.close(fd)

    def __call__(self, groups: list[Group]) -> None:
        if self._ck is None:
            return
        for g in groups:
            if id(g) not in self._seen:
                self._seen.add(id(g))
                for _, task in g.tasks:
                    if task.direct:  # read around the page cache: what the kernel read ahead would go unused
                        continue
                    for r in source_ranges(self._ck, task.tensor, task.r0, task.r1):
                        self._queue.put(r)

    def close(self) -> None:
        if self._ck is not None:
            self._queue.put(None)


def _unit_span(t: PlanTensor, u: Unit) -> tuple[int, int]:
    """The bytes ``[start, end)`` of its output file that unit ``u`` of ``t`` writes."""
    if t.const is not None:
        return t.offset, t.offset + t.nbytes
    if t.kt_pack is not None:  # the whole group, every part's weight and scale end to end
        return t.offset, t.offset + t.kt_pack[5]
    return t.offset + u.r0 * t.row_bytes, t.offset + u.r1 * t.row_bytes


class _OutputHashes:
    """The manifest's sha256 of every output file, hashed by a thread of the converting process while the units run:
    each file up to its first unit not yet written (headers and gaps are final from the start), so the hashing
    overlaps the conversion (hashlib and the reads release the GIL) instead of reading every output again once it
    is done. Local runs only: the units' bytes are in this host's page cache (a Ray worker's may not be visible
    here before the end)."""

    def __init__(self, outs: list[_Output]):
        import queue
        import threading

        buf = ReadBuffer()  # one read buffer for every file's hasher (one thread uses them)
        self._held: dict[str, dict[int, bytes]] = {}  # output file -> bytes this process wrote, by offset
        self._files: dict[tuple[int, int], list] = {}  # (output, file) -> [hasher, sorted unit spans, next span]
        self._file_of: dict[tuple[int, int], tuple[int, int]] = {}
        self._done: set[tuple[int, int]] = set()
        for k, o in enumerate(outs):
            if o.ready is not None:
                continue
            spans: dict[int, list] = {}
            for u in o.units:
                t = o.plan.tensors[u.tensor]
                spans.setdefault(t.file, []).append((*_unit_span(t, u), u.id))
                self._file_of[(k, u.id)] = (k, t.file)
            for fi, f in enumerate(o.plan.files):
                self._files[(k, fi)] = [FileSha256(o.partial / f.name, buf=buf, direct=True),
                                        sorted(spans.get(fi, [])), 0]
                self._held[o.paths[fi]] = {}
            self._done.update((k, uid) for uid in o.done)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._error: list[BaseException] = []
        self._thread = threading.Thread(target=self._work, name="ktconvert-sha256", daemon=True)
        self._thread.start()

    def written(self, path: str, offset: int, views: list) -> None:
        """From this process's unit thread (worker.py ``WRITE_HOOK``): bytes it has just written at ``offset`` of
        ``path``, kept (a copy: its buffers are reused) until the hasher reaches them, which then takes them from
        memory instead of reading them back from the disk (they were written around the page cache); at most
        :data:`HELD_MAX` bytes kept, beyond that the hasher reads them back."""
        held = self._held.get(path)
        if held is None:
            return
        n = sum(len(v) for v in views)
        if n + sum(len(b) for d in list(self._held.values()) for b in list(d.values())) <= HELD_MAX:
            held[offset] = b"".join(views)

    def _work(self) -> None:
        while (job := self._queue.get()) is not None:
            if not self._error:
                try:
                    job[0].advance(job[1], self._held.get(str(job[0].path)))
                except BaseException as exc:  # raised again by digests(), in the converting thread
                    self._error.append(exc)

    def finished(self, k: int, uid: int) -> None:
        """Unit ``uid`` of output ``k`` is written: hash its file up to the first unit that is not."""
        self._done.add((k, uid))
        entry = self._files[self._file_of[(k, uid)]]
        h, spans, i = entry
        while i < len(spans) and (k, spans[i][2]) in self._done:
            i += 1
        if i > entry[2]:
            entry[2] = i
            self._queue.put((h, spans[i][0] if i < len(spans) else None))

    def abort(self) -> None:
        """The run failed: drop what is queued, stop the thread."""
        self._error.append(RuntimeError("the run stopped"))
        self.close()

    def close(self) -> None:
        """Stop the thread after what is queued."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def digests(self, k: int) -> dict[str, str]:
        """Output ``k``'s files -> sha256, every unit written."""
        self.close()
        if self._error:
            raise self._error[0]
        out = {}
        for (kk, _), (h, _, _) in self._files.items():
            if kk == k:
                h.advance(None, self._held.get(str(h.path)))
                out[Path(h.path).name] = h.hexdigest()
        return out


def _sync(paths: list[str]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _finish(plan: Plan, partial: Path, fingerprint: str, digests: dict[str, str] | None = None) -> dict:
    """Check the files' sizes, hash them (or take ``digests``, their sha256 hashed while they were written) and
    write manifest.json; the bookkeeping goes. Returns the manifest."""
    files = {}
    for f in plan.files:
        p = partial / f.name
        if p.stat().st_size != f.size:
            raise EnvironmentProblem(f"{f.name} is {p.stat().st_size} bytes, planned {f.size}", path=str(p),
                                     fix="the disk or another process changed it; start over with --force")
        files[f.name] = {"bytes": f.size, "sha256": digests[f.name] if digests else sha256_file(p)}
    for name, data in plan.extra.items():
        files[name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest = build_manifest(plan, files, fingerprint)
    write_durable(partial / "manifest.json", (json.dumps(manifest, indent=1) + "\n").encode())
    shutil.rmtree(partial / STATE_DIR)
    fsync_dir(partial)
    return manifest


def _read_manifest(partial: Path) -> dict:
    return json.loads((partial / "manifest.json").read_text())


def finished_output(partial: Path, fingerprint: str) -> bool:
    """A directory a run of this plan completed (manifest written, bookkeeping removed, every file as it records):
    a partial directory not yet renamed, or an output already renamed."""
    if (partial / STATE_DIR).exists() or not (partial / "manifest.json").is_file():
        return False
    try:
        m = _read_manifest(partial)
    except (OSError, ValueError):
        return False
    if m.get("plan", {}).get("fingerprint") != fingerprint:
        return False
    return all((partial / n).is_file() and (partial / n).stat().st_size == f["bytes"] and sha256_file(partial / n) == f["sha256"]
               for n, f in m.get("files", {}).items())


def _publish(partial: Path, out: Path, force: bool, manifest: dict) -> dict:
    replace_dir(partial, out, force=force)
    return manifest


def build_manifest(plan: Plan, files: dict, fingerprint: str) -> dict:
    """manifest.json: what was made, from what, how, with sha256 per file. Deterministic: no timestamps."""
    s = plan.summary()
    lead = next((t.kt_pack for t in plan.tensors if t.kt_pack is not None), None)
    extra = {"kt_amx": {"method": lead[0], "threadpool_count": lead[2]}} if lead else {}
    return {
        "kind": "ktconvert-manifest",
        "tool": {"name": "ktconvert", "version": __version__, **git_commit(), "command": "quantize"},
        "format": plan.format,
        "layout": "kt-amx" if lead else ("hf" if plan.format == "hf" else "kernel"),
        **extra,
        "source": {"path": plan.source, "container": plan.container, "arch": plan.arch,
                   "model_type": plan.model_type, "files": plan.sources},
        "recipe": {**plan.recipe.to_dict(), **({"sha256": digest} if (digest := recipe_sha256(plan.recipe)) else {})},
        **({"lora": plan.lora} if plan.lora else {}),
        **({"imatrix": plan.imatrix} if plan.imatrix else {}),
        "plan": {"fingerprint": fingerprint, "tensors": s["tensors"], "input_bytes": s["input_bytes"],
                 "output_bytes": s["output_bytes"], "types": s["types"], "tokenizer": plan.tokenizer,
                 "notes": plan.notes, "fallbacks": plan.fallbacks()},
        "files": files,
        "tensors": [{"name": t.name, "type": t.type, "shape": list(t.shape), "file": plan.files[t.file].name,
                     "offset": t.offset, "bytes": t.nbytes, **({"rule": t.rule} if t.rule is not None else {}),
                     **({"fallback_from": t.fallback_from} if t.fallback_from else {})}
                    for t in plan.tensors if t.const is None],
    }


def describe(result: RunResult) -> str:
    rate = result.in_bytes / result.seconds / 1e6 if result.seconds > 0 else 0.0
    resumed = f", {result.units_resumed} finished before resuming" if result.units_resumed else ""
    return (f"wrote {result.out} ({len(result.manifest['files'])} file(s), "
            f"{format_size(result.manifest['plan']['output_bytes'])}) in {result.seconds:.1f} s, "
            f"{rate:.0f} MB/s read{resumed}")


__all__ = ["RunResult", "Unit", "input_roots", "describe", "execute", "execute_all", "finished_output", "group_units", "make_units", "partial_dir", "ray_task_memory",
           "sha256_file"]
