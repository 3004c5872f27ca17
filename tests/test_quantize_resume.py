"""kill -9 in the middle of a conversion, then --resume: the result is byte-identical to an uninterrupted run,
and no partial output ever carries the final name. Plus the rules around an interrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from convert_helpers import slow_quantizer_env, tiny, tree_bytes
from ktconvert.cli import cli

# small units (about 20 rows of 256 each), so the run has hundreds of units and is interrupted mid-way
ARGS = ["--type", "Q4_K", "--max-memory", "128KiB"]


def _children(pid: int) -> list[int]:
    """Worker processes of ``pid`` (spawned by its ProcessPoolExecutor), from /proc."""
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as fh:
            out.extend(int(c) for c in fh.read().split())
    def is_worker(c: int) -> bool:
        try:
            with open(f"/proc/{c}/cmdline", "rb") as fh:
                return b"spawn_main" in fh.read()
        except FileNotFoundError:
            return False

    return [c for c in out if is_worker(c)]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _cmd(src, out, *extra):
    return [sys.executable, "-m", "ktconvert", "quantize", str(src), str(out), *ARGS, *extra]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    src = tiny(root, "qwen3_moe")
    ref = root / "ref"
    subprocess.run(_cmd(src, ref), check=True, capture_output=True)
    return src, ref


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_kill_9_then_resume_is_byte_identical(reference, tmp_path, jobs):
    src, ref = reference
    out = tmp_path / "out"
    journal = tmp_path / ".out.ktconvert-partial" / ".ktconvert" / "journal"
    proc = subprocess.Popen(_cmd(src, out, "--jobs", jobs), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=slow_quantizer_env(tmp_path / "slow-site"))
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert not out.exists(), "the final name appeared before the run finished"
            if journal.exists() and len(journal.read_text().splitlines()) >= 30:
                break
            assert proc.poll() is None, "the run finished before it could be interrupted"
            time.sleep(0.01)
        else:
            pytest.fail("no progress recorded in time")
        workers = _children(proc.pid)
        assert len(workers) == int(jobs) - 1  # the converting process is one of the --jobs
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    deadline = time.monotonic() + 10  # --jobs workers notice their parent died and exit: none is left behind
    while any(_alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(w) for w in workers)
    assert not out.exists()
    done_before = len(journal.read_text().splitlines())
    assert done_before >= 30

    res = subprocess.run(_cmd(src, out, "--jobs", jobs, "--resume", "-o", "json"), capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["units_resumed"] >= done_before and report["units"] > 0
    assert not (tmp_path / ".out.ktconvert-partial").exists()
    assert tree_bytes(out) == tree_bytes(ref)


def _interrupted(src, tmp_path):
    """A partial directory as a killed run leaves it (the first units done)."""
    from ktconvert.convert import execute as ex

    calls = {"n": 0}
    real = ex.run_group

    def dying(group):  # one unit a group: a single output
        calls["n"] += 1
        if calls["n"] > 5:  # after five units: as if the process died there
            raise KeyboardInterrupt
        return real(group)

    ex.run_group = dying
    try:
        with pytest.raises(KeyboardInterrupt):
            from ktconvert.convert import convert

            convert(src, tmp_path / "out", type="Q4_K", max_memory="4MiB")
    finally:
        ex.run_group = real
    assert (tmp_path / ".out.ktconvert-partial").is_dir() and not (tmp_path / "out").exists()


def test_interrupted_run_needs_resume_or_force(reference, tmp_path):
    src, ref = reference
    _interrupted(src, tmp_path)
    res = CliRunner().invoke(cli, ["quantize", str(src), str(tmp_path / "out"), *ARGS])
    assert res.exit_code == 2 and "an interrupted conversion to this output exists" in res.stderr
    assert "--resume" in res.stderr and "--force" in res.stderr
    # a different plan cannot continue it
    res = CliRunner().invoke(cli, ["quantize", str(src), str(tmp_path / "out"), "--type", "Q6_K", "--resume"])
    assert res.exit_code == 3 and "planned differently" in res.stderr
    # --force starts over and gives the same bytes
    res = CliRunner().invoke(cli, ["quantize", str(src), str(tmp_path / "out"), "--type", "Q4_K", "--force"])
    assert res.exit_code == 0, res.stderr
    assert tree_bytes(tmp_path / "out") == tree_bytes(ref)


def test_resume_in_process_does_only_the_rest(reference, tmp_path):
    from ktconvert.convert import convert

    src, ref = reference
    _interrupted(src, tmp_path)
    result = convert(src, tmp_path / "out", type="Q4_K", max_memory="64KiB", resume=True)  # the units are the run's
    assert result.units_resumed == 5 and result.units > 0
    assert tree_bytes(tmp_path / "out") == tree_bytes(ref)


def test_force_replaces_an_existing_output(reference, tmp_path):
    src, ref = reference
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    res = CliRunner().invoke(cli, ["quantize", str(src), str(out), *ARGS])
    assert res.exit_code == 2 and "output already exists" in res.stderr and (out / "old.txt").exists()
    res = CliRunner().invoke(cli, ["quantize", str(src), str(out), "--type", "Q4_K", "--force"])
    assert res.exit_code == 0 and tree_bytes(out) == tree_bytes(ref)


def test_manifest_records_sha256_sources_and_recipe(reference):
    import hashlib

    src, ref = reference
    m = json.loads((ref / "manifest.json").read_text())
    assert m["tool"]["name"] == "ktconvert" and m["tool"]["version"]
    for name, info in m["files"].items():
        data = (ref / name).read_bytes()
        assert len(data) == info["bytes"] and hashlib.sha256(data).hexdigest() == info["sha256"]
    assert [f["file"] for f in m["source"]["files"]] == ["model.safetensors"]
    assert len(m["source"]["files"][0]["header_sha256"]) == 64
    assert m["recipe"]["name"] == "Q4_K" and m["recipe"]["rules"][-1]["type"] == "Q4_K"
    assert m["layout"] == "kernel" and m["format"] == "gguf"
    assert {t["name"] for t in m["tensors"]} >= {"blk.0.ffn_gate_exps.weight", "token_embd.weight"}


def test_killed_between_manifest_and_rename(reference, tmp_path):
    """Everything written and checked, the process dies before the rename: --resume only renames."""
    from ktconvert.convert import convert
    from ktconvert.convert import execute as ex

    src, ref = reference
    real = ex._publish

    def die(*a, **k):
        raise KeyboardInterrupt

    ex._publish = die
    try:
        with pytest.raises(KeyboardInterrupt):
            convert(src, tmp_path / "out", type="Q4_K")
    finally:
        ex._publish = real
    assert not (tmp_path / "out").exists() and (tmp_path / ".out.ktconvert-partial" / "manifest.json").is_file()
    result = convert(src, tmp_path / "out", type="Q4_K", resume=True)
    assert result.units == 0 and tree_bytes(tmp_path / "out") == tree_bytes(ref)


def _own_tiny(tmp_path):
    """A tiny model of this test's own, to damage: ``tiny()`` hands every test the one session-wide copy."""
    from ktconvert.model.tiny import write_tiny_model

    write_tiny_model("qwen3_moe", tmp_path / "own-tiny")
    return tmp_path / "own-tiny"


