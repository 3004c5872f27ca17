"""The readers return exactly what the reference implementations (safetensors, gguf-py, torch) read."""

from __future__ import annotations

import json

import numpy as np
import pytest

from formats_helpers import FAMILIES, H, I, gguf_from_hf, hf_checkpoint, write_gguf
from ktconvert.errors import InputError
from ktconvert.formats import open_checkpoint
from ktconvert.io.dtypes import decode_float32


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("readers")


def test_safetensors_values_and_offsets_match_the_safetensors_package(root):
    from safetensors import safe_open

    path = hf_checkpoint(root, "deepseek_v3", "split")
    ck = open_checkpoint(path)
    with safe_open(str(path / "model.safetensors"), "np") as f:
        assert list(ck) == list(f.keys()) or sorted(ck) == sorted(f.keys())
        for name in f.keys():
            info = ck[name]
            assert info.shape == tuple(f.get_slice(name).get_shape())
            assert info.ne == tuple(reversed(info.shape))
            assert info.dtype == f.get_slice(name).get_dtype()
            arr = ck.read(name)
            assert isinstance(arr, np.memmap) and not arr.flags.writeable
            np.testing.assert_array_equal(arr, f.get_tensor(name))


def test_bf16_is_raw_bits_and_decodes_like_torch(root):
    import torch
    from safetensors.torch import load_file

    path = hf_checkpoint(root, "qwen3_moe", "split", "bfloat16")
    ck = open_checkpoint(path)
    ref = load_file(str(path / "model.safetensors"))
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    assert ck[name].dtype == "BF16" and ck[name].shape == (H, I)
    raw = ck.read(name)
    assert raw.dtype == np.uint16 and raw.shape == (H, I)
    np.testing.assert_array_equal(raw, ref[name].view(torch.uint16).numpy())
    np.testing.assert_array_equal(ck.read_float32(name), ref[name].float().numpy())


