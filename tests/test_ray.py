"""``--executor ray``: conversions and gate cases as Ray tasks on a local cluster (one per module, 2 CPUs).

The output of a Ray run is byte-identical to the local executor's (GGUF and kt-amx); a worker killed by pid in the
middle of a unit is retried by Ray and the output is still identical (and with retries off the same kill stops the
run with one line); a NaN in the input fails the run once, with the local run's one line; an interrupted run is
resumed by the other executor; each worker's peak RSS stays inside the memory its tasks asked Ray for; the gate's
cases run as Ray tasks and give the local run's results. Without ray installed, ``--executor ray`` is one line.
Skipped, with the reason, only where ray cannot be imported (never under CI, which installs the ``ray`` extra).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
import xml.etree.ElementTree as ET

import numpy as np
import pytest
from click.testing import CliRunner

from convert_helpers import tree_bytes
from ktconvert.cli import cli

Q4K = ["--type", "Q4_K", "--max-memory", "4MiB"]  # the local reference: 45 units
RAY = ["--type", "Q4_K", "--max-memory", "1GiB", "-j", "2", "--executor", "ray"]  # 512 MiB asked per task; 27 units,
# most 0.05-0.1 s: a kill lands inside one
RSS_BUDGET, RSS_JOBS = 2**30, 2


def _ray():
    try:
        import ray
    except ImportError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"CI installs the ray extra, but ray does not import: {exc}")
        pytest.skip(f"ray is not installed here ({exc}); pip install 'ktconvert[ray]'")
    return ray


@pytest.fixture(scope="module")
def cluster():
    ray = _ray()
    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=100 * 2**20,
             logging_level=logging.ERROR, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    from ktconvert.model.tiny import write_tiny_model

    out = tmp_path_factory.mktemp("ray-src") / "qwen3_moe"  # its own: tests elsewhere damage inputs on purpose
    write_tiny_model("qwen3_moe", out)
    return out


@pytest.fixture(scope="module")
def local_q4k(src, tmp_path_factory):
    out = tmp_path_factory.mktemp("ray-ref") / "q4k"
    assert _quantize(src, out, *Q4K).exit_code == 0
    return tree_bytes(out)


def _quantize(src, out, *args):
    return CliRunner().invoke(cli, ["quantize", str(src), str(out), *args])


def test_gguf_is_byte_identical_to_local(cluster, src, local_q4k, tmp_path):
    res = _quantize(src, tmp_path / "out", *RAY, "-o", "json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["units"] == 27  # one per tensor here; 45 in the local run: the bytes do not care
    assert tree_bytes(tmp_path / "out") == local_q4k


def test_kt_amx_is_byte_identical_to_local(cluster, src, tmp_path):
    from ktconvert.convert import convert

    for method in ("AMXINT8", "AMXINT4"):
        kw = dict(type=method, format="kt-amx", threadpool_count=2)
        local = convert(src, tmp_path / f"local-{method}", **kw)
        remote = convert(src, tmp_path / f"ray-{method}", jobs=2, executor="ray", **kw)
        assert remote.units == local.units == 48
        assert tree_bytes(remote.out) == tree_bytes(local.out)


def test_several_outputs_from_one_read_are_byte_identical_to_local(cluster, src, local_q4k, tmp_path):
    """quantize --output ... as Ray tasks: each output is its own local run's, byte for byte."""
    from ktconvert.convert import convert

    local = convert(src, tmp_path / "local-amx", type="AMXINT4", format="kt-amx")
    res = CliRunner().invoke(cli, ["quantize", str(src), "--output", f"Q4_K={tmp_path / 'q'}", "--output",
                                   f"AMXINT4={tmp_path / 'a'}", *RAY[2:], "-o", "json"])
    assert res.exit_code == 0, res.output
    assert [r["units"] for r in json.loads(res.stdout)] == [27 - 6 + 48, 48]  # Q4_K: each expert its own unit
    assert tree_bytes(tmp_path / "q") == local_q4k
    assert tree_bytes(tmp_path / "a") == tree_bytes(local.out)


# --- a worker killed by pid in the middle of a unit ---------------------------------------------------------------
def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read()
    except OSError:
        return b""


def _ray_workers() -> list[int]:
    """This machine's Ray worker processes (their title is ``ray::IDLE`` or ``ray::TASK``)."""
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and _cmdline(int(p)).startswith(b"ray::")]


def _kill_one_mid_task(stop: threading.Event, killed: list) -> None:
    """SIGKILL a worker while it runs a conversion unit: stopped first (SIGSTOP) so that its title, read again,
    proves it is still inside the unit when it dies."""
    title = b"ray::ktconvert-unit"
    while not stop.is_set():
        for pid in _ray_workers():
            if not _cmdline(pid).startswith(title):
                continue
            os.kill(pid, signal.SIGSTOP)
            if _cmdline(pid).startswith(title):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                return
            os.kill(pid, signal.SIGCONT)
        time.sleep(0.002)


