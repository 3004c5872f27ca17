"""Importance-matrix files (ktconvert/formats/imatrix.py) and ``quantize --imatrix``'s refusals.

The importances are what llama-quantize computes from each format (GGUF: in_sum2 / lround(count), 1 where an expert
got no tokens; legacy .dat: sums / ncall). Hostile files (truncated, another model's names or sizes, NaN, missing
metadata, a model GGUF) get one line, exit 3, and nothing is written. The byte-identity with llama-quantize is
tests/test_quantize_imatrix_parity.py.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from convert_helpers import tiny
from ktconvert.cli import cli
from ktconvert.errors import InputError
from ktconvert.formats.imatrix import read_imatrix


def write_imatrix_gguf(path: Path, entries: dict, *, meta: bool = True, general_type: str = "imatrix") -> Path:
    """An imatrix GGUF as llama-imatrix writes it: ``entries[name] = (sums (E, n) or (n,), counts (E,) or (1,))``."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch="", endianess=gguf.GGUFEndian.LITTLE)
    w.kv_data[0].pop("general.architecture", None)
    w.add_string("general.type", general_type)
    if meta:
        w.add_array("imatrix.datasets", ["text.txt"])
        w.add_uint32("imatrix.chunk_count", 3)
        w.add_uint32("imatrix.chunk_size", 64)
    for name, (sums, counts) in entries.items():
        sums = np.asarray(sums, dtype=np.float32)
        counts = np.asarray(counts, dtype=np.float32)
        w.add_tensor(f"{name}.in_sum2", sums)
        w.add_tensor(f"{name}.counts", counts.reshape(-1, 1) if sums.ndim == 2 else counts.reshape(1))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_imatrix_dat(path: Path, entries: dict, *, trailer: bool = True) -> Path:
    """A legacy .dat imatrix: ``entries[name] = (ncall, values)``."""
    out = struct.pack("<i", len(entries))
    for name, (ncall, values) in entries.items():
        v = np.asarray(values, dtype="<f4").reshape(-1)
        out += struct.pack("<i", len(name)) + name.encode() + struct.pack("<ii", ncall, v.size) + v.tobytes()
    if trailer:
        out += struct.pack("<i", 3) + struct.pack("<i", 8) + b"text.txt"
    path.write_bytes(out)
    return path


def test_gguf_importance_is_sums_over_rounded_counts_and_one_without_data(tmp_path):
    sums = np.array([[2.0, 4.0, 6.0], [1.0, 1.0, 1.0], [3.0, 0.0, 9.0]], dtype=np.float32)
    p = write_imatrix_gguf(tmp_path / "i.gguf", {"blk.0.ffn_up_exps.weight": (sums, [2.0, 0.0, 2.5]),
                                                  "blk.0.attn_q.weight": ([1.0, 3.0], [4.0])})
    imx = read_imatrix(p)
    got = imx.for_tensor("blk.0.ffn_up_exps.weight", (3, 5, 3))
    want = np.array([[1.0, 2.0, 3.0], [1.0, 1.0, 1.0], sums[2] / np.float32(3)], dtype=np.float32)  # lround(2.5) = 3
    assert got.dtype == np.float32 and np.array_equal(got, want)
    assert np.array_equal(imx.for_tensor("blk.0.attn_q.weight", (7, 2)), np.array([0.25, 0.75], np.float32))
    assert imx.for_tensor("blk.0.attn_k.weight", (7, 2)) is None
    assert imx.no_data == {"blk.0.ffn_up_exps.weight": (1,)}
    assert imx.format == "gguf" and imx.datasets == ("text.txt",) and imx.chunk_count == 3


def test_legacy_dat_importance_is_sums_over_ncall(tmp_path):
    p = write_imatrix_dat(tmp_path / "i.dat", {"blk.0.attn_q.weight": (4, [2.0, 6.0]),
                                                "blk.0.ffn_up_exps.weight": (0, [1.0, 2.0, 3.0, 4.0])})
    imx = read_imatrix(p)
    assert np.array_equal(imx.for_tensor("blk.0.attn_q.weight", (3, 2)), np.array([0.5, 1.5], np.float32))
    assert np.array_equal(imx.for_tensor("blk.0.ffn_up_exps.weight", (2, 3, 2)), [[1.0, 2.0], [3.0, 4.0]])
    assert imx.format == "dat" and imx.datasets == ("text.txt",) and imx.chunk_count == 3
    assert read_imatrix(write_imatrix_dat(tmp_path / "n.dat", {"a.weight": (1, [1.0])}, trailer=False)).values


def test_size_mismatch_is_refused_except_token_embd(tmp_path):
    p = write_imatrix_gguf(tmp_path / "i.gguf", {"blk.0.attn_q.weight": ([1.0, 3.0], [1.0]),
                                                  "token_embd.weight": ([1.0, 3.0], [1.0])})
    imx = read_imatrix(p)
    with pytest.raises(InputError, match="another model") as exc:
        imx.for_tensor("blk.0.attn_q.weight", (7, 3))
    assert "blk.0.attn_q.weight" in str(exc.value)
    assert imx.for_tensor("token_embd.weight", (7, 3)) is None  # llama-quantize quantizes it without one


# --- the command line: one line, exit 3, nothing written -------------------------------------------------------

def _files(root: Path) -> set:
    return set(root.rglob("*"))


