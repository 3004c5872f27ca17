"""Hostile and broken inputs: each one is a one-line error naming the file, the place and a fix; exit 3; no
traceback unless -v."""

from __future__ import annotations

import json
import struct
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner

from formats_helpers import gguf_bytes, gguf_kv_u32, gguf_str, gguf_tensor_info, st_bytes, write_gguf
from ktconvert.cli import cli

F32 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


def _torch_zip(p):
    import torch

    torch.save({"w": torch.zeros(2)}, p)


def _torch_pickle(p):
    import torch

    torch.save({"w": torch.zeros(2)}, p, _use_new_zipfile_serialization=False)


def _truncated(p):
    from safetensors.numpy import save_file

    save_file({"a": np.zeros(4, np.float32), "b": np.ones(64, np.float32)}, p)
    p.write_bytes(p.read_bytes()[:-10])


def _absurd_header(p):
    with open(p, "wb") as f:  # a sparse 100 MB file, so the length fits the file but not the limit
        f.write(struct.pack("<Q", 100_000_001))
        f.truncate(100_000_100)


def _gguf_truncated(p):
    write_gguf(p, "qwen3moe", {"token_embd.weight": np.zeros((16, 32), np.float32)})
    p.write_bytes(p.read_bytes()[:-100])


def _gguf_ok(p):
    write_gguf(p, "qwen3moe", {"token_embd.weight": np.zeros((16, 32), np.float32)})


def _split_missing_shard(p):
    d = p.parent
    for i in (1, 3):
        write_gguf(d / f"m-{i:05d}-of-00003.gguf", "qwen3moe", {f"t{i}": np.zeros(4, np.float32)})
    return d / "m-00001-of-00003.gguf"


def _split_from_two_sets(p):
    import gguf

    d = p.parent
    for stem, n in (("a", 12), ("b", 8)):
        w = gguf.GGUFWriter(d / f"{stem}.gguf", "qwen3moe", split_max_tensors=n)
        for i in range(20):
            w.add_tensor(f"t{i}", np.zeros(4, np.float32))
        w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    (d / "a-00002-of-00002.gguf").unlink()
    (d / "b-00003-of-00003.gguf").rename(d / "a-00002-of-00002.gguf")
    return d / "a-00001-of-00002.gguf"


def _index(p, weight_map, shards=()):
    from safetensors.numpy import save_file

    d = p.parent
    for name, tensors in shards:
        save_file(tensors, d / name)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return d


def _dup_across_shards(p):
    z = np.zeros(2, np.float32)
    return _index(p, {"a": "s1.safetensors", "b": "s2.safetensors"},
                  [("s1.safetensors", {"a": z, "b": z}), ("s2.safetensors", {"b": z})])


def _pickles_only(p):
    _torch_zip(p.parent / "pytorch_model.bin")
    return p.parent


def _unrelated_ggufs(p):
    _gguf_ok(p.parent / "x.gguf")
    _gguf_ok(p.parent / "y.gguf")
    return p.parent


def _bad_config(p):
    from safetensors.numpy import save_file

    save_file({"a": np.zeros(2, np.float32)}, p)
    (p.parent / "config.json").write_text("{not json")


def _broken_index(p):
    (p.parent / "model.safetensors.index.json").write_text("{")
    return p.parent


def _bytes(data):
    return lambda p: p.write_bytes(data)