def _run_with_a_kill(src, out, *extra):
    stop, killed = threading.Event(), []
    killer = threading.Thread(target=_kill_one_mid_task, args=(stop, killed), daemon=True)
    killer.start()
    try:
        res = _quantize(src, out, *RAY, *extra)
    finally:
        stop.set()
        killer.join()
    assert killed, "no worker was caught inside a unit"
    return res, killed[0]


def test_worker_killed_mid_unit_is_retried_and_the_output_is_identical(cluster, src, local_q4k, tmp_path, monkeypatch):
    res, pid = _run_with_a_kill(src, tmp_path / "out")
    assert res.exit_code == 0, res.output
    assert not os.path.exists(f"/proc/{pid}/cmdline") or not _cmdline(pid)  # it really died
    assert tree_bytes(tmp_path / "out") == local_q4k

    # the same kill with Ray's retries off stops the run: the kill above was inside a unit, and Ray's retry saved it
    import ktconvert.cluster

    monkeypatch.setattr(ktconvert.cluster, "MAX_RETRIES", 0)
    res, _ = _run_with_a_kill(src, tmp_path / "again")
    assert res.exit_code == 3
    line = res.stderr.strip()
    assert "\n" not in line and "a Ray worker running ktconvert-unit was lost 1 times" in line, line
    assert not (tmp_path / "again").exists() and not (tmp_path / ".again.ktconvert-partial").exists()


def test_data_error_fails_once_with_the_local_one_line(cluster, tmp_path_factory, tmp_path):
    from test_quantize_hostile import _variant

    def poison(t):
        t["model.layers.1.mlp.experts.5.down_proj.weight"][7, 9] = np.nan

    bad = _variant(tmp_path_factory.mktemp("ray-nan-models"), tmp_path, "qwen3_moe", edit=poison)
    lines, seconds = {}, {}
    for executor in ("local", "ray"):
        began = time.monotonic()
        res = _quantize(bad, tmp_path / executor, "--type", "Q8_0", "--executor", executor)
        seconds[executor] = time.monotonic() - began
        assert res.exit_code == 3, res.output
        lines[executor] = res.stderr.strip()
        assert not (tmp_path / executor).exists() and not (tmp_path / f".{executor}.ktconvert-partial").exists()
    assert "tensor model.layers.1.mlp.experts.5.down_proj.weight: non-finite value nan at row 7, column 9" in lines["ray"]
    assert lines["ray"] == lines["local"]  # the same one line, nothing about retries
    assert seconds["ray"] < 60, seconds


def _attempt(args):
    """A Ray task body that counts its attempts in a file, then fails as ``args`` says."""
    path, errno_ = args
    with open(path, "a") as fh:
        fh.write("x")
    if errno_ is None:
        from ktconvert.errors import InputError

        raise InputError("bad data", path=path)
    raise OSError(errno_, os.strerror(errno_), path)


@pytest.mark.parametrize("errno_,attempts", [(None, 1), (5, 4), (28, 1)])  # a data error, EIO, ENOSPC
def test_only_transient_io_errors_are_retried(cluster, tmp_path, errno_, attempts):
    import ray.cloudpickle

    from ktconvert import cluster as kc
    from ktconvert.errors import InputError

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import this test module
    path = tmp_path / "attempts"
    with pytest.raises(InputError if errno_ is None else OSError) as info:
        kc.run_tasks(cluster, _attempt, [(str(path), errno_)], limit=1, on_done=lambda r: None)
    assert path.read_text() == "x" * attempts  # 1 + MAX_RETRIES for EIO only
    if errno_ is None:
        assert info.value.one_line() == f"{path}: bad data"
    else:
        assert type(info.value) is OSError and info.value.errno == errno_


# --- --resume across executors --------------------------------------------------------------------------------------
def _interrupt_after(n: int):
    """A progress callback that stops the run (as Ctrl-C does) once ``n`` units' worth of calls have come."""
    calls = {"n": 0}

    def progress(done, total):
        calls["n"] += 1
        if calls["n"] > n:
            raise KeyboardInterrupt

    return progress


@pytest.mark.parametrize("first,then", [("local", "ray"), ("ray", "local")])
def test_resume_continues_a_run_of_the_other_executor(cluster, src, local_q4k, tmp_path, first, then):
    from ktconvert.convert import convert

    out = tmp_path / "out"
    runs = {"local": dict(max_memory="4MiB", jobs=1), "ray": dict(max_memory="1GiB", jobs=2)}
    with pytest.raises(KeyboardInterrupt):
        convert(src, out, type="Q4_K", executor=first, progress=_interrupt_after(10), **runs[first])
    partial = tmp_path / ".out.ktconvert-partial" / ".ktconvert"
    units = len(json.loads((partial / "state.json").read_text())["units"])  # the first run's, whoever resumes
    done = len((partial / "journal").read_text().splitlines())
    assert 5 <= done < units and not out.exists()
    result = convert(src, out, type="Q4_K", executor=then, resume=True, **runs[then])
    assert result.units_resumed == done and result.units == units - done
    assert tree_bytes(out) == local_q4k