def _refused(tmp_path: Path, src: Path, imatrix: Path, *args: str) -> str:
    out = tmp_path / "out"
    before = _files(tmp_path)
    res = CliRunner().invoke(cli, ["quantize", str(src), str(out), "--imatrix", str(imatrix), *args],
                             catch_exceptions=False)
    assert _files(tmp_path) == before, "something was written"
    lines = res.stderr.splitlines()
    assert res.exit_code == 3, res.stderr
    assert len(lines) == 1 and lines[0].startswith("ktconvert: error: ") and "Traceback" not in res.stderr, res.stderr
    assert str(imatrix) in lines[0] or imatrix.name in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return tiny(tmp_path_factory.mktemp("imx"), "qwen3_moe")


def _good(path: Path) -> Path:
    """A plausible imatrix for the tiny qwen3_moe: one dense and one merged-expert entry."""
    return write_imatrix_gguf(path, {"blk.0.attn_q.weight": (np.ones(256), [64.0]),
                                     "blk.0.ffn_up_exps.weight": (np.ones((8, 256)), np.full(8, 8.0))})


def _truncated(path: Path) -> Path:
    data = _good(path.with_suffix(".full")).read_bytes()
    path.with_suffix(".full").unlink()
    path.write_bytes(data[: len(data) - 100])
    return path


HOSTILE = {
    "truncated GGUF": (lambda p: _truncated(p / "t.gguf"), ["truncated"]),
    "truncated .dat": (lambda p: (p / "t.dat").write_bytes(
        write_imatrix_dat(p / "x.dat", {"blk.0.attn_q.weight": (1, np.ones(256))}).read_bytes()[:300]) and p / "t.dat",
                       ["ends at byte 300", "truncated"]),
    "another model's names": (lambda p: write_imatrix_gguf(p / "o.gguf", {
        "model.layers.0.mlp.w1.weight": (np.ones(256), [1.0])}), ["another model", "none of its 1 entries"]),
    "another model's sizes": (lambda p: write_imatrix_gguf(p / "s.gguf", {
        "blk.0.attn_q.weight": (np.ones(512), [1.0])}), ["another model", "512 values", "blk.0.attn_q.weight"]),
    "experts of another model": (lambda p: write_imatrix_gguf(p / "e.gguf", {
        "blk.0.ffn_up_exps.weight": (np.ones((4, 256)), np.ones(4))}), ["1024 values", "8 expert(s)"]),
    "NaN sum": (lambda p: write_imatrix_gguf(p / "n.gguf", {
        "blk.0.attn_q.weight": (np.r_[np.ones(255), np.nan], [1.0])}), ["nan at index 255", "in_sum2"]),
    "negative count": (lambda p: write_imatrix_gguf(p / "c.gguf", {
        "blk.0.attn_q.weight": (np.ones(256), [-3.0])}), ["-3.0", "counts"]),
    "no metadata": (lambda p: write_imatrix_gguf(p / "m.gguf", {
        "blk.0.attn_q.weight": (np.ones(256), [1.0])}, meta=False), ["without imatrix.datasets"]),
    "a model GGUF": (lambda p: write_imatrix_gguf(p / "g.gguf", {
        "blk.0.attn_q.weight": (np.ones(256), [1.0])}, meta=False, general_type="model"),
                     ["a model GGUF, not an importance matrix"]),
    "sums without counts": (lambda p: _only_sums(p / "u.gguf"), ["has no .counts partner"]),
    "not an imatrix at all": (lambda p: (p / "z.dat").write_bytes(b"\xff\xff\xff\xff junk") and p / "z.dat",
                              ["entry count -1"]),
}


def _only_sums(path: Path) -> Path:
    import gguf

    w = gguf.GGUFWriter(str(path), arch="")
    w.kv_data[0].pop("general.architecture", None)
    w.add_string("general.type", "imatrix")
    w.add_array("imatrix.datasets", ["t"])
    w.add_uint32("imatrix.chunk_count", 1)
    w.add_uint32("imatrix.chunk_size", 1)
    w.add_tensor("blk.0.attn_q.weight.in_sum2", np.ones(256, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_imatrix_is_one_line_exit_3_nothing_written(tmp_path, model, case):
    make, expect = HOSTILE[case]
    files = tmp_path / "in"
    files.mkdir()
    imatrix = make(files)
    line = _refused(tmp_path, model, imatrix, "--type", "Q4_K")
    for s in expect:
        assert s in line, (s, line)


def test_imatrix_needs_gguf_output(tmp_path, model):
    res = CliRunner().invoke(cli, ["quantize", str(model), str(tmp_path / "out"), "--type", "BF16", "--to",
                                   "safetensors", "--imatrix", str(_good(tmp_path / "i.gguf"))])
    assert res.exit_code == 2 and "--imatrix applies to GGUF output" in res.stderr, res.stderr
    assert not (tmp_path / "out").exists()


def test_include_and_exclude_weights_together_is_a_usage_error(tmp_path, model):
    imx = _good(tmp_path / "i.gguf")
    for args, expect in ((["--imatrix", str(imx), "--include-weights", "ffn", "--exclude-weights", "attn"],
                          "cannot be used together"),
                         (["--include-weights", "ffn"], "add --imatrix FILE")):
        res = CliRunner().invoke(cli, ["quantize", str(model), str(tmp_path / "out"), "--type", "Q4_K", *args])
        assert res.exit_code == 2 and expect in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
        assert not (tmp_path / "out").exists()
