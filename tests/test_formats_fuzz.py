"""Fuzzing the header parsers: they may only return a consistent header or raise InputError, quickly, and never
allocate in proportion to a length field the file cannot back (measured with tracemalloc)."""

from __future__ import annotations

import json
import struct
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from formats_helpers import gguf_bytes, gguf_str, gguf_tensor_info, st_bytes
from ktconvert.errors import InputError
from ktconvert.formats import open_checkpoint
from ktconvert.io.dtypes import SAFETENSORS_DTYPES
from ktconvert.formats.gguf_header import parse_gguf_header
from ktconvert.formats.safetensors_header import parse_safetensors_header

FUZZ = settings(max_examples=250, deadline=2000, suppress_health_check=[HealthCheck.too_slow])
FEW = settings(max_examples=40, deadline=4000, suppress_health_check=[HealthCheck.too_slow,
                                                                       HealthCheck.function_scoped_fixture])
SLACK = 1 << 20  # fixed overhead allowed on top of a small multiple of the input size


def _parse_bounded(parse, data: bytes):
    """Run ``parse(data)``; it must succeed or raise InputError, and allocate O(len(data))."""
    tracemalloc.start()
    try:
        try:
            result = parse(data)
        except InputError as exc:
            assert exc.message and exc.path
            result = None
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 * len(data) + SLACK, f"peak {peak} B for a {len(data)} B input"
    return result


def _check_st(h, data: bytes):
    if h is None:
        return
    assert h.data_start == 8 + int.from_bytes(data[:8], "little") <= len(data) == h.file_size
    for e in h.entries:
        assert h.data_start <= e.begin <= e.end <= len(data)
        bits = SAFETENSORS_DTYPES[e.dtype].bits
        assert int(np.prod(e.shape, dtype=object)) * bits == 8 * (e.end - e.begin)
    spans = sorted((e.begin, e.end) for e in h.entries if e.end > e.begin)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


def _check_gguf(h, data: bytes):
    if h is None:
        return
    assert h.file_size == len(data) and (not h.tensors or h.data_start <= len(data))
    assert h.version in (2, 3) and h.data_start % h.alignment == 0
    for t in h.tensors:
        assert h.data_start <= t.begin and t.begin + t.nbytes <= len(data)
    spans = sorted((t.begin, t.begin + t.nbytes) for t in h.tensors if t.nbytes)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


# --- safetensors -------------------------------------------------------------------------------------------------

@FUZZ
@given(st.binary(max_size=400))
def test_safetensors_random_bytes(data):
    _check_st(_parse_bounded(parse_safetensors_header, data), data)


_ints = st.one_of(st.integers(-3, 300), st.integers(-(2**70), 2**70), st.sampled_from([2**63, 2**64 - 1, 2**32]))
_entry = st.fixed_dictionaries(
    {},
    optional={
        "dtype": st.one_of(st.sampled_from(sorted(SAFETENSORS_DTYPES)), st.text(max_size=6), _ints),
        "shape": st.one_of(st.lists(_ints, max_size=4), _ints, st.none(), st.lists(st.booleans(), max_size=2)),
        "data_offsets": st.one_of(st.lists(_ints, min_size=0, max_size=3), st.text(max_size=3)),
    },
)
_header = st.dictionaries(
    st.text(max_size=8),
    st.one_of(_entry, _ints, st.text(max_size=4), st.dictionaries(st.text(max_size=3), st.text(max_size=3), max_size=2)),
    max_size=6,
)


@FUZZ
@given(_header, st.binary(max_size=300), st.one_of(st.none(), st.integers(0, 2**64 - 1)))
def test_safetensors_structured_headers(header, tail, length):
    data = st_bytes(json.dumps(header).encode(), tail, length)
    _check_st(_parse_bounded(parse_safetensors_header, data), data)


_TOKENS = ['{', '}', '[', ']', ':', ',', '"a"', '"dtype"', '"F32"', '"shape"', '"data_offsets"', '"__metadata__"',
           '0', '8', '-1', '9' * 5000, '1e999', 'NaN', 'Infinity', 'true', 'null', '"\\ud800"', '[' * 3000]


@FUZZ
@given(st.lists(st.sampled_from(_TOKENS), max_size=30), st.binary(max_size=64))
def test_safetensors_json_token_soup(tokens, tail):
    data = st_bytes("".join(tokens).encode(), tail)
    _check_st(_parse_bounded(parse_safetensors_header, data), data)


@FUZZ
@given(st.data())
def test_safetensors_valid_file_with_mutations(data):
    from safetensors.numpy import save

    base = save({"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(5, np.int64),
                 "c": np.zeros((2, 2), np.float16)}, metadata={"format": "pt"})
    blob = _mutate(data, base)
    _check_st(_parse_bounded(parse_safetensors_header, blob), blob)


# --- GGUF ----------------------------------------------------------------------------------------------------------

@FUZZ
@given(st.sampled_from([2, 3, 1, 0, 4, 2**31]), st.binary(max_size=400))
def test_gguf_random_bytes_after_the_magic(version, tail):
    data = b"GGUF" + struct.pack("<I", version) + tail
    _check_gguf(_parse_bounded(parse_gguf_header, data), data)


_u64 = st.one_of(st.integers(0, 64), st.integers(0, 2**64 - 1), st.sampled_from([2**63, 2**64 - 1, 2**40]))


