"""Reads around the page cache (``O_DIRECT``, :func:`ktconvert.io.files.read_direct`): the same bytes as the page
cache's reads, a filesystem that refuses it (tmpfs: ``EINVAL`` at open; some others at the read) read through the
page cache instead without a word, and a conversion whose units read this way byte-identical to one that does not
(a truncated file: ``tests/test_formats_readers.py``, the same one line both ways)."""

from __future__ import annotations

import errno
import fcntl
import json
import os

import numpy as np
import pytest

from formats_helpers import hf_checkpoint
from ktconvert.formats import open_checkpoint
from ktconvert.io import files
from ktconvert.io.files import ReadBuffer

pytestmark = pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="O_DIRECT is Linux's")


def _failing_direct(real, code: int, message: str):
    """``real`` (``os.preadv`` / ``os.pwritev``) failing with ``code`` on a file opened with ``O_DIRECT``."""

    def call(fd, bufs, offset, *a):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(code, message)
        return real(fd, bufs, offset, *a)

    return call


def _cut_under_read(monkeypatch, when) -> list:
    """The first direct read of a unit for which ``when(tensor, first row)`` holds cuts the file inside that tensor
    first (a file shortened while the run reads it); returns ``[(file, tensor)]`` once it has."""
    from ktconvert.convert import worker

    real, cut = worker._direct_read, []

    def cut_then_read(ck, tensor, first, n, buf):
        if when(tensor, first) and not cut:
            cut.append((str(ck[tensor].file), tensor))
            with open(ck[tensor].file, "r+b") as fh:
                fh.truncate(ck[tensor].offset + 1)
        return real(ck, tensor, first, n, buf)

    monkeypatch.setattr(worker, "_direct_read", cut_then_read)
    return cut


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return hf_checkpoint(tmp_path_factory.mktemp("direct"), "qwen3_moe", "split")


def _direct_allowed(path) -> bool:
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
        return True
    except OSError:
        return False


