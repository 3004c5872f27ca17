"""One lock per OUT (issue 31): quantize, convert-lora, golden and tiny-model hold an advisory flock on
``.OUT.ktconvert-lock`` beside OUT for the whole run. A second run on the same OUT, plain, ``--force`` or
``--resume``, is refused in one line naming the holder's pid and host (exit 3: the command is right, another run
is using OUT; ``--force`` cannot override it); a lock left by a dead process is taken over; the manifest's sha256
are those of the bytes on disk.

Deterministic: the lock is held from the test process through the library, or the first run is paused inside its
progress callback while the second process runs; no sleeps race."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from convert_helpers import tiny, tree_bytes
from ktconvert.cli import cli
from ktconvert.convert import convert
from ktconvert.errors import EnvironmentProblem
from ktconvert.io.atomic import OutputBusy, lock_path, output_lock

HOST = socket.gethostname()
Q = ["--type", "Q8_0", "--max-memory", "64KiB"]


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return tiny(tmp_path_factory.mktemp("lock"), "qwen3_moe")


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    from ktconvert.model.tiny_lora import write_tiny_lora

    out = tmp_path_factory.mktemp("lock-lora") / "adapter"
    write_tiny_lora("qwen3_moe", out)
    return out


def _refused_line(stderr: str, out: Path, pid: int) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith(f"ktconvert: error: {out}: another ktconvert run is writing this output"), lines[0]
    assert f"pid {pid} on host {HOST}" in lines[0], lines[0]
    return lines[0]


def _commands(src, adapter, out):
    return {
        "quantize": ["quantize", str(src), str(out), *Q],
        "quantize --force": ["quantize", str(src), str(out), *Q, "--force"],
        "quantize --resume": ["quantize", str(src), str(out), *Q, "--resume"],
        "convert-lora": ["convert-lora", str(adapter), str(out), "--base-model-name-or-path", "tiny"],
        "convert-lora --force": ["convert-lora", str(adapter), str(out), "--base-model-name-or-path", "tiny", "--force"],
        "golden": ["golden", str(src), str(out), "--prompt-ids", "1,2,3"],
        "golden --force": ["golden", str(src), str(out), "--prompt-ids", "1,2,3", "--force"],
        "tiny-model": ["tiny-model", "qwen3_moe", str(out)],
        "tiny-model --force": ["tiny-model", "qwen3_moe", str(out), "--force"],
    }


@pytest.mark.parametrize("name", list(_commands("s", "a", "o")))
def test_every_writing_command_is_refused_while_another_holds_out(src, adapter, tmp_path, monkeypatch, name):
    monkeypatch.delenv("CI", raising=False)
    out = tmp_path / "out"
    with output_lock(out) as lock:
        assert lock == tmp_path / ".out.ktconvert-lock"
        res = CliRunner().invoke(cli, _commands(src, adapter, out)[name])
        assert res.exit_code == 3, res.output
        _refused_line(res.stderr, out, os.getpid())
        assert sorted(p.name for p in tmp_path.iterdir()) == [lock.name]  # nothing of the refused run
    assert list(tmp_path.iterdir()) == []  # the lock file goes with its holder


def test_the_lock_file_names_its_holder_and_goes_when_released(tmp_path):
    out = tmp_path / "deep" / "er" / "out"
    with output_lock(out) as lock:
        holder = json.loads(lock.read_text())
        assert holder["pid"] == os.getpid() and holder["host"] == HOST
        with pytest.raises(OutputBusy) as exc:
            with output_lock(out):
                pass
        assert isinstance(exc.value, EnvironmentProblem) and exc.value.exit_code == 3
    assert list(tmp_path.iterdir()) == []  # the directories it made for the lock went with it


_SECOND = """
import json, sys
from click.testing import CliRunner
from ktconvert.cli import cli
src, out = sys.argv[1:3]
res = {}
for extra in ([], ["--force"], ["--resume"]):
    r = CliRunner().invoke(cli, ["quantize", src, out, "--type", "Q8_0", "--max-memory", "64KiB", *extra])
    res[" ".join(extra) or "plain"] = [r.exit_code, r.stderr]