def test_worker_peak_rss_stays_inside_its_task_request(cluster, src, tmp_path):
    """Every Ray worker's peak RSS (VmHWM: Python, ray, numpy, torch, the unit) is inside the memory its tasks asked
    Ray for. Runs before the gate test, whose workers build whole models outside any conversion budget."""
    from ktconvert.convert import convert
    from ktconvert.convert.execute import ray_task_memory

    convert(src, tmp_path / "q4k", type="Q4_K", max_memory=RSS_BUDGET, jobs=RSS_JOBS, executor="ray")
    convert(src, tmp_path / "amx", type="AMXINT4", format="kt-amx", max_memory=RSS_BUDGET, jobs=RSS_JOBS,
            executor="ray")
    peaks = {}
    for pid in _ray_workers():
        with open(f"/proc/{pid}/status") as fh:
            status = dict(line.split(":", 1) for line in fh if ":" in line)
        peaks[pid] = int(status["VmHWM"].split()[0]) * 1024
    assert peaks
    asked = ray_task_memory(RSS_BUDGET, RSS_JOBS)
    print(f"ray worker peak RSS (MiB): {sorted(round(v / 2**20) for v in peaks.values())}; asked {asked / 2**20:.0f}")
    assert max(peaks.values()) <= asked, peaks


def test_ray_units_leave_room_for_the_worker_and_too_little_is_refused(cluster, src, tmp_path):
    """A Ray task's request is its whole --max-memory share, so its units are sized to that share less the worker
    process's own memory (RAY_WORKER_RESERVE): a share below that is refused, as is one no node can give."""
    from ktconvert.convert import plan_conversion
    from ktconvert.convert.execute import RAY_WORKER_RESERVE, make_units

    plan = plan_conversion(src, type="Q4_K")
    assert make_units(plan, 2 * (RAY_WORKER_RESERVE + 2**21), 2, RAY_WORKER_RESERVE) == make_units(plan, 2**22, 2)
    for budget, code, says in (("512MiB", 2, "with 384 MiB for each Ray worker process"),
                               ("4TiB", 3, "no node of the cluster offers that much")):
        res = _quantize(src, tmp_path / "out", "--type", "Q8_0", "--max-memory", budget, "-j", "2", "--executor", "ray")
        assert res.exit_code == code and says in res.stderr and len(res.stderr.splitlines()) == 1, res.output
        assert not (tmp_path / "out").exists() and not (tmp_path / ".out.ktconvert-partial").exists()


# --- the gate -------------------------------------------------------------------------------------------------------
def test_gate_cases_run_as_ray_tasks_with_the_local_results(cluster, tmp_path):
    select = "qwen2_moe-[fb]*"  # qwen2_moe-f32 and -bf16: two conversions, two tasks
    runs = {}
    for executor in ("local", "ray"):
        junit = tmp_path / f"{executor}.xml"
        res = CliRunner().invoke(cli, ["gate", "-k", select, "-j", "2", "--executor", executor, "--junit", str(junit),
                                       "-o", "json"])
        assert res.exit_code == 0, res.output
        runs[executor] = json.loads(res.stdout)
        cases = [tc.get("name") for tc in ET.parse(junit).getroot().iter("testcase")]
        assert cases == ["qwen2_moe-f32", "qwen2_moe-bf16"]
    for a, b in zip(runs["local"]["cases"], runs["ray"]["cases"]):
        assert (a["name"], a["verdict"], a["summary"]) == (b["name"], b["verdict"], b["summary"])


# --- without a cluster ----------------------------------------------------------------------------------------------
def test_without_ray_installed_executor_ray_is_one_line(src, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray now fails as it does where it is not installed
    for args in (["quantize", str(src), str(tmp_path / "out"), "--type", "Q8_0"], ["gate", "-k", "qwen2_moe-f32"]):
        res = CliRunner().invoke(cli, [*args, "--executor", "ray"])
        assert res.exit_code == 3, res.output
        assert res.stderr.strip() == ("ktconvert: error: --executor ray needs ray, which is not installed "
                                      "(pip install 'ktconvert[ray]')")
    assert not (tmp_path / "out").exists() and not (tmp_path / ".out.ktconvert-partial").exists()


def test_ray_address_without_executor_ray_is_a_usage_error(src, tmp_path):
    res = _quantize(src, tmp_path / "out", "--type", "Q8_0", "--ray-address", "auto")
    assert res.exit_code == 2 and "--ray-address needs --executor ray" in res.stderr, res.output


def test_an_address_nothing_answers_on_is_one_line_at_once(src, tmp_path):
    _ray()
    import socket

    with socket.socket() as sock:  # a loopback port that was free a moment ago: nothing listens on it
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    began = time.monotonic()
    res = _quantize(src, tmp_path / "out", "--type", "Q8_0", "--executor", "ray", "--ray-address", f"127.0.0.1:{port}")
    assert res.exit_code == 3 and time.monotonic() - began < 10, res.output
    assert res.stderr.startswith(f"ktconvert: error: --ray-address: cannot reach the Ray cluster at 127.0.0.1:{port}: ")
    assert len(res.stderr.splitlines()) == 1 and not (tmp_path / "out").exists()
