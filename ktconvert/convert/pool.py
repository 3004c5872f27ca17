"""The worker processes of a local ``quantize -j N`` run, started before the run is planned.

A worker's start-up is a second or so of CPU that converts nothing: the interpreter, numpy and the worker module,
then numba's machinery on the first compiled call. Started when the run's settings are known and before its plan is
made (:func:`workers_started`), a worker starts on the second core while the converting process plans on the first,
and is ready when the first unit reaches it. The run's executor takes that pool (:func:`worker_pool`); a pool that
no run took (the planning failed, nothing to convert) is shut down when the block ends.
"""

from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager

from ktconvert.convert.worker import interrupts_deferred, worker_context, worker_init, worker_warm_up

_STARTED: list[tuple[int, ProcessPoolExecutor]] = []  # (workers, pool): started ahead, not yet taken by a run


def _new_pool(workers: int) -> ProcessPoolExecutor:
    return ProcessPoolExecutor(max_workers=workers, mp_context=worker_context(), initializer=worker_init,
                               initargs=(os.getpid(),))


@contextmanager
def workers_started(jobs: int, executor: str = "local"):
    """Start the ``jobs - 1`` worker processes of a local run now (none for ``jobs`` 1, nor for another
    ``executor``, whose tasks run elsewhere): each imports what it converts with and loads numba's machinery while
    the block plans the run. :func:`worker_pool` hands them to the run; when the block ends, a pool no run took is
    shut down (its workers end once started)."""
    workers = jobs - 1 if executor == "local" else 0
    if workers < 1:
        yield
        return
    pool = _new_pool(workers)
    entry = (workers, pool)
    _STARTED.append(entry)
    try:
        for _ in range(workers):  # a spawn pool starts a process per task it cannot give an idle one
            with interrupts_deferred():  # not inside submit (see interrupts_deferred)
                pool.submit(worker_warm_up)
        yield
    finally:
        if entry in _STARTED:
            _STARTED.remove(entry)
            pool.shutdown(wait=True, cancel_futures=True)


def worker_pool(workers: int) -> ProcessPoolExecutor:
    """A pool of ``workers`` worker processes for the run about to convert: the one :func:`workers_started` began,
    when it has that many, else a new one. The caller shuts it down."""
    for entry in _STARTED:
        if entry[0] == workers:
            _STARTED.remove(entry)
            return entry[1]
    return _new_pool(workers)