print(json.dumps(res))
"""


def _sha256_on_disk(out: Path) -> dict[str, str]:
    return {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(out.rglob("*")) if p.is_file() and p.name != "manifest.json"}


def _manifest_matches_disk(out: Path) -> None:
    manifest = json.loads((out / "manifest.json").read_text())
    assert {n: f["sha256"] for n, f in manifest["files"].items()} == _sha256_on_disk(out)
    assert {n: f["bytes"] for n, f in manifest["files"].items()} == {n: (out / n).stat().st_size
                                                                     for n in manifest["files"]}


def test_two_processes_on_one_out(src, tmp_path):
    """The first run (this process) is paused inside its progress callback, its partial directory half written,
    while a second process tries OUT plain, with --force and with --resume: each refused, naming this process;
    the first then finishes into the bytes of a clean run, matching its manifest."""
    ref = tmp_path / "ref"
    convert(src, ref, type="Q8_0", max_memory="64KiB")
    out = tmp_path / "out"
    seen = {}

    def second_run(done: int, total: int) -> None:
        if seen or not 0 < done < total:
            return
        assert (tmp_path / ".out.ktconvert-partial").is_dir()
        proc = subprocess.run([sys.executable, "-c", _SECOND, str(src), str(out)], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr
        seen.update(json.loads(proc.stdout))

    result = convert(src, out, type="Q8_0", max_memory="64KiB", progress=second_run)
    assert set(seen) == {"plain", "--force", "--resume"}
    for code, stderr in seen.values():
        assert code == 3, stderr
        _refused_line(stderr, out, os.getpid())
    assert result.units > 1
    assert tree_bytes(out) == tree_bytes(ref)
    _manifest_matches_disk(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "ref"]


_HOLDER = """
import sys, time
from ktconvert.io.atomic import output_lock
with output_lock(sys.argv[1]):
    print("held", flush=True)
    sys.stdin.read()
"""


def test_a_lock_left_by_a_killed_process_is_taken_over(tmp_path):
    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(out)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        res = CliRunner().invoke(cli, ["tiny-model", "qwen3_moe", str(out)])
        assert res.exit_code == 3
        _refused_line(res.stderr, out, holder.pid)
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    stale = lock_path(out)
    assert json.loads(stale.read_text())["pid"] == holder.pid  # the dead holder's record is still there
    res = CliRunner().invoke(cli, ["tiny-model", "qwen3_moe", str(out)])
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_lock_file_of_garbage_nobody_holds_is_taken_over(tmp_path):
    lock_path(tmp_path / "out").write_bytes(b"\xff\x00 not a record")
    res = CliRunner().invoke(cli, ["tiny-model", "qwen3_moe", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_held_lock_with_an_unreadable_record_is_still_refused_in_one_line(tmp_path):
    import fcntl

    lock = lock_path(tmp_path / "out")
    lock.write_bytes(b"\xff garbage")
    with open(lock, "rb") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        res = CliRunner().invoke(cli, ["tiny-model", "qwen3_moe", str(tmp_path / "out")])
    assert res.exit_code == 3
    assert "a process whose record in the lock file is unreadable" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_manifest_hashes_are_the_bytes_on_disk_after_a_run_and_after_resume(src, tmp_path):
    from ktconvert.convert import execute as ex

    out = tmp_path / "out"
    convert(src, out, type="Q8_0", max_memory="64KiB")
    _manifest_matches_disk(out)

    again = tmp_path / "again"
    calls, real = {"n": 0}, ex.run_group

    def dying(group):  # one unit a group: a single output
        calls["n"] += 1
        if calls["n"] > 3:
            raise KeyboardInterrupt
        return real(group)

    ex.run_group = dying
    try:
        with pytest.raises(KeyboardInterrupt):
            convert(src, again, type="Q8_0", max_memory="64KiB", resume=True)
    finally:
        ex.run_group = real
    assert not lock_path(again).exists()  # an interrupted run lets go of OUT
    result = convert(src, again, type="Q8_0", max_memory="64KiB", resume=True)
    assert result.units_resumed == 3
    _manifest_matches_disk(again)
    assert tree_bytes(again) == tree_bytes(out)