def _flip_byte_keep_mtime(path, offset):
    st = os.stat(path)
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 0x01]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_resume_refuses_a_source_byte_changed_with_mtime_kept(tmp_path):
    """Issue 15: a byte of what was already converted changes, size and mtime kept: --resume refuses, naming the
    tensor, instead of finishing an output made half from the old bytes and half from the new."""
    from ktconvert.formats import open_checkpoint

    src = _own_tiny(tmp_path)
    _interrupted(src, tmp_path)
    journal = (tmp_path / ".out.ktconvert-partial" / ".ktconvert" / "journal").read_text().split("\n")
    assert all(len(line.split()) == 2 for line in journal if line)  # unit id and its input digest
    st_file = src / "model.safetensors"
    ck = open_checkpoint(str(src))
    for name in ck:  # one byte in the first rows of every tensor: the finished units read some of them
        _flip_byte_keep_mtime(st_file, ck[name].offset + 2)
    res = CliRunner().invoke(cli, ["quantize", str(src), str(tmp_path / "out"), "--type", "Q4_K",
                                   "--max-memory", "4MiB", "--resume"])
    assert res.exit_code == 3, res.output
    line = res.stderr.strip()
    assert "\n" not in line and "input changed since the interrupted run" in line and "--force" in line
    assert not (tmp_path / "out").exists() and (tmp_path / ".out.ktconvert-partial").is_dir()


def test_resume_refuses_a_source_of_another_size(tmp_path):
    src = _own_tiny(tmp_path)
    _interrupted(src, tmp_path)
    with open(src / "model.safetensors", "ab") as fh:
        fh.write(b"\0" * 8)
    res = CliRunner().invoke(cli, ["quantize", str(src), str(tmp_path / "out"), "--type", "Q4_K",
                                   "--max-memory", "4MiB", "--resume"])
    assert res.exit_code == 3 and "model.safetensors was" in res.stderr and "bytes, now" in res.stderr


def test_unit_checksum_streams_and_notices_a_changed_byte():
    """The journal's per-unit checksum: the same value however the bytes are cut into updates (unaligned views
    included), and another value for one flipped bit, two flips in one lane, a byte more or a shorter input."""
    import numpy as np

    from ktconvert.quant._jit_digest import Checksum

    data = np.random.default_rng(0).integers(0, 256, 100_003, dtype=np.uint8).tobytes()

    def digest(*parts) -> str:
        c = Checksum()
        for p in parts:
            c.update(p)
        return c.hexdigest()

    whole = digest(data)
    assert len(whole) == 16 and int(whole, 16) >= 0
    assert digest(data[:1], memoryview(data)[1:65], data[65:70_001], memoryview(data)[70_001:]) == whole
    changed = []
    for flips in ([5], [7, 7 + 64], [99_999]):
        b = bytearray(data)
        for i in flips:
            b[i] ^= 0x80
        changed.append(digest(bytes(b)))
    changed += [digest(data + b"\0"), digest(data[:-1]), digest(b""), digest(b"\0")]
    assert whole not in changed and len(set(changed)) == len(changed)
