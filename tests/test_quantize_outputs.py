"""``quantize SRC --output TYPE=DIR ...``: several outputs from one read of the source. Each output is byte for byte
its own single run (a GGUF preset, a kt-amx directory and a second GGUF type together, with -j 1 and -j 2), an
interrupted run resumes every output, a malformed --output is one line with exit 2 and nothing written, and every
manifest records where it came from (source headers' sha256, the recipe file's sha256, ktconvert's git commit)."""

from __future__ import annotations

import hashlib
import json
import struct
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from convert_helpers import tree_bytes
from ktconvert.cli import cli

# (--output TYPE, the single run that writes the same directory)
OUTPUTS = [("Q4_K_M", ["--recipe", "Q4_K_M"]), ("AMXINT4", ["--to", "kt-amx", "--type", "AMXINT4"]),
           ("Q8_0", ["--recipe", "Q8_0"])]


def _run(*args):
    return CliRunner().invoke(cli, ["quantize", *map(str, args)])


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The tiny qwen3_moe and each output written by its own run."""
    from ktconvert.model.tiny import write_tiny_model

    root = tmp_path_factory.mktemp("outputs")
    src = root / "qwen3_moe"
    write_tiny_model("qwen3_moe", src)
    refs = {}
    for spec, args in OUTPUTS:
        res = _run(src, root / spec, *args)
        assert res.exit_code == 0, res.output
        refs[spec] = tree_bytes(root / spec)
    return src, refs


def _outputs(tmp_path: Path) -> list[str]:
    return [a for spec, _ in OUTPUTS for a in ("--output", f"{spec}={tmp_path / spec}")]


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_each_output_is_its_single_run(single, tmp_path, jobs):
    src, refs = single
    res = _run(src, *_outputs(tmp_path), "-j", jobs, "--max-memory", "64MiB")
    assert res.exit_code == 0, res.output
    for spec, _ in OUTPUTS:
        assert tree_bytes(tmp_path / spec) == refs[spec], spec  # the model files and manifest.json alike
    assert res.stdout.count("wrote ") == 3


@pytest.mark.parametrize("refuse", [False, True])
def test_shared_reads_around_the_page_cache_or_through_it_are_the_single_runs(single, tmp_path, monkeypatch, refuse):
    """The groups' shared reads ask for O_DIRECT; a filesystem refusing it (tmpfs: EINVAL at open) is read through
    the page cache instead: either way every output is its single run's, byte for byte."""
    import errno
    import os

    from ktconvert.convert import execute
    from ktconvert.io import files

    real_open, asked = os.open, []

    def opening(path, flags, *a, **kw):
        if flags & getattr(os, "O_DIRECT", 0):
            asked.append(path)
            if refuse:
                raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(files, "_NO_DIRECT", set())
    monkeypatch.setattr(files.os, "open", opening)
    monkeypatch.setattr(execute, "DIRECT_MIN", 2**16)  # groups read around the page cache: the tiny model's too
    src, refs = single
    res = _run(src, *_outputs(tmp_path), "--max-memory", "64MiB")
    assert res.exit_code == 0, res.output
    for spec, _ in OUTPUTS:
        assert tree_bytes(tmp_path / spec) == refs[spec], spec
    if hasattr(os, "O_DIRECT"):
        assert asked and (len(asked) == 1) == refuse  # refused: asked once for the filesystem, then never again