@pytest.mark.parametrize("dtype", ["F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "F8_E8M0"])
def test_every_float8_code_decodes_like_torch(dtype, tmp_path):
    import torch
    from safetensors.torch import save_file

    tdt = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
           "F8_E5M2FNUZ": torch.float8_e5m2fnuz, "F8_E8M0": torch.float8_e8m0fnu}[dtype]
    codes = torch.arange(256, dtype=torch.uint8).view(tdt)
    try:
        save_file({"t": codes.reshape(16, 16)}, str(tmp_path / "f8.safetensors"))
    except Exception as exc:  # older safetensors may lack a dtype; then only decode against torch
        pytest.skip(f"safetensors cannot write {dtype}: {exc}")
    ck = open_checkpoint(tmp_path / "f8.safetensors")
    assert ck["t"].dtype == dtype and ck["t"].shape == (16, 16)
    ours = ck.read_float32("t").reshape(-1)
    theirs = codes.float().numpy()
    np.testing.assert_array_equal(np.isnan(ours), np.isnan(theirs))
    ok = ~np.isnan(theirs)
    np.testing.assert_array_equal(ours[ok], theirs[ok])


def test_sub_byte_dtype_is_a_flat_byte_view_and_is_not_decoded(tmp_path):
    from formats_helpers import st_bytes

    p = tmp_path / "f4.safetensors"
    p.write_bytes(st_bytes({"t": {"dtype": "F4", "shape": [4, 6], "data_offsets": [0, 12]}}, bytes(range(12))))
    ck = open_checkpoint(p)
    assert ck["t"].nbytes == 12 and ck.read("t").shape == (12,)
    with pytest.raises(InputError, match="cannot decode F4"):
        ck.read_float32("t")


def test_sharded_directory_through_the_index(root):
    path = hf_checkpoint(root, "deepseek_v3", "split", max_shard_size="40KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 3
    ck = open_checkpoint(path)
    assert set(ck) == set(index)
    for name, shard in index.items():
        assert ck[name].file.name == shard
    assert open_checkpoint(path / "model.safetensors.index.json").files == ck.files
    single = open_checkpoint(hf_checkpoint(root, "deepseek_v3", "split"))
    for name in list(index)[:20]:
        np.testing.assert_array_equal(ck.read(name), single.read(name))


def _reader_view(reader, name):
    return next(t for t in reader.tensors if t.name == name)


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_gguf_header_matches_gguf_reader(root, model_type):
    """Our parser against gguf-py's own reader: names, ne, types, offsets, sizes, data and KV values."""
    import gguf

    path = gguf_from_hf(root, model_type) / "model.gguf"
    ck = open_checkpoint(path)
    reader = gguf.GGUFReader(path)
    assert [t.name for t in reader.tensors] == list(ck)
    for t in reader.tensors:
        info = ck[t.name]
        assert info.ne == tuple(int(d) for d in t.shape)
        assert info.ggml_type == int(t.tensor_type)
        assert info.offset == t.data_offset and info.nbytes == t.n_bytes
        ours = ck.read(t.name)
        theirs = t.data if t.tensor_type != gguf.GGMLQuantizationType.BF16 else t.data.view(np.uint16)
        assert ours.shape == theirs.shape
        np.testing.assert_array_equal(ours, theirs)
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        assert ck.kv(key) == field.contents(), key


def test_gguf_expert_slab_decodes_like_gguf_dequantize(root):
    import gguf

    path = gguf_from_hf(root, "qwen3_moe") / "model.gguf"
    ck = open_checkpoint(path)
    name = "blk.1.ffn_gate_exps.weight"
    assert ck[name].dtype == "Q8_0" and ck[name].shape == (8, I, H) and ck[name].ne == (H, I, 8)
    full = gguf.quants.dequantize(np.asarray(ck.read(name)), gguf.GGMLQuantizationType.Q8_0)
    for e in range(8):
        np.testing.assert_array_equal(ck.read_float32(name, e), full[e])


def test_split_gguf_set_from_any_shard_or_the_directory(root):
    d = gguf_from_hf(root, "qwen3_moe", split_max_tensors=12)
    shards = sorted(d.glob("*.gguf"))
    assert len(shards) == 4 and shards[0].name == "model-00001-of-00004.gguf"
    whole = open_checkpoint(gguf_from_hf(root, "qwen3_moe") / "model.gguf")
    for p in (d, shards[0], shards[2]):
        ck = open_checkpoint(p)
        assert ck.files == tuple(shards)
        assert set(ck) == set(whole)
        assert ck.metadata["general.architecture"] == "qwen3moe"
    ck = open_checkpoint(d)
    for name in whole:
        np.testing.assert_array_equal(ck.read(name), whole.read(name))


def test_gguf_short_arrays_are_eager_long_ones_lazy(tmp_path):
    import gguf

    p = tmp_path / "kv.gguf"
    w = gguf.GGUFWriter(p, "qwen3moe")
    w.add_array("short.ints", [1, 2, 3])
    w.add_token_list([f"tok{i}" for i in range(5000)])
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    ck = open_checkpoint(p)
    assert ck.metadata["short.ints"].values is not None and ck.kv("short.ints") == [1, 2, 3]
    tokens = ck.metadata["tokenizer.ggml.tokens"]
    assert tokens.values is None and tokens.length == 5000
    assert ck.kv("tokenizer.ggml.tokens")[4999] == "tok4999"


def test_bf16_gguf_tensor_is_raw_bits(tmp_path):
    import gguf

    vals = (np.arange(64, dtype=np.float32) / 8 - 4).reshape(2, 32)  # exactly representable in bfloat16
    bits = (vals.view(np.uint32) >> 16).astype(np.uint16)
    p = write_gguf(tmp_path / "bf16.gguf", "qwen3moe", {"w": (bits, gguf.GGMLQuantizationType.BF16)})
    ck = open_checkpoint(p)
    assert ck["w"].dtype == "BF16" and ck["w"].ne == (32, 2)
    np.testing.assert_array_equal(ck.read("w"), bits)
    np.testing.assert_array_equal(ck.read_float32("w"), vals)
    np.testing.assert_array_equal(decode_float32(bits, "BF16"), vals)


def test_index_note_for_tensors_the_index_omits(root, tmp_path):
    import shutil

    src = hf_checkpoint(root, "deepseek_v3", "split", max_shard_size="40KB")
    d = tmp_path / "ck"
    shutil.copytree(src, d)
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    shard_of = idx["weight_map"]
    dropped = next(n for n in sorted(shard_of) if list(shard_of.values()).count(shard_of[n]) > 1)
    del idx["weight_map"][dropped]
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    ck = open_checkpoint(d)
    assert any(dropped in n for n in ck.notes)


@pytest.mark.parametrize(
    "offsets, data, gap",
    [([[0, 4], [8, 12]], 12, (4, 8)), ([[0, 4]], 12, (4, 12)), ([[4, 8]], 8, (0, 4))],
)
def test_bytes_no_tensor_covers_are_a_note_like_the_reference_refuses_them(tmp_path, offsets, data, gap):
    """safetensors' safe_open refuses gaps and trailing bytes; the reader still reads, and says so."""
    from safetensors import SafetensorError, safe_open

    from formats_helpers import st_bytes

    header = {n: {"dtype": "F32", "shape": [1], "data_offsets": o} for n, o in zip("ab", offsets)}
    p = tmp_path / "gap.safetensors"
    raw = st_bytes(header, bytes(data))
    p.write_bytes(raw)
    with pytest.raises(SafetensorError):
        safe_open(str(p), "np")
    ck = open_checkpoint(p)
    start = len(raw) - data
    assert len(ck.notes) == 1 and f"first: bytes {start + gap[0]}..{start + gap[1]}" in ck.notes[0]
    assert "refuse such files" in ck.notes[0]


def test_files_written_by_safetensors_have_no_uncovered_bytes(root):
    assert open_checkpoint(hf_checkpoint(root, "qwen3_moe", "split")).notes == []


@pytest.mark.parametrize("container", ["safetensors", "gguf"])
def test_read_rows_is_read_byte_for_byte_through_one_reused_buffer(root, container):
    """The conversion's reader (large preads into a reused buffer) hands out exactly what the mapping reader does,
    for every tensor and runs of rows at its start, middle and end; read_all is the same bytes again."""
    from ktconvert.io.files import ReadBuffer

    path = hf_checkpoint(root, "qwen3_moe", "split") if container == "safetensors" else \
        gguf_from_hf(root, "qwen3_moe") / "model.gguf"
    ck = open_checkpoint(path)
    buf = ReadBuffer()
    whole = ck.read_all()
    assert sorted(whole) == sorted(ck)
    for name in ck:
        ref = np.asarray(ck.read(name))
        flat = ref.reshape(-1, ref.shape[-1]) if ref.ndim > 1 else ref.reshape(1, -1)
        rows = ck.rows(name)
        assert rows == flat.shape[0]
        for r0, r1 in ((0, rows), (rows // 3, rows // 3 + 1), (rows - 1, rows)):
            got = ck.read_rows(name, r0, r1, buf)
            assert got.dtype == ref.dtype and got.shape == (r1 - r0, flat.shape[1])
            np.testing.assert_array_equal(got, flat[r0:r1])
            assert got.ctypes.data % 4096 == 0  # page-aligned: the buffer's start, reused
        assert whole[name].dtype == ref.dtype and whole[name].shape == ref.shape
        np.testing.assert_array_equal(whole[name], ref)


@pytest.mark.parametrize("direct", [False, True], ids=["page-cache", "o-direct"])
def test_read_rows_of_a_truncated_file_names_it_and_the_tensor(root, tmp_path, direct):
    """The same one line whether the rows are read through the page cache or around it (``O_DIRECT``)."""
    from ktconvert.io.files import ReadBuffer

    src = hf_checkpoint(root, "qwen3_moe", "split") / "model.safetensors"
    ck = open_checkpoint(src)
    name = max(ck, key=lambda n: ck[n].offset)
    cut = tmp_path / "model.safetensors"
    cut.write_bytes(src.read_bytes())
    ck = open_checkpoint(cut)
    with open(cut, "r+b") as fh:  # shortened after it was opened, as by a copy still running
        fh.truncate(ck[name].offset + 1)
    with pytest.raises(InputError) as err:
        ck.read_rows(name, 0, ck.rows(name), ReadBuffer(), direct=direct)
    assert err.value.path == str(cut) and err.value.where == f"tensor {name}"
    assert "ends at byte" in err.value.message and "truncated" in err.value.fix


def test_sha256_file_reads_like_hashlib(tmp_path):
    import hashlib

    from ktconvert.io.atomic import sha256_file

    rng = np.random.default_rng(0)
    for size in (0, 1, 4095, 1 << 16, (1 << 17) + 3):
        p = tmp_path / f"f{size}"
        p.write_bytes(rng.integers(0, 256, size, dtype=np.uint8).tobytes())
        assert sha256_file(p, chunk=1 << 16) == hashlib.sha256(p.read_bytes()).hexdigest(), size


def test_heap_policies_are_set_on_glibc():
    import platform

    from ktconvert.io import heap

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("mallopt is glibc's")
    try:
        assert heap.keep_freed_memory() and heap._POLICY[0] == "keep"
        assert heap.return_freed_memory() and heap._POLICY[0] == "return"
    finally:
        heap.return_freed_memory()  # this test process runs streamed models too