@st.composite
def _gguf_kv(draw):
    key = draw(st.text(max_size=10)).encode()
    vtype = draw(st.one_of(st.integers(0, 13), st.integers(0, 2**32 - 1)))
    body = gguf_str(key, draw(st.one_of(st.none(), _u64))) + struct.pack("<I", vtype)
    if vtype == 8:
        body += gguf_str(draw(st.binary(max_size=12)), draw(st.one_of(st.none(), _u64)))
    elif vtype == 9:
        body += struct.pack("<IQ", draw(st.integers(0, 13)), draw(_u64))
        body += draw(st.binary(max_size=40))
    else:
        body += draw(st.binary(min_size=0, max_size=8))
    return body


@st.composite
def _gguf_ti(draw):
    ne = tuple(draw(st.lists(_u64, max_size=5)))
    return gguf_tensor_info(draw(st.text(max_size=8)), ne, draw(st.one_of(st.integers(0, 42), st.integers(0, 2**32 - 1))),
                            draw(st.one_of(st.sampled_from([0, 32, 64, 96]), _u64)))


@FUZZ
@given(st.sampled_from([2, 3]), st.lists(_gguf_kv(), max_size=4), st.lists(_gguf_ti(), max_size=4),
       st.one_of(st.none(), _u64), st.one_of(st.none(), _u64), st.binary(max_size=256))
def test_gguf_structured_headers(version, kvs, tis, n_kv, n_t, tail):
    data = gguf_bytes(version, len(tis) if n_t is None else n_t, len(kvs) if n_kv is None else n_kv,
                      b"".join(kvs) + b"".join(tis) + tail)
    _check_gguf(_parse_bounded(parse_gguf_header, data), data)


@pytest.fixture(scope="module")
def gguf_base(tmp_path_factory):
    """A small valid GGUF written by the gguf package: scalar, string and array KVs, an F32 and a Q8_0 tensor."""
    import gguf

    path = tmp_path_factory.mktemp("fuzz") / "base.gguf"
    w = gguf.GGUFWriter(path, "qwen3moe")
    w.add_block_count(2)
    w.add_string("general.name", "fuzz")
    w.add_array("tokenizer.ggml.tokens", ["a", "bb", "ccc"])
    w.add_array("x.floats", [1.0, 2.0])
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    q = gguf.quants.quantize(np.ones((2, 3, 64), np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.ffn_gate_exps.weight", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    base = path.read_bytes()
    assert parse_gguf_header(base).tensors[1].name == "blk.0.ffn_gate_exps.weight"
    return base


def _mutate(data, base: bytes) -> bytes:
    blob = bytearray(base)
    for _ in range(data.draw(st.integers(0, 4))):
        pos = data.draw(st.integers(0, max(0, len(blob) - 1)))
        patch = data.draw(st.one_of(
            st.binary(min_size=1, max_size=8),
            st.sampled_from([struct.pack("<Q", 2**63), struct.pack("<Q", 2**64 - 1), struct.pack("<I", 9),
                             struct.pack("<Q", 10**12), b"\x00" * 8]),
        ))
        blob[pos:pos + len(patch)] = patch
    cut = data.draw(st.one_of(st.none(), st.integers(0, len(blob))))
    return bytes(blob[:cut] if cut is not None else blob)


@settings(max_examples=300, deadline=2000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_gguf_valid_file_with_mutations(gguf_base, data):
    blob = _mutate(data, gguf_base)
    _check_gguf(_parse_bounded(parse_gguf_header, blob), blob)


# --- whole open path on files ---------------------------------------------------------------------------------------

@FEW
@given(st.data())
def test_open_checkpoint_on_mutated_files(tmp_path, gguf_base, data):
    """Through sources + checkpoint + header parsing on real files: only InputError, ever."""
    from safetensors.numpy import save

    st_base = save({"a": np.arange(6, dtype=np.float32), "b": np.ones(3, np.float16)})
    for name, base in (("f.gguf", gguf_base), ("f.safetensors", st_base)):
        p = tmp_path / name
        p.write_bytes(_mutate(data, base))
        try:
            ck = open_checkpoint(p)
        except InputError:
            continue
        for t in ck:  # whatever opened must be readable within the file
            assert ck[t].offset + ck[t].nbytes <= p.stat().st_size
            ck.read(t)


# --- explicit allocation checks -------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "parse, data",
    [
        (parse_safetensors_header, struct.pack("<Q", 2**62) + b"{}"),
        (parse_gguf_header, gguf_bytes(n_kv=1, body=gguf_str("k", 2**40))),
        (parse_gguf_header, gguf_bytes(n_kv=1, body=gguf_str("k") + struct.pack("<I", 8) + gguf_str(b"v", 2**40))),
        (parse_gguf_header, gguf_bytes(n_kv=1, body=gguf_str("k") + struct.pack("<IIQ", 9, 8, 2**40) + bytes(64))),
        (parse_gguf_header, gguf_bytes(n_kv=1, body=gguf_str("k") + struct.pack("<IIQ", 9, 12, 2**40) + bytes(64))),
        (parse_gguf_header, gguf_bytes(n_tensors=2**20, n_kv=2**20)),
        (parse_gguf_header, gguf_bytes(n_tensors=1, body=gguf_tensor_info("t", (2**62, 2**62, 2**62, 2**62), 0, 0))),
    ],
)
def test_length_fields_are_checked_before_allocating(parse, data):
    tracemalloc.start()
    try:
        with pytest.raises(InputError):
            parse(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 256 * 1024, peak
