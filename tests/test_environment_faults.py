"""Environment faults (issue 15): a full disk, a read-only destination, a worker killed under ``-j N``. Each is one
line naming OUT and the fix, exit 3, and leaves no partial output (a resumable one only when --resume was asked).

A full disk is simulated by making ``os.pwrite`` raise ENOSPC after some units (the conversion runs in this
process with ``-j 1``); a read-only destination by making the directory creation raise EROFS (the tests may run
as root, whom permissions do not stop)."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from convert_helpers import slow_quantizer_env, tiny, tree_bytes
from ktconvert.cli import cli
from test_quantize_resume import _children

ARGS = ["--type", "Q8_0", "--max-memory", "64KiB"]


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return tiny(tmp_path_factory.mktemp("envfaults"), "qwen3_moe")


def _full_disk(monkeypatch, after: int = 5):
    """The disk fills after ``after`` unit writes (the converter writes with ``pwritev``; ``pwrite`` too, for
    any other writer)."""
    calls = {"n": 0}

    def full(real):
        def write(fd, data, offset):
            calls["n"] += 1
            if calls["n"] > after:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real(fd, data, offset)
        return write

    monkeypatch.setattr(os, "pwrite", full(os.pwrite))
    monkeypatch.setattr(os, "pwritev", full(os.pwritev))


def _one_line(res, out: Path) -> str:
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith(f"ktconvert: error: {out}: "), lines[0]
    return lines[0]


def test_disk_full_is_one_line_and_leaves_nothing(src, tmp_path, monkeypatch):
    _full_disk(monkeypatch)
    out = tmp_path / "out"
    res = CliRunner().invoke(cli, ["quantize", str(src), str(out), *ARGS])
    assert res.exit_code == 3
    line = _one_line(res, out)
    assert "No space left on device" in line and "free space" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_disk_full_with_resume_keeps_a_resumable_state(src, tmp_path, monkeypatch):
    ref = tmp_path / "ref"
    assert CliRunner().invoke(cli, ["quantize", str(src), str(ref), *ARGS]).exit_code == 0
    out = tmp_path / "out"
    with monkeypatch.context() as m:
        _full_disk(m)
        res = CliRunner().invoke(cli, ["quantize", str(src), str(out), *ARGS, "--resume"])
    assert res.exit_code == 3 and "--resume" in _one_line(res, out)
    assert not out.exists() and (tmp_path / ".out.ktconvert-partial").is_dir()
    res = CliRunner().invoke(cli, ["quantize", str(src), str(out), *ARGS, "--resume"])  # space freed: it continues
    assert res.exit_code == 0, res.output
    assert "finished before resuming" in res.stdout
    assert tree_bytes(out) == tree_bytes(ref)


def test_too_little_free_space_is_refused_before_writing(src, tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**6, 10**6 - 100, 100))
    out = tmp_path / "out"
    res = CliRunner().invoke(cli, ["quantize", str(src), str(out), *ARGS])
    assert res.exit_code == 3 and "the disk holding it has" in _one_line(res, out)
    assert list(tmp_path.iterdir()) == []


def _read_only(monkeypatch, under: Path):
    real = Path.mkdir

    def mkdir(self, *a, **k):
        if under in self.parents or self == under:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        return real(self, *a, **k)

    monkeypatch.setattr(Path, "mkdir", mkdir)


@pytest.mark.parametrize("command", ["quantize", "tiny-model"])
def test_read_only_destination_is_one_line(src, tmp_path, monkeypatch, command):
    ro = tmp_path / "ro"
    ro.mkdir()
    _read_only(monkeypatch, ro)
    out = ro / "out"
    args = ["quantize", str(src), str(out), *ARGS] if command == "quantize" else ["tiny-model", "mixtral", str(out)]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 3
    assert "Read-only file system" in _one_line(res, out) and "directory you can write to" in res.stderr
    assert list(ro.iterdir()) == []


def test_killed_worker_fails_the_run_cleanly(src, tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "ktconvert", "quantize", str(src), str(out), "--type", "Q4_K",
           "--max-memory", "128KiB", "--jobs", "2"]
    env = slow_quantizer_env(tmp_path.parent / f"{tmp_path.name}-site")  # compiled quantizers would finish first
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    journal = tmp_path / ".out.ktconvert-partial" / ".ktconvert" / "journal"
    deadline = time.monotonic() + 120
    while not (journal.exists() and journal.read_text().count("\n") >= 5):
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before a worker could be killed"
        time.sleep(0.01)
    workers = _children(proc.pid)
    assert workers
    os.kill(workers[0], signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 3, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"ktconvert: error: {out}: a worker process died"), err
    assert list(tmp_path.iterdir()) == []
