"""Hostile and mistaken output paths and environments (issue 31): each is one line with the right exit code and
leaves nothing behind, never an internal error or a traceback. OUT a dangling symlink; OUT ``.`` with --force; a
model directory whose name is not UTF-8 (converted, general.name sanitised, with a note); golden on a full disk;
``gate --junit`` / ``verify --plot`` into a missing directory (refused before the run); golden with an absurd
vocab_size; Ctrl-C while ``quantize -j 2`` starts its workers; ``tiny-model --lora`` into its own OUT."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from convert_helpers import tiny
from ktconvert.cli import cli

Q = ["--type", "Q8_0", "--max-memory", "64KiB"]


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return tiny(tmp_path_factory.mktemp("hostile-paths"), "qwen3_moe")


def _one_line(res, code: int, start: str) -> str:
    assert res.exit_code == code, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(start), res.stderr
    assert "internal error" not in lines[0]
    return lines[0]


def _listing(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


@pytest.mark.parametrize("command", ["quantize", "tiny-model", "convert-lora", "golden"])
def test_out_a_dangling_symlink_is_refused_and_a_plain_rerun_works(src, tmp_path, monkeypatch, command):
    monkeypatch.delenv("CI", raising=False)
    out = tmp_path / "out"
    out.symlink_to(tmp_path / "nowhere" / "x")
    args = {"quantize": ["quantize", str(src), str(out), *Q], "tiny-model": ["tiny-model", "qwen3_moe", str(out)],
            "convert-lora": ["convert-lora", str(src), str(out)],
            "golden": ["golden", str(src), str(out), "--prompt-ids", "1,2"]}[command]
    if command == "convert-lora":
        from ktconvert.model.tiny_lora import write_tiny_lora

        write_tiny_lora("qwen3_moe", tmp_path.parent / f"{tmp_path.name}-adapter")
        args = ["convert-lora", str(tmp_path.parent / f"{tmp_path.name}-adapter"), str(out),
                "--base-model-name-or-path", "tiny"]
    line = _one_line(CliRunner().invoke(cli, args), 2, f"ktconvert: error: {out}: output is a symbolic link to ")
    assert "does not exist" in line and "remove the link" in line
    assert _listing(tmp_path) == ["out"] and out.is_symlink()  # nothing made, the link untouched
    if command == "quantize":
        out.unlink()
        res = CliRunner().invoke(cli, args)
        assert res.exit_code == 0, res.output
        assert _listing(tmp_path) == ["out"] and (out / "model.gguf").is_file()


@pytest.mark.parametrize("command", ["quantize", "tiny-model"])
def test_out_dot_with_force_is_refused(src, tmp_path, monkeypatch, command):
    work = tmp_path / "work"
    work.mkdir()
    (work / "keep.txt").write_text("mine")
    monkeypatch.chdir(work)
    args = ["quantize", str(src), ".", *Q, "--force"] if command == "quantize" else \
        ["tiny-model", "qwen3_moe", ".", "--force"]
    line = _one_line(CliRunner().invoke(cli, args), 2, "ktconvert: error: .: output is the current directory")
    assert "choose a new directory" in line
    assert _listing(work) == ["keep.txt"] and _listing(tmp_path) == ["work"]


_NON_UTF8 = """
import json, sys
from click.testing import CliRunner
from ktconvert.cli import cli
res = CliRunner().invoke(cli, ["quantize", sys.argv[1], sys.argv[2], "--type", "Q8_0"])
print(json.dumps([res.exit_code, res.stdout, res.stderr]))
"""


@pytest.mark.parametrize("locale", ["C.UTF-8", "C"])
def test_a_model_directory_whose_name_is_not_utf8_converts_with_a_sanitised_name(src, tmp_path, locale):
    """The directory name becomes general.name (as convert_hf_to_gguf does); its undecodable byte is written as
    U+FFFD, and a note says so (stdout and manifest.json): the conversion works, under UTF-8 and C locales."""
    from gguf import GGUFReader

    root = os.fsencode(tmp_path)
    model = root + b"/mod\xffel"
    os.mkdir(model)
    for f in os.listdir(src):
        with open(src / f, "rb") as a, open(model + b"/" + os.fsencode(f), "wb") as b:
            b.write(a.read())
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LC_") and k != "LANG"}
    proc = subprocess.run([sys.executable, "-c", _NON_UTF8, model, str(out)], capture_output=True,
                          env={**env, "LC_ALL": locale}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    code, stdout, stderr = json.loads(proc.stdout)
    assert code == 0 and stderr == "", stderr
    assert "note: general.name 'Mod\ufffdEl'" in stdout and "not valid UTF-8" in stdout
    field = GGUFReader(out / "model.gguf").fields["general.name"]
    assert bytes(field.parts[-1]).decode("utf-8") == "Mod\ufffdEl"
    assert any("not valid UTF-8" in n for n in json.loads((out / "manifest.json").read_text())["plan"]["notes"])


def test_golden_on_a_full_disk_is_one_line_and_leaves_nothing(src, tmp_path, monkeypatch):
    from ktconvert.io import atomic

    monkeypatch.delenv("CI", raising=False)

    def full(path, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(atomic, "write_durable", full)
    out = tmp_path / "golden"
    res = CliRunner().invoke(cli, ["golden", str(src), str(out), "--prompt-ids", "1,2,3"])
    line = _one_line(res, 3, f"ktconvert: error: {out}: cannot write the output: No space left on device")
    assert "free space" in line
    assert _listing(tmp_path) == []  # no empty OUT, no temporary file, no lock


def test_golden_regenerated_on_a_full_disk_keeps_the_old_golden(src, tmp_path, monkeypatch):
    from ktconvert.io import atomic

    monkeypatch.delenv("CI", raising=False)
    out = tmp_path / "golden"
    assert CliRunner().invoke(cli, ["golden", str(src), str(out), "--prompt-ids", "1,2,3"]).exit_code == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real, calls = atomic.write_durable, {"n": 0}

    def full_after_one(path, data):
        calls["n"] += 1
        if calls["n"] > 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        real(path, data)

    monkeypatch.setattr(atomic, "write_durable", full_after_one)
    res = CliRunner().invoke(cli, ["golden", str(src), str(out), "--prompt-ids", "1,2", "--force"])
    _one_line(res, 3, f"ktconvert: error: {out}: cannot write the output")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before and _listing(tmp_path) == ["golden"]


@pytest.mark.parametrize("vocab,says", [
    # past any released model: the count validator refuses it from config.json alone
    (10**12, "vocab_size: vocab_size=1000000000000 must be at most 8388608"),
    # legal as a count, but not this checkpoint's: refused from the embedding's header, before transformers allocates
    (8_000_000, "vocab_size: vocab_size 8000000 disagrees"),
])
def test_golden_with_an_absurd_vocab_size_is_refused_before_allocating(src, tmp_path, monkeypatch, vocab, says):
    monkeypatch.delenv("CI", raising=False)
    model = tmp_path / "model"
    model.mkdir()
    for f in src.iterdir():
        (model / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((model / "config.json").read_text())
    cfg["vocab_size"] = vocab
    (model / "config.json").write_text(json.dumps(cfg))
    import ktconvert.golden.generate as gen

    monkeypatch.setattr(gen, "compute_golden", lambda *a, **k: pytest.fail("transformers ran"))
    out = tmp_path / "golden"
    line = _one_line(CliRunner().invoke(cli, ["golden", str(model), str(out), "--prompt-ids", "1,2"]), 3,
                     f"ktconvert: error: {model / 'config.json'}:{says}")
    if vocab == 8_000_000:
        assert "model.embed_tokens.weight has 512 rows" in line and "set vocab_size to 512" in line
    assert _listing(tmp_path) == ["model"]


def test_gate_junit_into_a_missing_directory_is_refused_before_the_run(tmp_path, monkeypatch):
    import ktconvert.gate as gate

    monkeypatch.setattr(gate, "run_suite", lambda *a, **k: pytest.fail("the suite ran"))
    junit = tmp_path / "no" / "such" / "report.xml"
    line = _one_line(CliRunner().invoke(cli, ["gate", "-k", "qwen3", "--junit", str(junit)]), 2,
                     f"ktconvert: error: {junit}:--junit: its directory {junit.parent} does not exist")
    assert "create the directory first" in line
    assert _listing(tmp_path) == []


def test_gate_junit_into_a_directory_that_cannot_be_written_is_refused_before_the_run(tmp_path, monkeypatch):
    import ktconvert.gate as gate
    from ktconvert.io import atomic

    monkeypatch.setattr(gate, "run_suite", lambda *a, **k: pytest.fail("the suite ran"))
    monkeypatch.setattr(atomic.os, "access", lambda path, mode: False)  # root passes every permission check
    junit = tmp_path / "report.xml"
    _one_line(CliRunner().invoke(cli, ["gate", "-k", "qwen3", "--junit", str(junit)]), 3,
              f"ktconvert: error: {junit}:--junit: its directory {tmp_path} is not writable")
    assert _listing(tmp_path) == []


def test_verify_plot_into_a_missing_directory_is_refused_before_the_run(tmp_path, monkeypatch):
    import ktconvert.verify as verify

    monkeypatch.setattr(verify, "run_verify", lambda *a, **k: pytest.fail("verify ran"))
    plot = tmp_path / "nope" / "nmse.png"
    res = CliRunner().invoke(cli, ["verify", "--model", "m", "--rules", "r.yaml", "--golden", "g", "--plot", str(plot)])
    _one_line(res, 2, f"ktconvert: error: {plot}:--plot: its directory {plot.parent} does not exist")


@pytest.mark.parametrize("lora", ["out/lora", "out"])
def test_tiny_model_lora_into_its_own_out_is_refused_before_anything_is_written(tmp_path, lora):
    out = tmp_path / "out"
    res = CliRunner().invoke(cli, ["tiny-model", "qwen3_moe", str(out), "--lora", str(tmp_path / lora)])
    line = _one_line(res, 2, f"ktconvert: error: {tmp_path / lora}: this output is ")
    assert f"{out}, another output of the same run" in line and "side by side" in line
    assert _listing(tmp_path) == []


def test_tiny_model_lora_beside_its_out_writes_both(tmp_path):
    res = CliRunner().invoke(cli, ["tiny-model", "qwen3_moe", str(tmp_path / "out"), "--lora", str(tmp_path / "lo")])
    assert res.exit_code == 0, res.output
    assert _listing(tmp_path) == ["lo", "out"] and (tmp_path / "lo" / "kt_adapter_manifest.json").is_file()


# Ctrl-C while `quantize -j 2` starts its worker (-j N: N - 1 worker processes beside the converting process, which
# converts in a thread of its own). A sitecustomize (in the child and in each spawned worker) holds every worker
# inside multiprocessing's start-up (spawn.prepare, before any task) until the test says go, after announcing
# itself: the SIGINT the terminal sends to the whole process group is sent exactly while the worker is starting,
# with no race on timing.
_STARTUP_SITE = """
import os, sys, time
if "--multiprocessing-fork" in sys.argv:
    import multiprocessing.spawn as _spawn
    _real = _spawn.prepare
    def _held(data):
        d = os.environ["KT_TEST_STARTUP_DIR"]
        open(os.path.join(d, "worker-%d" % os.getpid()), "w").close()
        while not os.path.exists(os.path.join(d, "go")):
            time.sleep(0.01)
        return _real(data)
    _spawn.prepare = _held