@pytest.mark.parametrize("chunk", [None, 1])
def test_the_outputs_share_their_reads(single, tmp_path, monkeypatch, chunk):
    """The outputs' units are put in the order of the bytes they read: the three outputs' units of an expert's
    projection one after the other in one group read around the page cache, so the group's read-ahead reads those
    bytes once (a read announced twice in a row is read once). (Groups of 64 KiB per output: the tiny model's
    experts are far short of DIRECT_MIN.) ``chunk`` 1: experts larger than a read-ahead chunk (DeepSeek-V3's 28 MiB
    against 4 MiB) are still read once, whole, not in chunks a kt-amx unit does not read them in."""
    from ktconvert.convert import execute, parse_output, plan_outputs, worker
    from ktconvert.convert.execute import _Output, group_units, make_units
    from ktconvert.convert.worker import _checkpoint, _unit_reads, close_all

    src, _ = single
    monkeypatch.setattr(execute, "DIRECT_MIN", 2**16)
    if chunk is not None:
        monkeypatch.setattr(worker, "READ_AHEAD_CHUNK", chunk)
    plans = plan_outputs(src, [parse_output(f"{spec}={tmp_path / spec}") for spec, _ in OUTPUTS])
    outs = [_Output(p, tmp_path / spec) for p, (spec, _) in zip(plans, OUTPUTS)]
    todo = [(k, u) for k, o in enumerate(outs) for u in make_units(o.plan, 2**26, 1, shared=True)]
    groups = group_units(outs, todo)
    assert sorted((k, t.unit) for g in groups for k, t in g.tasks) == sorted((k, u.id) for k, u in todo)
    ck = _checkpoint(str(src))
    try:
        reads = {}  # expert tensor -> how many times the groups read it
        for g in groups:
            keys = [key for _, t in g.tasks if t.direct for key, _ in _unit_reads(ck, t)]
            for i, key in enumerate(keys):
                if ".experts." in key[0] and (i == 0 or keys[i - 1] != key):
                    reads[key[0]] = reads.get(key[0], 0) + 1
            experts = [k for k, t in g.tasks if ".experts." in str(_unit_reads(ck, t))]
            assert not experts or all(t.direct for _, t in g.tasks if ".experts." in str(_unit_reads(ck, t)))
    finally:
        close_all()
    assert reads and set(reads.values()) == {1}  # every expert tensor read once for the three outputs


def test_an_interrupted_run_resumes_every_output(single, tmp_path):
    from ktconvert.convert import convert_outputs, parse_output, partial_dir

    src, refs = single
    specs = [parse_output(f"{spec}={tmp_path / spec}") for spec, _ in OUTPUTS]
    calls = []

    def stop(done, total):
        calls.append(done)
        if len(calls) == 40:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        convert_outputs(src, specs, max_memory="1MiB", progress=stop)
    for s in specs:
        assert not s.out.exists() and (partial_dir(s.out) / ".ktconvert" / "journal").is_file()
    journaled = sum(len((partial_dir(s.out) / ".ktconvert" / "journal").read_text().splitlines()) for s in specs)
    assert journaled >= 39
    res = _run(src, *_outputs(tmp_path), "--max-memory", "1MiB", "--resume", "-o", "json")
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert sum(r["units_resumed"] for r in report) == journaled
    for spec, _ in OUTPUTS:
        assert tree_bytes(tmp_path / spec) == refs[spec], spec
        assert not partial_dir(tmp_path / spec).exists()


def test_resume_keeps_an_output_the_stopped_run_completed(single, tmp_path):
    """A run stopped between its renames: --resume keeps the renamed output (its manifest and files checked) and
    writes the missing one; without --resume the existing output is refused as ever."""
    import shutil

    src, refs = single
    outs = ["--output", f"Q4_K_M={tmp_path / 'Q4_K_M'}", "--output", f"AMXINT4={tmp_path / 'AMXINT4'}"]
    assert _run(src, *outs).exit_code == 0
    shutil.rmtree(tmp_path / "AMXINT4")
    before = (tmp_path / "Q4_K_M" / "model.gguf").stat().st_mtime_ns
    res = _run(src, *outs)
    assert res.exit_code == 2 and "output already exists" in res.stderr and not (tmp_path / "AMXINT4").exists()
    res = _run(src, *outs, "--resume", "-o", "json")
    assert res.exit_code == 0, res.output
    assert [r["units"] for r in json.loads(res.stdout)] == [0, 48]
    assert (tmp_path / "Q4_K_M" / "model.gguf").stat().st_mtime_ns == before
    for spec in ("Q4_K_M", "AMXINT4"):
        assert tree_bytes(tmp_path / spec) == refs[spec]


