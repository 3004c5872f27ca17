"""Ray, the one place ktconvert touches it: ``--executor ray`` runs conversion units and gate cases as Ray tasks.

Ray is an optional extra (``pip install 'ktconvert[ray]'``) and nothing imports it unless ``--executor ray`` is
asked; this module imports it only inside :func:`connect`. Fault tolerance is Ray's own: a task whose worker
process dies (killed, out of memory, its node lost) is run again, up to :data:`MAX_RETRIES` times, which is safe
because every task is idempotent (a conversion unit writes the same bytes at the same offsets). An exception a task
raises is never retried (a data error would only fail again), except :class:`TransientIOError`: a network-filesystem
hiccup, the one system failure that surfaces as an exception rather than as a dead worker.
"""

from __future__ import annotations

import errno
import logging
import socket
from collections import deque
from typing import Any, Callable, Iterable

from ktconvert.errors import EnvironmentProblem, UsageProblem
from ktconvert.optional import require

EXECUTORS = ("local", "ray")
MAX_RETRIES = 3
INSTALL = "pip install 'ktconvert[ray]'"
PROBE_TIMEOUT_S = 5
#: OSError numbers that a shared filesystem gives for a moment and then not (a stale NFS handle, a timeout)
TRANSIENT_ERRNOS = (errno.ESTALE, errno.ETIMEDOUT, errno.EIO, errno.ECONNRESET, errno.EHOSTUNREACH)


class WorkerLost(EnvironmentProblem):
    """A task's worker died more often than Ray retries it (or its node went away): the run stops."""


class TransientIOError(OSError):
    """An OSError a retry may cure (:data:`TRANSIENT_ERRNOS`); the only exception Ray retries."""


def check_executor(executor: str, address: str | None) -> None:
    """Refuse an unknown executor, and a Ray address without ``--executor ray``."""
    if executor not in EXECUTORS:
        raise UsageProblem(f"unknown executor {executor!r}", where="--executor", fix=f"use one of {', '.join(EXECUTORS)}")
    if address and executor != "ray":
        raise UsageProblem("--ray-address needs --executor ray", where="--ray-address", fix="add --executor ray")


def connect(address: str | None = None) -> Any:
    """The ``ray`` module, connected: to ``address`` (``auto``, ``HOST:PORT``, ``ray://...``), to the cluster
    ``RAY_ADDRESS`` names, else to a new local instance; a driver that called ``ray.init`` itself keeps its own."""
    ray = require("ray", needed_for="--executor ray", install=INSTALL)
    _probe(address)
    if ray.is_initialized():
        return ray
    try:
        ray.init(address=address, include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError, TimeoutError) as exc:
        text = " ".join(str(exc).split())[:300]
        raise EnvironmentProblem(f"cannot connect to the Ray cluster at {address or 'a new local instance'}: {text}",
                                 where="--ray-address",
                                 fix="start it with `ray start --head` and pass its address (or `auto` on a node of it)") \
            from None
    return ray


def _probe(address: str | None) -> None:
    """A HOST:PORT that nothing answers on is one line now; ``ray.init`` would retry it for minutes, logging."""
    if not address or "://" in address or address in ("auto", "local") or ":" not in address:
        return
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=PROBE_TIMEOUT_S).close()
    except (OSError, ValueError) as exc:
        why = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        raise EnvironmentProblem(f"cannot reach the Ray cluster at {address}: {why}", where="--ray-address",
                                 fix="check the head node's address and port (`ray status` on it), or start it with "
                                 "`ray start --head`") from None


def check_fits(ray: Any, memory: int | None, what: str) -> None:
    """Refuse before any work when no live node offers one CPU and ``memory`` bytes to one task: Ray would
    otherwise queue the task forever as infeasible."""
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    cpu_nodes = [r for r in nodes if r.get("CPU", 0) >= 1]
    if not cpu_nodes:
        raise EnvironmentProblem("the Ray cluster has no live node with a CPU", where="--ray-address",
                                 fix="start a worker node (`ray start --address HEAD:PORT`)")
    best = max(r.get("memory", 0) for r in cpu_nodes)
    if memory and memory > best:
        raise EnvironmentProblem(f"{what} asks Ray for {memory / 2**20:.0f} MiB of memory, and no node of the cluster "
                                 f"offers that much (the most is {best / 2**20:.0f} MiB)", where="--max-memory",
                                 fix="pass a smaller --max-memory or more --jobs (each task asks for the --max-memory / --jobs share)")


def _call(fn: Callable, item: Any) -> Any:
    """What a Ray worker runs: ``fn(item)``, with the retryable I/O failures marked as such."""
    try:
        return fn(item)
    except OSError as exc:
        if exc.errno in TRANSIENT_ERRNOS and not isinstance(exc, TransientIOError):
            raise TransientIOError(exc.errno, exc.strerror, exc.filename) from None
        raise


def run_tasks(ray: Any, fn: Callable, items: Iterable, *, limit: int, on_done: Callable[[Any], None],
              memory: int | None = None, name: str = "ktconvert") -> None:
    """Run ``fn(item)`` for every item as a Ray task (one CPU, ``memory`` bytes), at most ``limit`` at a time, and
    call ``on_done(result)`` on the driver as each one finishes.

    The first task that raises stops the run: the tasks still in flight are cancelled and its own exception is
    raised here (a :class:`~ktconvert.errors.KtError` keeps its one line). A worker that died more than
    :data:`MAX_RETRIES` times raises :class:`WorkerLost`. ``fn`` must be importable on every node (a module-level
    function of ktconvert).
    """
    options: dict = {"num_cpus": 1, "max_retries": MAX_RETRIES, "retry_exceptions": [TransientIOError], "name": name}
    if memory:
        options["memory"] = int(memory)
    remote = ray.remote(_call).options(**options)
    queue = deque(items)
    inflight: dict = {}
    try:
        while queue or inflight:
            while queue and len(inflight) < max(1, limit):
                inflight[remote.remote(fn, queue.popleft())] = True
            ready, _ = ray.wait(list(inflight), num_returns=1)
            for ref in ready:
                inflight.pop(ref)
                on_done(_result(ray, ref, name))
    except BaseException:
        for ref in inflight:  # Ctrl-C, a failed task: nothing more runs for this run
            ray.cancel(ref, force=True)
        raise


def _result(ray: Any, ref: Any, name: str) -> Any:
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as exc:
        cause = exc.cause
        if isinstance(cause, TransientIOError):  # retried MAX_RETRIES times: the plain OSError, as locally
            raise OSError(cause.errno, cause.strerror, cause.filename) from None
        if isinstance(cause, BaseException):
            raise cause from None
        raise
    except ray.exceptions.RayError as exc:  # a worker or node died more often than Ray retries it
        first = " ".join(str(exc).split())[:200]
        raise WorkerLost(f"a Ray worker running {name} was lost {MAX_RETRIES + 1} times ({type(exc).__name__}: {first}); "
                         "the run stopped", fix="check the nodes' memory and logs, then rerun (quantize: with --resume)") \
            from None


__all__ = ["EXECUTORS", "MAX_RETRIES", "TransientIOError", "WorkerLost", "check_executor", "check_fits", "connect",
           "run_tasks"]
