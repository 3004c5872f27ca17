"""One contract for every command (issue 15): on failure ``-o json`` prints one JSON error object (code, message,
file, place, fix) on stdout and the one-line message on stderr; click usage errors are one line; ``-q`` is
accepted before or after the command and leaves nothing on stdout when the run succeeds; sizes below what can
work are refused with the minimum."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from convert_helpers import tiny
from ktconvert.cli import COMMANDS, cli

# a failing invocation of every command that has -o json: (args, exit code)
FAILING_JSON = {
    "check-rules": (["check-rules", "{missing}", "-o", "json"], 3),
    "inspect": (["inspect", "{missing}", "-o", "json"], 3),
    "quantize": (["quantize", "{missing}", "{tmp}/out", "--type", "Q8_0", "-o", "json"], 3),
    "convert-lora": (["convert-lora", "{missing}", "{tmp}/out", "-o", "json"], 3),
    "verify": (["verify", "--model", "{missing}", "--rules", "{missing}", "--weights", "{missing}", "--golden",
                "{missing}", "-o", "json"], 3),
    "gate": (["gate", "{missing}", "-o", "json"], 3),
    "preflight": (["preflight", "--kt-method", "AMXINT8", "--no-such-flag", "-o", "json"], 2),
    "tiny-model": (["tiny-model", "no_such_family", "{tmp}/t", "-o", "json"], 2),
    "doctor": (["doctor", "--no-such-flag", "-o", "json"], 2),
    "imatrix": (["imatrix", "{tmp}/model", "{tmp}/o.gguf", "--text-file", "{missing}", "-o", "json"], 2),
}


def _run(args, tmp_path):
    words = [a.format(missing=tmp_path / "missing", tmp=tmp_path) for a in args]
    return CliRunner().invoke(cli, words)


@pytest.mark.parametrize("command", sorted(FAILING_JSON))
def test_json_error_object_on_failure(command, tmp_path):
    args, code = FAILING_JSON[command]
    res = _run(args, tmp_path)
    assert res.exit_code == code, res.output
    err = json.loads(res.stdout)
    assert err["status"] == "error" and err["exit_code"] == code and err["tool"] == f"ktconvert {command}"
    assert set(err["error"]) == {"code", "message", "file", "place", "fix"} and err["error"]["fix"]
    if code == 3:
        assert err["error"]["file"] and "missing" in err["error"]["file"]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ktconvert: error: ")


def test_every_json_command_is_covered():
    import inspect as pyinspect
    import importlib

    with_json = set()
    for name, target in COMMANDS.items():
        module = importlib.import_module(target.split(":")[0])
        if '"json"' in pyinspect.getsource(module):
            with_json.add(name)
    assert with_json <= set(FAILING_JSON), with_json - set(FAILING_JSON)


@pytest.mark.parametrize("args", [
    ["quantize"], ["inspect"], ["--bogus"], ["no-such-command"], ["check-rules", "--format", "yaml", "x"],
    ["quantize", "a", "b", "--jobs", "0"],
])
def test_usage_errors_are_one_line_exit_2(args):
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 2 and res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ktconvert: error: ") and "--help" in lines[0], res.stderr


def test_quiet_before_or_after_the_command(tmp_path):
    src = tiny(tmp_path, "qwen3_moe")
    for args in (["-q", "inspect", src], ["inspect", src, "-q"], ["tiny-model", "mixtral", tmp_path / "t", "-q"],
                 ["-q", "quantize", src, tmp_path / "o", "--type", "Q8_0"]):
        res = CliRunner().invoke(cli, [str(a) for a in args])
        assert res.exit_code == 0 and res.stdout == "", (args, res.output)
    res = CliRunner().invoke(cli, ["inspect", str(tmp_path / "nothing"), "-q"])  # failures still say why
    assert res.exit_code == 3 and "no such file" in res.stderr
    # -q after `--` belongs to the pasted command line, not to ktconvert
    from ktconvert.cli import _hoist_levels

    assert _hoist_levels(["preflight", "--", "x", "-q"]) == ["preflight", "--", "x", "-q"]
    assert _hoist_levels(["preflight", "-q", "--", "x"]) == ["-q", "preflight", "--", "x"]


def test_max_memory_below_what_can_work_is_refused_with_the_minimum(tmp_path):
    src = tiny(tmp_path, "qwen3_moe")
    res = CliRunner().invoke(cli, ["quantize", str(src), str(tmp_path / "o"), "--type", "Q4_K",
                                   "--max-memory", "1KiB", "-j", "2"])
    assert res.exit_code == 2 and "below the minimum" in res.stderr and "--max-memory" in res.stderr
    least = res.stderr.split("pass --max-memory ")[1].split()[0]
    assert not (tmp_path / "o").exists() and not (tmp_path / ".o.ktconvert-partial").exists()
    res = CliRunner().invoke(cli, ["-q", "quantize", str(src), str(tmp_path / "o"), "--type", "Q4_K",
                                   "--max-memory", least, "-j", "2"])
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize("preset", [None, "3"])
def test_numpy_blas_starts_no_spinning_threads_unless_the_user_asks(preset):
    """``ktconvert`` sets OPENBLAS_NUM_THREADS=1 before any command imports numpy (OpenBLAS otherwise starts a thread
    per core that spins about 0.1 CPU-s, in every process and -j worker); a value the user set stands."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    if preset is not None:
        env["OPENBLAS_NUM_THREADS"] = preset
    code = ("import os, sys\n"
            "from ktconvert.cli import main\n"
            "try:\n    main(['--version'])\nexcept SystemExit:\n    pass\n"
            "import numpy\n"
            "tasks = len(os.listdir('/proc/self/task')) if os.path.isdir('/proc/self/task') else -1\n"
            "print(os.environ['OPENBLAS_NUM_THREADS'], tasks)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    value, tasks = out.stdout.split()[-2:]
    assert value == (preset or "1")
    if preset is None and int(tasks) > 0:
        assert int(tasks) == 1  # numpy imported, no BLAS thread beside the main one