@pytest.mark.parametrize("args,says", [
    (["--output", "Q4_K_M"], "'Q4_K_M' is not TYPE=DIR"),
    (["--output", "Q4_K_Z={o}/a"], "Q4_K_Z is not a preset recipe, a ggml type, AMXINT8/AMXINT4"),
    (["--output", "Q4_K_M={o}/a", "--output", "Q8_0={o}/a"], "the same as"),
    (["--output", "Q4_K_M={o}/a", "--output", "Q8_0={o}/a/b"], "inside"),
    (["--output", "Q4_K_M={o}/a", "--type", "Q8_0"], "--type Q8_0 with --output"),
    (["{o}/x", "--output", "Q4_K_M={o}/a"], "OUT {o}/x with --output"),
    (["--output", "nope.yaml={o}/a"], "the recipe file nope.yaml does not exist"),
])
def test_a_malformed_output_is_one_line(single, tmp_path, args, says):
    src, _ = single
    args = [a.format(o=tmp_path) for a in args]
    res = _run(src, *args)
    assert res.exit_code == 2, res.output
    line = res.stderr.strip()
    assert "\n" not in line and "--output" in line and says.format(o=tmp_path) in line, line
    assert list(tmp_path.iterdir()) == []


def test_the_manifest_records_where_it_came_from(single, tmp_path):
    from ktconvert.convert.provenance import ROOT, git_commit
    from ktconvert.io import resources

    src, _ = single
    res = _run(src, "--output", f"Q4_K_M={tmp_path / 'q'}", "--output", f"AMXINT8={tmp_path / 'a'}")
    assert res.exit_code == 0, res.output
    data = (src / "model.safetensors").read_bytes()
    header = data[: 8 + struct.unpack("<Q", data[:8])[0]]
    preset = (resources.rules_dir() / "convert" / "Q4_K_M.yaml").read_bytes()
    for out in ("q", "a"):
        m = json.loads((tmp_path / out / "manifest.json").read_text())
        assert [f["header_sha256"] for f in m["source"]["files"]] == [hashlib.sha256(header).hexdigest()]
        assert m["tool"]["version"]
        if (ROOT / ".git").exists():
            head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
            assert m["tool"]["commit"] == head.stdout.strip() == git_commit()["commit"]
        else:
            assert "commit" not in m["tool"]
    m = json.loads((tmp_path / "q" / "manifest.json").read_text())
    assert m["recipe"]["name"] == "Q4_K_M" and m["recipe"]["sha256"] == hashlib.sha256(preset).hexdigest()


def test_no_commit_outside_a_git_checkout(tmp_path):
    from ktconvert.convert.provenance import git_commit

    assert git_commit(tmp_path) == {}
    (tmp_path / ".git").mkdir()  # a .git that is no repository: git fails, nothing is recorded
    assert git_commit(tmp_path) == {}


def _expert_group(single, tmp_path, monkeypatch):
    """The group of the three outputs' units that reads expert 0's up_proj (groups of 64 KiB per output), its
    output files made."""
    from ktconvert.convert import execute, parse_output, plan_outputs
    from ktconvert.convert.execute import _Output, group_units, make_units
    from ktconvert.convert.worker import segments_read

    src, _ = single
    monkeypatch.setattr(execute, "DIRECT_MIN", 2**16)
    plans = plan_outputs(src, [parse_output(f"{spec}={tmp_path / spec}") for spec, _ in OUTPUTS])
    outs = [_Output(p, tmp_path / spec) for p, (spec, _) in zip(plans, OUTPUTS)]
    for o in outs:  # the output files the units write into, laid out as execute_all lays them out
        o.partial.mkdir()
        for f in o.plan.files:
            with open(o.partial / f.name, "wb") as fh:
                fh.truncate(f.size)
    todo = [(k, u) for k, o in enumerate(outs) for u in make_units(o.plan, 2**26, 1, shared=True)]
    groups = group_units(outs, todo)
    return src, next(g for g in groups if any(".experts.0.up_proj" in s.source for _, t in g.tasks
                                              for s, _, _ in segments_read(t.tensor, t.r0, t.r1)))