"""


@pytest.mark.slow  # a spawned worker imports numpy and ktconvert before the run can end (seconds on 2 busy cores)
def test_ctrl_c_while_quantize_j2_starts_its_workers_is_one_line(src, tmp_path):
    site, marks = tmp_path / "site", tmp_path / "marks"
    site.mkdir()
    marks.mkdir()
    (site / "sitecustomize.py").write_text(_STARTUP_SITE)
    env = {**os.environ, "KT_TEST_STARTUP_DIR": str(marks),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}
    out = tmp_path / "out"
    # SIGINT as a terminal leaves it (default): a test run started in the background by a non-interactive shell
    # inherits it ignored, and so would the run, which then never sees the Ctrl-C
    proc = subprocess.Popen([sys.executable, "-m", "ktconvert", "quantize", str(src), str(out), *Q, "-j", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 120
        while not list(marks.glob("worker-*")):
            if proc.poll() is not None or time.monotonic() > deadline:  # a held worker never ends by itself: kill
                os.killpg(proc.pid, signal.SIGKILL)                        # before reading what the run said
                pytest.fail(f"no worker started: {proc.communicate(timeout=60)}")
            time.sleep(0.01)
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        (marks / "go").touch()
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert proc.returncode == 130, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ktconvert: interrupted; rerun with --resume"), err
    assert not out.exists() and not (tmp_path / ".out.ktconvert-lock").exists()


_MANAGER_SITE = """
import os, signal, sys, time
import concurrent.futures.process as _cfp
_real = _cfp._ExecutorManagerThread.start
def _start(self):
    if not os.environ.pop("KT_TEST_SIGINT_ONCE", ""):
        return _real(self)
    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C after the manager thread is made, before it is started
    time.sleep(0.2)                      # (the handler runs at the next bytecode; as a real Ctrl-C can)
    return _real(self)
_cfp._ExecutorManagerThread.start = _start
"""


@pytest.mark.slow  # a spawned worker imports numpy and ktconvert before the run can end
def test_ctrl_c_inside_the_worker_pools_submit_is_one_line(src, tmp_path):
    """A Ctrl-C that lands inside ``ProcessPoolExecutor.submit``, between its manager thread's creation and start,
    made shutdown() fail to join that thread: "internal error: RuntimeError: cannot join thread before it is
    started", exit 3 (seen once in CI). The interrupt is now taken when submit returns: exit 130, one line."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_MANAGER_SITE)
    env = {**os.environ, "KT_TEST_SIGINT_ONCE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "ktconvert", "quantize", str(src), str(out), *Q, "-j", "2"],
                          capture_output=True, text=True, env=env, timeout=300,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    err = proc.stderr
    assert "internal error" not in err and "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert proc.returncode == 130, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ktconvert: interrupted; rerun with --resume"), err
    assert not out.exists() and not (tmp_path / ".out.ktconvert-lock").exists()
