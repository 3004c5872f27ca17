"""Peak resident memory of this process and of its whole process tree (kernel children are processes of their own).

:class:`TreePeak` is a context manager that samples, from a daemon thread every ``interval`` seconds, the
``/proc/PID/status`` of this process and of every descendant (children, grandchildren, ... found through
``/proc/PID/task/*/children``, or by scanning ``/proc`` for parent ids where that file is absent). Its figures:

* ``self_peak``: this process's own ``VmHWM`` (the kernel's high-water mark of its resident set, exact; not
  ``ru_maxrss``, which Linux carries across ``fork`` and ``execve`` so a child started from a large process reports
  its parent's peak, see ``tests/child_peak.py``).
* ``tree_peak``: the largest, over the samples, of this process's ``VmRSS`` plus each live descendant's ``VmHWM``
  (its own peak so far: a child's short spike between two samples is still counted), and never below
  ``self_peak``. This is conservative: a descendant counts at its peak even after it fell back, so the figure can
  exceed the true simultaneous peak. It can miss: a spike of this process shorter than one interval while children
  live (``self_peak`` alone still catches it), a descendant's growth in its last interval before it exits, and a
  descendant that starts and ends between two samples (kernel children live for the whole run).

Off Linux (no ``/proc``) both figures fall back to ``ru_maxrss`` of this process.
"""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path

_FIELD = re.compile(r"^(VmRSS|VmHWM):\s+(\d+)\s+kB", re.M)
PROC = Path("/proc")


def _status(pid: int | str) -> dict[str, int]:
    """``{"VmRSS": bytes, "VmHWM": bytes}`` of ``pid`` (empty for a process that is gone or a zombie)."""
    try:
        text = (PROC / str(pid) / "status").read_text()
    except OSError:
        return {}
    return {k: int(v) * 1024 for k, v in _FIELD.findall(text)}


def _children(pid: int) -> list[int]:
    """Direct children of ``pid``: every thread's ``children`` file, else a scan of ``/proc`` for ``PPid``."""
    out: list[int] = []
    tasks = PROC / str(pid) / "task"
    try:
        for task in tasks.iterdir():
            out += [int(c) for c in (task / "children").read_text().split()]
        return out
    except OSError:
        pass
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            try:
                m = re.search(r"^PPid:\s+(\d+)", (entry / "status").read_text(), re.M)
            except OSError:
                continue
            if m and int(m.group(1)) == pid:
                out.append(int(entry.name))
    return out


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid``, depth first."""
    out, todo = [], [pid]
    while todo:
        for c in _children(todo.pop()):
            if c not in out:
                out.append(c)
                todo.append(c)
    return out


def self_peak() -> int:
    """This process's peak resident set size in bytes (``VmHWM``; ``ru_maxrss`` off Linux)."""
    hwm = _status("self").get("VmHWM")
    if hwm is not None:
        return hwm
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class TreePeak:
    """Sample this process tree's resident memory while the ``with`` block runs (see the module docstring);
    ``interval``: seconds between samples. Read :attr:`self_peak` and :attr:`tree_peak` during or after it."""

    def __init__(self, interval: float = 0.02):
        self.interval = interval
        self.pid = os.getpid()
        self._tree = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def sample(self) -> int:
        """One sample now: this process's VmRSS plus its live descendants' VmHWM; returns it."""
        own = _status(self.pid).get("VmRSS", 0)
        live = 0
        for pid in descendants(self.pid):
            hwm = _status(pid).get("VmHWM")
            if hwm is None:
                continue
            live += hwm
        with self._lock:
            self._tree = max(self._tree, own + live)
        return own + live

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self) -> "TreePeak":
        self.sample()
        self._thread = threading.Thread(target=self._loop, name="ktconvert-tree-peak", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.sample()

    @property
    def self_peak(self) -> int:
        return self_peak()

    @property
    def tree_peak(self) -> int:
        """Bytes: the largest sample, and at least :attr:`self_peak`."""
        with self._lock:
            return max(self._tree, self.self_peak)

    def as_dict(self) -> dict[str, int]:
        return {"peak_rss": self.self_peak, "peak_rss_tree": self.tree_peak}