T = gguf_tensor_info
CASES = {
    # name: (file name, builder, substrings of the one-line message)
    "torch-zip-named-safetensors": ("w.safetensors", _torch_zip, ["zip archive", "torch.save", ":byte 0:", "weights_only=True", "never unpickles"]),
    "torch-pickle-named-safetensors": ("w.safetensors", _torch_pickle, ["Python pickle", "weights_only=True"]),
    "truncated-data": ("w.safetensors", _truncated, ["tensor b @ byte", "truncated"]),
    "header-length-past-eof": ("w.safetensors", _bytes(st_bytes({"a": F32}, bytes(8), length=10**6)), ["header length 1000000 is larger than the rest of the file"]),
    "header-length-huge": ("w.safetensors", _bytes(struct.pack("<Q", 2**63) + b"{}"), ["header length 9223372036854775808 is larger"]),
    "header-length-absurd": ("w.safetensors", _absurd_header, ["header length 100000001 is absurd"]),
    "header-invalid-json": ("w.safetensors", _bytes(st_bytes(b'{"a": {"dtype": "F32",', bytes(8))), ["not valid JSON", ":byte "]),
    "header-not-utf8": ("w.safetensors", _bytes(st_bytes(b'{"\xff": 1}')), ["not UTF-8", ":byte 10:"]),
    "header-deep-nesting": ("w.safetensors", _bytes(st_bytes(b"[" * 100_000 + b"]" * 100_000)), ["cannot be used: RecursionError"]),
    "offsets-overlap": ("w.safetensors", _bytes(st_bytes({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                                                          "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(12))),
                        ["tensor b @ byte", "overlaps tensor a"]),
    "offsets-past-end": ("w.safetensors", _bytes(st_bytes({"a": {"dtype": "F32", "shape": [16], "data_offsets": [0, 64]}}, bytes(8))),
                         ["tensor a @ byte", "data ends at byte", "truncated"]),
    "offsets-disagree-with-shape": ("w.safetensors", _bytes(st_bytes({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8))),
                                    ["tensor a", "is 12 bytes but data_offsets span 8"]),
    "unknown-dtype": ("w.safetensors", _bytes(st_bytes({"a": {"dtype": "F12", "shape": [2], "data_offsets": [0, 8]}}, bytes(8))), ["unknown dtype 'F12'"]),
    "absurd-shape": ("w.safetensors", _bytes(st_bytes({"a": {"dtype": "F32", "shape": [2**40] * 3, "data_offsets": [0, 8]}}, bytes(8))), ["tensor a: shape", "is absurd"]),
    "negative-shape": ("w.safetensors", _bytes(st_bytes({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, bytes(8))), ["non-negative integers"]),
    "bad-metadata": ("w.safetensors", _bytes(st_bytes({"__metadata__": {"k": 1}, "a": F32}, bytes(8))), ["__metadata__ must map strings to strings"]),
    "duplicate-tensor-names": ("w.safetensors", _bytes(st_bytes(b'{"a": %s, "a": %s}' % (json.dumps(F32).encode(), json.dumps(F32).encode()), bytes(8))),
                               ["duplicate tensor name 'a'", "tensor a"]),
    "duplicate-across-shards": ("x", _dup_across_shards, ["s2.safetensors:tensor b", "also stored in s1.safetensors"]),
    "empty-file": ("w.safetensors", _bytes(b""), ["file is empty"]),
    "short-file": ("w.safetensors", _bytes(b"\x01\x00"), ["file is 2 bytes"]),
    "gguf-named-safetensors": ("w.safetensors", _gguf_ok, ["this is a GGUF file", "name it *.gguf"]),
    "gguf-bad-magic": ("w.gguf", _bytes(gguf_bytes(magic=b"GGUX")), ["bad magic b'GGUX'", ":byte 0:"]),
    "gguf-pickle": ("w.gguf", _torch_zip, ["this is a zip archive (what torch.save writes since PyTorch 1.6), not GGUF"]),
    "gguf-version-1": ("w.gguf", _bytes(gguf_bytes(version=1)), ["unsupported GGUF version 1"]),
    "gguf-version-99": ("w.gguf", _bytes(gguf_bytes(version=99)), ["unsupported GGUF version 99", "newer than this ktconvert"]),
    "gguf-big-endian": ("w.gguf", _bytes(b"GGUF" + struct.pack(">IQQ", 3, 0, 0)), ["big-endian GGUF", "gguf-convert-endian"]),
    "gguf-absurd-tensor-count": ("w.gguf", _bytes(gguf_bytes(n_tensors=2**40)), ["absurd counts: 1099511627776 tensors"]),
    "gguf-absurd-kv-count": ("w.gguf", _bytes(gguf_bytes(n_kv=2**63 - 1)), ["absurd counts", "9223372036854775807 KV pairs"]),
    "gguf-data-past-eof": ("w.gguf", _gguf_truncated, ["tensor token_embd.weight @ byte", "data ends at byte", "truncated"]),
    "gguf-string-past-eof": ("w.gguf", _bytes(gguf_bytes(n_kv=1, body=gguf_str("general.name") + struct.pack("<I", 8) + gguf_str(b"x", length=2**50))),
                             ["needs 1125899906842624 bytes"]),
    "gguf-array-past-eof": ("w.gguf", _bytes(gguf_bytes(n_kv=1, body=gguf_str("a") + struct.pack("<IIQ", 9, 6, 2**60))),
                            ["array a of 1152921504606846976 FLOAT32"]),
    "gguf-nested-array": ("w.gguf", _bytes(gguf_bytes(n_kv=1, body=gguf_str("a") + struct.pack("<IIQ", 9, 9, 1) + bytes(16))),
                          ["nested arrays"]),
    "gguf-duplicate-kv": ("w.gguf", _bytes(gguf_bytes(n_kv=2, body=gguf_kv_u32("k", 1) + gguf_kv_u32("k", 2))), ["duplicate KV key 'k'"]),
    "gguf-duplicate-tensor": ("w.gguf", _bytes(gguf_bytes(n_tensors=2, body=T("t", (32,), 0, 0) + T("t", (32,), 0, 128) + bytes(512))),
                              ["duplicate tensor name 't'"]),
    "gguf-overlap": ("w.gguf", _bytes(gguf_bytes(n_tensors=2, body=T("t", (32,), 0, 0) + T("u", (32,), 0, 96) + bytes(512))),
                     ["tensor u @ byte", "overlaps tensor t"]),
    "gguf-bad-alignment": ("w.gguf", _bytes(gguf_bytes(n_kv=1, body=gguf_kv_u32("general.alignment", 24))), ["general.alignment 24 is not a power of two"]),
    "gguf-unknown-type": ("w.gguf", _bytes(gguf_bytes(n_tensors=1, body=T("t", (32,), 4, 0) + bytes(256))), ["unknown ggml type 4"]),
    "gguf-too-many-dims": ("w.gguf", _bytes(gguf_bytes(n_tensors=1, body=T("t", (1, 1, 1, 1, 1), 0, 0) + bytes(64))), ["5 dimensions"]),
    "gguf-row-not-a-block-multiple": ("w.gguf", _bytes(gguf_bytes(n_tensors=1, body=T("t", (48, 2), 12, 0) + bytes(512))),
                                      ["row length ne0=48 is not a multiple of the Q4_K block size 256"]),
    "gguf-misaligned-offset": ("w.gguf", _bytes(gguf_bytes(n_tensors=1, body=T("t", (4,), 0, 8) + bytes(64))), ["data offset 8 is not a multiple of the alignment 32"]),
    "gguf-huge-dims": ("w.gguf", _bytes(gguf_bytes(n_tensors=1, body=T("t", (2**63, 2**63), 0, 0))), ["needs more bytes than the file holds"]),
    "split-set-missing-shard": ("x", _split_missing_shard, ["split GGUF set is incomplete: 1 of 3 shards missing (m-00002-of-00003.gguf)"]),
    "split-set-mixed-conversions": ("x", _split_from_two_sets, ["a-00002-of-00002.gguf:split.no", "say shard 3 of 3, but the file name says shard 2 of 2", "different conversions"]),
    "index-missing-shards": ("x", lambda p: _index(p, {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}),
                             ["model.safetensors.index.json:tensor a", "2 shard file(s) that do not exist"]),
    "index-path-traversal": ("x", lambda p: _index(p, {"a": "../../etc/passwd"}), ["points outside the checkpoint directory"]),
    "index-tensor-not-in-shard": ("x", lambda p: _index(p, {"a": "s.safetensors", "zz": "s.safetensors"},
                                                          [("s.safetensors", {"a": np.zeros(2, np.float32)})]),
                                  ["tensor zz", "index says shard s.safetensors holds this tensor, but no shard does"]),
    "index-invalid-json": ("x", _broken_index, ["model.safetensors.index.json:1:2: index is not valid JSON"]),
    "no-such-path": ("missing/none.safetensors", None, ["no such file or directory"]),
    "dir-with-only-pickles": ("x", _pickles_only, ["only PyTorch pickles such as pytorch_model.bin", "weights_only=True"]),
    "dir-with-unrelated-ggufs": ("x", _unrelated_ggufs, ["2 unrelated GGUF files", "pass the file"]),
    "bad-config-json": ("w.safetensors", _bad_config, ["config.json:1:2: config.json is not valid JSON"]),
}


def _make(tmp_path, name):
    fname, builder, expect = CASES[name]
    p = tmp_path / fname
    if builder is not None:
        made = builder(p)
        p = made if hasattr(made, "parent") else p  # builders return the path to open when it is not p
    return p, expect


def _invoke(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


@pytest.mark.parametrize("name", sorted(CASES))
def test_hostile_input_is_one_line_exit_3(tmp_path, name):
    p, expect = _make(tmp_path, name)
    res = _invoke("inspect", str(p))
    assert res.exit_code == 3, res.output
    assert res.stdout == ""
    lines = res.stderr.splitlines()
    assert len(lines) == 1, res.stderr
    line = lines[0]
    assert line.startswith("ktconvert: error: ") and "Traceback" not in res.stderr
    assert str(tmp_path) in line  # names the file
    assert line.endswith(")") and " (" in line  # ends with the fix
    for s in expect:
        assert s in line, (s, line)


@pytest.mark.parametrize("name", ["truncated-data", "gguf-bad-magic", "index-missing-shards"])
def test_verbose_adds_the_traceback(tmp_path, name):
    p, _ = _make(tmp_path, name)
    res = _invoke("-v", "inspect", str(p))
    assert res.exit_code == 3 and "Traceback (most recent call last)" in res.stderr
    assert res.stderr.splitlines()[-1].startswith("ktconvert: error: ")


def test_real_entry_point_in_a_subprocess(tmp_path):
    p, _ = _make(tmp_path, "torch-zip-named-safetensors")
    res = subprocess.run([sys.executable, "-m", "ktconvert", "inspect", str(p)], capture_output=True, text=True)
    assert res.returncode == 3 and res.stdout == ""
    assert res.stderr.count("\n") == 1 and "zip archive" in res.stderr and "Traceback" not in res.stderr


def test_bad_tensor_regex_is_a_usage_error(tmp_path):
    from safetensors.numpy import save_file

    save_file({"a": np.zeros(2, np.float32)}, tmp_path / "w.safetensors")
    res = _invoke("inspect", str(tmp_path / "w.safetensors"), "--tensors", "(")
    assert res.exit_code == 2 and "--tensors '(' is not a valid regex" in res.stderr