def _no_read_left(src) -> None:
    """After a run stopped by a failed read: the process's read-ahead thread idle (or none), no other left, and no
    file of ``src`` still open."""
    import threading

    assert not files.ReadAhead._busy
    assert [t for t in threading.enumerate() if t.name == "ktconvert-read-ahead"] in ([], [files.ReadAhead._thread])
    if os.path.isdir("/proc/self/fd"):
        open_now = {os.path.realpath(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")}
        assert not {str(p.resolve()) for p in src.iterdir()} & open_now


@pytest.fixture(autouse=True)
def fresh_refusals(monkeypatch):
    monkeypatch.setattr(files, "_NO_DIRECT", set())


def _every_run_of_rows(ck, direct: bool) -> dict:
    buf, out = ReadBuffer(), {}
    for name in ck:
        rows = ck.rows(name)
        for r0, r1 in ((0, rows), (rows // 3, rows // 3 + 1), (rows - 1, rows)):
            out[(name, r0)] = np.array(ck.read_rows(name, r0, r1, buf, direct=direct))
    return out


def test_direct_reads_are_the_page_cache_reads_byte_for_byte(ckpt):
    ck = open_checkpoint(ckpt)
    want = _every_run_of_rows(ck, direct=False)
    got = _every_run_of_rows(ck, direct=True)
    assert want.keys() == got.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        np.testing.assert_array_equal(got[k], want[k], err_msg=str(k))
    if _direct_allowed(next(iter(ck.values())).file):  # really read around the cache: the view sits in the window
        name = next(n for n in ck if ck[n].offset % 4096)
        view = ck.read_rows(name, 0, ck.rows(name), ReadBuffer(), direct=True)
        assert view.ctypes.data % 4096 == ck[name].offset % 4096


def test_a_filesystem_refusing_o_direct_at_open_is_read_through_the_page_cache(ckpt, monkeypatch):
    """tmpfs answers ``open(O_DIRECT)`` with EINVAL: the read goes through the page cache, the filesystem is not
    asked again, and nothing is said."""
    real_open, asked = os.open, []

    def refusing_open(path, flags, *a, **kw):
        if flags & os.O_DIRECT:
            asked.append(path)
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(files.os, "open", refusing_open)
    ck = open_checkpoint(ckpt)
    monkeypatch.setattr(files.os, "open", refusing_open)
    got = _every_run_of_rows(ck, direct=True)
    monkeypatch.setattr(files.os, "open", real_open)
    want = _every_run_of_rows(ck, direct=False)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=str(k))
    assert len(asked) == 1  # once per filesystem
    assert files._NO_DIRECT == {os.stat(ckpt).st_dev}


def test_a_filesystem_refusing_the_direct_read_itself_is_read_through_the_page_cache(ckpt, monkeypatch):
    """Some filesystems open with O_DIRECT and refuse the read (an alignment they need): the same fallback."""
    monkeypatch.setattr(files.os, "preadv", _failing_direct(files.os.preadv, errno.EINVAL, "Invalid argument"))
    ck = open_checkpoint(ckpt)
    name = max(ck, key=lambda n: ck[n].nbytes)
    got = np.array(ck.read_rows(name, 0, ck.rows(name), ReadBuffer(), direct=True))
    np.testing.assert_array_equal(got, np.asarray(ck.read(name)).reshape(got.shape))
    if _direct_allowed(ck[name].file):
        assert files._NO_DIRECT == {os.stat(ckpt).st_dev}


def test_a_refused_direct_read_among_files_kept_open_falls_back_and_leaves_no_file_open(ckpt, monkeypatch):
    """Inside ``files_kept_open`` (a read-ahead thread's reads), the read refused with EINVAL: the same bytes through
    the page cache, that read and the next, the kept descriptor closed at once and the file not read directly
    again."""
    calls = []
    refuse = _failing_direct(files.os.preadv, errno.EINVAL, "Invalid argument")

    def counting(fd, bufs, offset, *a):
        calls.append(bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT))
        return refuse(fd, bufs, offset, *a)

    monkeypatch.setattr(files.os, "preadv", counting)
    ck = open_checkpoint(ckpt)
    name = max(ck, key=lambda n: ck[n].nbytes)
    want = np.asarray(ck.read(name))
    path = os.path.realpath(ck[name].file)

    def direct_fds() -> list:  # descriptors of the file open with O_DIRECT (want's memory map holds a plain one)
        if not os.path.isdir("/proc/self/fd"):
            return []
        return [fd for fd in os.listdir("/proc/self/fd") if os.path.realpath(f"/proc/self/fd/{fd}") == path
                and fcntl.fcntl(int(fd), fcntl.F_GETFL) & os.O_DIRECT]

    with files.files_kept_open():
        for _ in range(2):
            got = np.array(ck.read_rows(name, 0, ck.rows(name), ReadBuffer(), direct=True))
            np.testing.assert_array_equal(got, want.reshape(got.shape))
            assert direct_fds() == []  # the refused descriptor closed at once, not kept to the block's end
    assert direct_fds() == []
    if _direct_allowed(ck[name].file):
        assert calls.count(True) == 1  # refused once, then the page cache only
        assert files._NO_DIRECT == {os.stat(ckpt).st_dev}


def test_the_last_partial_block_of_a_file_is_read_directly(ckpt, monkeypatch):
    """A file's last tensor ends inside a block: the direct read stops at the end of the file instead of asking
    again at an unaligned offset (EINVAL on filesystems stricter than ext4, simulated here), so the read stays
    direct and the filesystem is not marked as refusing it."""
    real = files.os.preadv

    def strict(fd, bufs, offset, *a):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT and offset % 4096:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, bufs, offset, *a)

    path = ckpt / "model.safetensors"
    if not _direct_allowed(path):
        pytest.skip("this filesystem refuses O_DIRECT")
    monkeypatch.setattr(files.os, "preadv", strict)
    ck = open_checkpoint(path)
    name = max(ck, key=lambda n: ck[n].offset)
    assert (ck[name].offset + ck[name].nbytes) % 4096  # the file ends inside a block
    got = ck.read_rows(name, 0, ck.rows(name), ReadBuffer(), direct=True)
    np.testing.assert_array_equal(got, np.asarray(ck.read(name)).reshape(got.shape))
    assert got.ctypes.data % 4096 == ck[name].offset % 4096 and not files._NO_DIRECT


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no tmpfs at /dev/shm")
def test_a_checkpoint_on_tmpfs_reads_through_the_page_cache(ckpt, tmp_path):
    import shutil
    import tempfile

    shm = tempfile.mkdtemp(prefix="ktconvert-test-", dir="/dev/shm")
    try:
        copy = shutil.copytree(ckpt, os.path.join(shm, "ck"))
        ck = open_checkpoint(copy)
        name = max(ck, key=lambda n: ck[n].nbytes)
        got = ck.read_rows(name, 0, ck.rows(name), ReadBuffer(), direct=True)
        np.testing.assert_array_equal(got, np.asarray(ck.read(name)).reshape(got.shape))
        if not _direct_allowed(ck[name].file):
            assert os.stat(copy).st_dev in files._NO_DIRECT
    finally:
        shutil.rmtree(shm)


def test_a_conversion_reading_around_the_page_cache_writes_the_same_bytes(ckpt, tmp_path, monkeypatch):
    """Every unit read with O_DIRECT (DIRECT_MIN 0) against none (DIRECT_MIN above any unit): the same manifest
    sha256 for every file, and the same resume digests in the journal-free manifest's plan."""
    from ktconvert.convert import convert
    from ktconvert.convert import execute as ex

    seen = []
    real = files.read_direct

    def counting(*a, **kw):
        out = real(*a, **kw)
        seen.append(out is not None)
        return out

    monkeypatch.setattr("ktconvert.formats.checkpoint.read_direct", counting)
    runs = {}
    for label, least in (("page cache", 1 << 62), ("direct", 0)):
        monkeypatch.setattr(ex, "DIRECT_MIN", least)
        out = tmp_path / label
        convert(ckpt, out, type="F16", jobs=1, tokenizer=False)
        runs[label] = json.loads((out / "manifest.json").read_text())["files"]
    assert runs["direct"] == runs["page cache"]
    assert seen and (all(seen) or not _direct_allowed(ckpt / "model.safetensors"))


@pytest.mark.parametrize("type", ["Q4_0", "Q8_0"])
def test_a_unit_read_ahead_in_chunks_writes_the_single_read_bytes(ckpt, tmp_path, monkeypatch, type):
    """Units read around the page cache are converted in chunks of a few rows, the next chunk read by a thread while
    one converts (READ_AHEAD_CHUNK 1: the fewest rows a chunk holds): the same files (manifest sha256) and the same
    resume digests as a run reading every unit through the page cache in one read."""
    from ktconvert.convert import convert
    from ktconvert.convert import execute as ex
    from ktconvert.convert import worker

    used = []
    real = files.ReadAhead

    class Counting(real):
        def __init__(self, reads, bufs):
            used.append(len(reads))
            super().__init__(reads, bufs)

    monkeypatch.setattr(worker, "ReadAhead", Counting)
    monkeypatch.setattr(worker, "READ_AHEAD_CHUNK", 1)
    runs = {}
    for label, least in (("page cache", 1 << 62), ("read ahead", 0)):
        monkeypatch.setattr(ex, "DIRECT_MIN", least)
        out = tmp_path / label
        convert(ckpt, out, type=type, jobs=1, tokenizer=False, allow_fallback=True)
        man = json.loads((out / "manifest.json").read_text())
        runs[label] = man["files"], man.get("plan")
    assert runs["read ahead"] == runs["page cache"]
    assert used and max(used) > 2  # units really were cut into several reads


def test_read_aheads_one_after_the_other_share_one_thread_and_two_open_at_once_do_not_wait_on_each_other():
    """Each group's ReadAhead reads in the process's kept thread (no thread started per group); one made while
    another is open reads in a thread of its own, so using it before closing the first does not wait forever."""
    import threading

    def reads(tag, n):
        return [((tag, i), lambda buf, tag=tag, i=i: (tag, i, threading.current_thread().ident)) for i in range(n)]

    bufs = (ReadBuffer(), ReadBuffer())
    seen = set()
    for g in range(5):
        with files.ReadAhead(reads(g, 4), bufs) as ahead:
            for i in range(4):
                tag, j, ident = ahead.next((g, i))
                assert (tag, j) == (g, i)
                seen.add(ident)
    assert len(seen) == 1 and seen == {files.ReadAhead._thread.ident} and not files.ReadAhead._busy
    with files.ReadAhead(reads("a", 3), bufs) as a:
        assert a.next(("a", 0))[:2] == ("a", 0)
        with files.ReadAhead(reads("b", 3), (ReadBuffer(), ReadBuffer())) as b:
            assert [b.next(("b", i))[:2] for i in range(3)] == [("b", 0), ("b", 1), ("b", 2)]
            assert b.next(("b", 2))[2] != files.ReadAhead._thread.ident
        assert [a.next(("a", i))[:2] for i in (1, 2)] == [("a", 1), ("a", 2)]


def test_a_truncated_file_under_a_read_ahead_is_one_line_and_leaves_no_read_behind(ckpt, tmp_path, monkeypatch):
    """A read of the thread failing (the file cut short) is raised where its chunk is used, as the single read's
    InputError naming the file and tensor; the read-ahead thread is idle (the process's kept one, or none), no
    source file is left open, and the output is not renamed into place."""
    import shutil

    from ktconvert.convert import convert
    from ktconvert.convert import execute as ex
    from ktconvert.convert import worker
    from ktconvert.errors import InputError

    src = tmp_path / "src"
    shutil.copytree(ckpt, src)
    monkeypatch.setattr(ex, "DIRECT_MIN", 0)
    monkeypatch.setattr(worker, "READ_AHEAD_CHUNK", 1)
    # the file shortened while the run reads it: the first chunk read ahead past a tensor's start cuts the file
    # inside that tensor
    cut = _cut_under_read(monkeypatch, lambda tensor, first: first > 0)
    with pytest.raises(InputError) as err:
        convert(src, tmp_path / "out", type="Q8_0", jobs=1, tokenizer=False, allow_fallback=True)
    assert cut and (err.value.path, err.value.where) == (cut[0][0], f"tensor {cut[0][1]}")
    assert "ends at byte" in err.value.message and "truncated" in err.value.fix
    assert not (tmp_path / "out").exists()
    _no_read_left(src)


@pytest.mark.parametrize("type", ["Q4_K", "Q6_K", "Q8_0", "IQ4_XS"])
def test_quantizing_rows_in_any_cut_gives_the_bytes_of_one_call(type):
    """What chunked units rely on: every type quantizes each row on its own (a K-quant's super-blocks run along the
    row), so rows quantized in runs cut anywhere are the bytes of the rows quantized at once."""
    from ktconvert.quant import quantize

    x = np.random.default_rng(1).standard_normal((13, 512)).astype(np.float32)
    whole = quantize(x, type)
    parts = np.concatenate([quantize(x[a:b], type) for a, b in ((0, 1), (1, 6), (6, 7), (7, 13))])
    assert parts.tobytes() == whole.tobytes()


def test_a_unit_read_ahead_with_an_importance_matrix_writes_the_single_read_bytes(ckpt, tmp_path, monkeypatch):
    """Chunks cut inside experts still quantize each row with its own expert's importances (quantize --imatrix)."""
    from ktconvert.convert import convert
    from ktconvert.convert import execute as ex
    from ktconvert.convert import worker
    from ktconvert.formats.imatrix import ImatrixEntry, imatrix_gguf_bytes

    plain = convert(ckpt, tmp_path / "plain", type="Q4_0", tokenizer=False, allow_fallback=True).out / "model.gguf"
    rng, entries = np.random.default_rng(2), {}
    for name, info in open_checkpoint(plain).items():
        if "_exps." in name:
            e, n_in = info.shape[0], info.shape[-1]
            entries[name] = ImatrixEntry(rng.uniform(0.1, 4.0, (e, n_in)).astype(np.float32), np.full(e, 8, np.float32))
    assert entries
    imx = tmp_path / "imatrix.gguf"
    imx.write_bytes(imatrix_gguf_bytes(entries, datasets=("t",), chunk_count=8, chunk_size=64))
    monkeypatch.setattr(worker, "READ_AHEAD_CHUNK", 1)
    runs = {}
    for label, least in (("page cache", 1 << 62), ("read ahead", 0)):
        monkeypatch.setattr(ex, "DIRECT_MIN", least)
        out = tmp_path / label
        convert(ckpt, out, type="Q4_0", tokenizer=False, allow_fallback=True, imatrix=imx)
        runs[label] = json.loads((out / "manifest.json").read_text())["files"]
    assert runs["read ahead"] == runs["page cache"]
    with_imx = json.loads((tmp_path / "read ahead" / "manifest.json").read_text())["files"]
    assert with_imx != json.loads((tmp_path / "plain" / "manifest.json").read_text())["files"]


def _kt_amx_run(src, out, least: int, monkeypatch) -> tuple[dict, dict | None]:
    """A kt-amx AMXINT8 conversion of ``src`` whose units are joined into groups reading ``least`` bytes around the
    page cache (1 MiB: several of the tiny model's 256 KiB experts a group); its manifest's files and plan."""
    from ktconvert.convert import convert
    from ktconvert.convert import execute as ex

    monkeypatch.setattr(ex, "DIRECT_MIN", least)
    convert(src, out, format="kt-amx", type="AMXINT8", threadpool_count=2)
    man = json.loads((out / "manifest.json").read_text())
    return man["files"], man.get("plan")


def test_kt_amx_experts_read_ahead_in_groups_write_the_page_cache_bytes(tiny_root, tmp_path, monkeypatch):
    """kt-amx units (one expert projection each) joined into groups read around the page cache, every read done by
    a thread ahead of the packer: the same files (manifest sha256) and resume digests as every unit read through the
    page cache, and the same where the filesystem refuses O_DIRECT (read through the page cache, without a word)."""
    from ktconvert.convert import worker

    used, real_ahead = [], files.ReadAhead

    class Counting(real_ahead):
        def __init__(self, reads, bufs):
            reads = list(reads)
            used.append(len(reads))
            super().__init__(reads, bufs)

    monkeypatch.setattr(worker, "ReadAhead", Counting)
    src = tiny_root / "qwen3_moe"
    want = _kt_amx_run(src, tmp_path / "page cache", 1 << 62, monkeypatch)
    assert not used
    assert _kt_amx_run(src, tmp_path / "read ahead", 1 << 20, monkeypatch) == want
    assert used and max(used) >= 4  # groups of several experts, each group one thread's reads
    real_open = os.open

    def refusing_open(path, flags, *a, **kw):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(files.os, "open", refusing_open)
    assert _kt_amx_run(src, tmp_path / "refused", 1 << 20, monkeypatch) == want
    assert files._NO_DIRECT == {os.stat(src).st_dev}


def test_a_truncated_file_under_a_kt_amx_group_is_one_line_and_renames_nothing(tiny_root, tmp_path, monkeypatch):
    """The checkpoint cut short while a group of experts is read ahead: the single read's one line (the file, the
    tensor, "truncated"), raised where the packer reaches that expert; no read left behind (the read-ahead thread
    idle, no file open), no output."""
    import shutil

    from ktconvert.errors import InputError

    src = tmp_path / "src"
    shutil.copytree(tiny_root / "qwen3_moe", src)
    cut = _cut_under_read(monkeypatch, lambda tensor, first: "experts.2." in tensor)  # the third expert's read
    with pytest.raises(InputError) as err:
        _kt_amx_run(src, tmp_path / "out", 1 << 20, monkeypatch)
    assert cut and (err.value.path, err.value.where) == (cut[0][0], f"tensor {cut[0][1]}")
    assert "ends at byte" in err.value.message and "truncated" in err.value.fix
    assert not (tmp_path / "out").exists()
    _no_read_left(src)


# --- writes around the page cache ------------------------------------------------------------------------------------


@pytest.mark.parametrize("offset", [0, 1, 4095, 4096, 6000])
@pytest.mark.parametrize("sizes", [(10,), (4096,), (3000, 9000, 1), (8192, 4096, 5)])
def test_a_write_around_the_page_cache_leaves_the_bytes_of_a_plain_write(tmp_path, offset, sizes):
    """Whole blocks with O_DIRECT by the write-behind thread (gathered from several buffers into one aligned one),
    the partial blocks at either end through the page cache, between bytes already there: the file a plain write
    leaves, byte for byte."""
    rng = np.random.default_rng(offset + len(sizes))
    views = [memoryview(rng.integers(0, 256, n, dtype=np.uint8)) for n in sizes]
    before = rng.integers(0, 256, offset + sum(sizes) + 5000, dtype=np.uint8).tobytes()
    want = bytearray(before)
    want[offset: offset + sum(sizes)] = b"".join(bytes(v) for v in views)
    path = tmp_path / "f"
    path.write_bytes(before)
    fd, direct = os.open(path, os.O_WRONLY), files.open_direct(path, os.O_WRONLY)
    behind = files.WriteBehind((ReadBuffer(), ReadBuffer()))
    try:
        behind.write(path, fd, direct, views, offset)
        behind.flush()
        assert not behind.refused
    finally:
        behind.close()
        os.close(fd)
        if direct is not None:
            os.close(direct)
    assert path.read_bytes() == bytes(want)
    assert (direct is not None) == _direct_allowed(path)


@pytest.mark.parametrize("seed", range(6))
def test_writes_one_after_the_other_share_their_partial_blocks_around_the_page_cache(tmp_path, monkeypatch, seed):
    """Writes laid end to end (a group's units), with gaps, tiny writes, a second file and flushes between them:
    each write's trailing partial block is held back and written whole with the next write's first bytes, so a run
    of writes goes through the page cache only at its two ends; the files are those plain writes leave, byte for
    byte."""
    rng = np.random.default_rng(seed)
    paths = [tmp_path / "a", tmp_path / "b"]
    size = 24 << 20
    want = {p: bytearray(rng.integers(0, 256, size, dtype=np.uint8).tobytes()) for p in paths}
    for p in paths:
        p.write_bytes(bytes(want[p]))
    if not _direct_allowed(paths[0]):
        pytest.skip("this filesystem refuses O_DIRECT")
    fds = {p: (os.open(p, os.O_WRONLY), files.open_direct(p, os.O_WRONLY)) for p in paths}
    cached, real = [], files.os.pwritev

    def counting(fd, bufs, offset, *a):
        if not fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            cached.append((offset, sum(len(b) for b in bufs)))
        return real(fd, bufs, offset, *a)

    monkeypatch.setattr(files.os, "pwritev", counting)
    behind = files.WriteBehind((ReadBuffer(), ReadBuffer()))
    try:
        # one run of contiguous writes: the page cache takes only its first and its last partial block
        p, at = paths[0], 1000
        for n in (300_000, 5_000, 70, 123_457, 4096, 1, 200_000):
            data = rng.integers(0, 256, n, dtype=np.uint8)
            behind.write(p, *fds[p], [memoryview(data[:n // 3]), memoryview(data[n // 3:])], at)
            want[p][at: at + n] = data.tobytes()
            at += n
        behind.flush()
        assert len(cached) == 2 and cached[0] == (1000, 4096 - 1000) and cached[1][0] + cached[1][1] == at
        # then random writes: runs, jumps over a gap, the other file, flushes; always past what is written (units
        # never overlap, so none lands on bytes a direct write still in flight covers)
        end = {paths[0]: at, paths[1]: 0}
        for _ in range(60):
            if rng.random() < 0.3:
                end[p] = at
                p = paths[int(rng.integers(2))]
                at = end[p] + int(rng.choice([1, 700, 4096, 9000]))
            n = int(rng.choice([1, 100, 4095, 4096, 5000, 70_000, 300_000]))
            data = rng.integers(0, 256, n, dtype=np.uint8)
            behind.write(p, *fds[p], [memoryview(data)], at)
            want[p][at: at + n] = data.tobytes()
            at += n
            if rng.random() < 0.1:
                behind.flush()
        behind.flush()
    finally:
        behind.close()
        for fd, direct in fds.values():
            os.close(fd)
            os.close(direct)
    for p in paths:
        assert p.read_bytes() == bytes(want[p]), p.name


def test_a_partial_block_held_back_is_written_when_the_writer_closes(tmp_path):
    """A write's last partial block, held back for a next write that never comes: on the disk once the writer is
    closed, with no flush before."""
    path = tmp_path / "f"
    path.write_bytes(bytes(3 * 4096))
    if not _direct_allowed(path):
        pytest.skip("this filesystem refuses O_DIRECT")
    fd, direct = os.open(path, os.O_WRONLY), files.open_direct(path, os.O_WRONLY)
    data = np.arange(9000, dtype=np.uint8)
    behind = files.WriteBehind((ReadBuffer(),))
    try:
        behind.write(path, fd, direct, [memoryview(data)], 0)
    finally:
        behind.close()
        os.close(fd)
        os.close(direct)
    assert path.read_bytes() == data.tobytes() + bytes(3 * 4096 - 9000)


def test_a_filesystem_refusing_the_direct_write_is_written_through_the_page_cache(tmp_path, monkeypatch):
    """Opened with O_DIRECT, the write refused (EINVAL: an alignment the filesystem needs): the same bytes through
    the page cache, the filesystem remembered (not asked again), the path in the writer's ``refused``."""
    path = tmp_path / "f"
    path.write_bytes(bytes(3 * 4096))
    if not _direct_allowed(path):
        pytest.skip("this filesystem refuses O_DIRECT")
    monkeypatch.setattr(files.os, "pwritev", _failing_direct(files.os.pwritev, errno.EINVAL, "Invalid argument"))
    data = memoryview(np.arange(9000, dtype=np.uint8))
    fd, direct = os.open(path, os.O_WRONLY), files.open_direct(path, os.O_WRONLY)
    behind = files.WriteBehind((ReadBuffer(),))
    try:
        behind.write(path, fd, direct, [data], 100)
        behind.flush()
        assert behind.refused == {str(path)}
    finally:
        behind.close()
        os.close(fd)
        os.close(direct)
    assert path.read_bytes()[100:9100] == bytes(data)
    assert files._NO_DIRECT == {os.stat(path).st_dev} and files.open_direct(path, os.O_WRONLY) is None


@pytest.mark.parametrize("to,type", [("kt-amx", "AMXINT8"), ("gguf", "Q8_0")])
def test_a_conversion_writing_around_the_page_cache_writes_the_same_files(tiny_root, tmp_path, monkeypatch, to, type):
    """Every unit's output written with O_DIRECT (DIRECT_WRITE_MIN 0) against none: the same files, and the
    manifest's sha256 is the sha256 of the file on disk, whether the hasher takes the units' bytes from the memory
    the converting process kept of them (as it does) or reads them all back around the page cache (HELD_MAX 0)."""
    import hashlib

    from ktconvert.convert import convert
    from ktconvert.convert import execute as ex
    from ktconvert.convert import worker

    seen, real = [], files.WriteBehind.write

    def counting(self, path, fd, direct, *a):
        seen.append(direct is not None)
        return real(self, path, fd, direct, *a)

    monkeypatch.setattr(files.WriteBehind, "write", counting)
    kept, real_written = [], ex._OutputHashes.written

    def keeping(self, path, offset, views):
        kept.append(sum(len(v) for v in views))
        return real_written(self, path, offset, views)

    monkeypatch.setattr(ex._OutputHashes, "written", keeping)
    from ktconvert.io import atomic

    read_back, real_back = [], atomic.read_direct

    def reading_back(path, offset, nbytes, *a, **kw):
        read_back.append(nbytes)
        return real_back(path, offset, nbytes, *a, **kw)

    monkeypatch.setattr(atomic, "read_direct", reading_back)
    runs, back = {}, {}
    for label, least, held in (("page cache", 1 << 62, ex.HELD_MAX), ("direct", 0, ex.HELD_MAX),
                               ("read back", 0, 0)):
        monkeypatch.setattr(worker, "DIRECT_WRITE_MIN", least)
        monkeypatch.setattr(ex, "HELD_MAX", held)
        out = tmp_path / label
        convert(tiny_root / "qwen3_moe", out, type=type, format="kt-amx" if to == "kt-amx" else None,
                tokenizer=False)
        runs[label] = json.loads((out / "manifest.json").read_text())["files"]
        back[label] = sum(read_back)
        read_back.clear()
    assert runs["direct"] == runs["page cache"] == runs["read back"]
    assert back["direct"] < back["read back"]  # the kept bytes were not read back
    assert kept and sum(kept) > 0  # the unit thread handed its bytes to the hasher
    for name, f in runs["direct"].items():
        assert hashlib.sha256((tmp_path / "direct" / name).read_bytes()).hexdigest() == f["sha256"], name
    assert any(seen) == _direct_allowed(tmp_path / "direct" / next(iter(runs["direct"])))


def test_a_write_failing_behind_the_unit_is_raised_before_its_group_reports(tmp_path, monkeypatch):
    """The disk full under the write-behind thread: the error comes out of the flush a group ends with (and of any
    later write), not lost in the thread; nothing is written after it."""
    path = tmp_path / "f"
    path.write_bytes(bytes(4 * 4096))
    if not _direct_allowed(path):
        pytest.skip("this filesystem refuses O_DIRECT")
    monkeypatch.setattr(files.os, "pwritev", _failing_direct(files.os.pwritev, errno.ENOSPC, "No space left on device"))
    fd, direct = os.open(path, os.O_WRONLY), files.open_direct(path, os.O_WRONLY)
    behind = files.WriteBehind((ReadBuffer(),))
    try:
        behind.write(path, fd, direct, [memoryview(bytes(range(256)) * 32)], 0)
        with pytest.raises(OSError) as err:
            behind.flush()
        assert err.value.errno == errno.ENOSPC
        with pytest.raises(OSError):
            behind.write(path, fd, direct, [memoryview(bytes(8192))], 8192)
    finally:
        behind.close()
        os.close(fd)
        os.close(direct)
    assert path.read_bytes() == bytes(4 * 4096)