def test_a_group_reads_each_shared_tensor_once(single, tmp_path, monkeypatch):
    """run_group over a group of the three outputs' expert units: the checkpoint reads each expert tensor once for
    all of them, around the page cache where the filesystem allows it, and maps none."""
    from ktconvert.convert import worker
    from ktconvert.formats.checkpoint import Checkpoint

    src, group = _expert_group(single, tmp_path, monkeypatch)
    reads, maps = [], []
    real_rows, real_read = Checkpoint.read_rows, Checkpoint.read
    monkeypatch.setattr(Checkpoint, "read_rows", lambda self, name, *a, **k: reads.append((name, k.get("direct")))
                        or real_rows(self, name, *a, **k))
    monkeypatch.setattr(Checkpoint, "read", lambda self, name: maps.append(name) or real_read(self, name))
    try:
        done = worker.run_group(group)
    finally:
        worker.close_all()
    assert {k for k, _, _ in done} == {0, 1, 2} and len(done) == len(group.tasks)
    experts = [n for n, _ in reads if ".experts." in n]
    assert experts and len(experts) == len(set(experts))  # three outputs' units, one read each
    assert all(d for n, d in reads if ".experts." in n) and not [n for n in maps if ".experts." in n]


def test_a_truncated_source_stops_a_group_with_one_line(single, tmp_path, monkeypatch):
    """A source file cut short under a running group (a shared read finds its end): the read's InputError, naming
    the file, the tensor and the fix, raised where its unit uses it; the reads ahead are stopped (the process's
    read-ahead thread idle, no other left)."""
    import threading

    from ktconvert.convert import worker
    from ktconvert.convert.worker import segments_read
    from ktconvert.errors import InputError
    from ktconvert.formats.checkpoint import Checkpoint

    src, group = _expert_group(single, tmp_path, monkeypatch)
    last = sorted(s.source for _, t in group.tasks for s, _, _ in segments_read(t.tensor, t.r0, t.r1)
                  if ".experts." in s.source)[-1]  # a tensor the group reads: its file ends there
    real = Checkpoint.read_rows

    def cut(self, name, r0, r1, buf=None, **how):
        if name == last:
            raise InputError("checkpoint file ends at byte 10, its header says data runs to 20",
                             path=str(self[name].file), where=f"tensor {name}", fix="the file is truncated; re-download it")
        return real(self, name, r0, r1, buf, **how)

    monkeypatch.setattr(Checkpoint, "read_rows", cut)
    try:
        with pytest.raises(InputError) as err:
            worker.run_group(group)
    finally:
        worker.close_all()
    assert err.value.where == f"tensor {last}" and "re-download" in str(err.value.fix)
    from ktconvert.io.files import ReadAhead

    assert not ReadAhead._busy
    assert all(t is ReadAhead._thread for t in threading.enumerate() if t.name == "ktconvert-read-ahead")
    out = tmp_path / "run"  # the whole command: one line, exit 3, no output and no partial directory left
    out.mkdir()
    res = _run(src, *_outputs(out))
    assert res.exit_code == 3, res.output
    line = res.stderr.strip()
    assert "\n" not in line and f"tensor {last}" in line and "re-download" in line, line
    assert list(out.iterdir()) == []


def test_a_recipe_file_names_an_output(single, tmp_path):
    """--output FILE.yaml=DIR: the recipe file's conversion (here a copy of the Q8_0 preset: the same model bytes),
    its manifest naming the file and its sha256."""
    from ktconvert.io import resources

    src, refs = single
    recipe = tmp_path / "my-q8.yaml"
    recipe.write_bytes((resources.rules_dir() / "convert" / "Q8_0.yaml").read_bytes())
    res = _run(src, "--output", f"{recipe}={tmp_path / 'q'}", "--output", f"amxint8={tmp_path / 'a'}")
    assert res.exit_code == 0, res.output
    assert (tmp_path / "q" / "model.gguf").read_bytes() == refs["Q8_0"]["model.gguf"]
    m = json.loads((tmp_path / "q" / "manifest.json").read_text())
    assert m["recipe"]["source"] == str(recipe) and m["recipe"]["sha256"] == hashlib.sha256(recipe.read_bytes()).hexdigest()
    assert json.loads((tmp_path / "a" / "manifest.json").read_text())["kt_amx"]["method"] == "AMXINT8"
