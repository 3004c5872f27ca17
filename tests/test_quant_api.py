"""ktconvert.quant's public API: shape helpers, typed errors raised before any work, inputs it accepts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf import quants as gq

from ktconvert import quant as Q
from ktconvert.errors import InputError, KtError


def test_sizes_and_shapes_follow_gguf():
    for qt in Q.QUANTIZABLE:
        assert (Q.block_size(qt), Q.type_size(qt)) == GGML_QUANT_SIZES[qt]
    assert Q.block_size("q4_k") == 256 and Q.type_size(T.Q4_K) == 144 and Q.type_size(12) == 144
    assert Q.byte_shape((8, 3, 512), T.Q4_K) == (8, 3, 288) == gq.quant_shape_to_byte_shape((8, 3, 512), T.Q4_K)
    assert Q.elem_shape((8, 3, 288), "Q4_K") == (8, 3, 512)
    assert Q.byte_shape((5, 64), T.Q8_0) == (5, 68)
    assert Q.byte_shape((4, 10), T.F32) == (4, 40) and Q.byte_shape((4, 10), T.BF16) == (4, 20)
    assert Q.row_ok(256, T.Q6_K) and not Q.row_ok(128, T.Q6_K) and not Q.row_ok(0, T.Q8_0)
    assert Q.row_ok(96, T.Q8_0) and not Q.row_ok(100, T.Q8_0) and Q.row_ok(7, T.F16)


def test_quant_error_is_a_typed_input_error():
    assert issubclass(Q.QuantError, InputError) and issubclass(Q.QuantError, KtError)
    assert Q.QuantError("x").exit_code == 3


@pytest.mark.parametrize("qtype,row_len,hint", [
    (T.Q4_K, 1000, "keep this tensor in F16"),   # not a multiple of 32 either: no block type fits
    (T.Q6_K, 2880, "Q8_0"),                     # a multiple of 32, not of 256: point at a 32-block type
    (T.Q8_0, 100, "keep this tensor in F16"),
    (T.Q4_0, 0, "keep this tensor in F16"),
])
def test_bad_row_length_is_one_line_naming_type_length_and_fix(qtype, row_len, hint):
    x = np.zeros((3, row_len), dtype=np.float32)
    with pytest.raises(Q.QuantError) as ei:
        Q.quantize(x, qtype, name="blk.0.ffn_down_exps.weight")
    msg = str(ei.value)
    assert "\n" not in msg
    assert qtype.name in msg and str(row_len) in msg and str(Q.block_size(qtype)) in msg
    assert "blk.0.ffn_down_exps.weight" in msg and hint in msg
    with pytest.raises(Q.QuantError, match=qtype.name):
        Q.check_row(row_len, qtype)
    with pytest.raises(Q.QuantError):
        Q.byte_shape((3, row_len), qtype)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q8_0, T.F16])
def test_non_finite_input_raises_before_any_work(bad, qtype):
    x = np.random.default_rng(0).standard_normal((2, 3, 512)).astype(np.float32)
    x[1, 2, 300] = bad
    out = np.full(Q.byte_shape(x.shape, qtype), 0xA5, dtype=np.uint8)
    with pytest.raises(Q.QuantError) as ei:
        Q.quantize(x, qtype, out=out, name="w")
    msg = str(ei.value)
    assert "non-finite" in msg and "(1, 2, 300)" in msg and qtype.name in msg and "w:" in msg and "fix" in msg
    assert (out == 0xA5).all()  # nothing written: the check ran before the first chunk


def test_non_finite_in_a_torch_bf16_tensor_is_found():
    t = torch.zeros((4, 256), dtype=torch.bfloat16)
    t[3, 255] = float("nan")
    with pytest.raises(Q.QuantError, match=r"\(3, 255\)"):
        Q.quantize(t, T.Q4_K)


def test_unknown_and_unsupported_types():
    x = np.zeros((1, 256), dtype=np.float32)
    with pytest.raises(Q.QuantError, match="unknown ggml type 'Q9_9'"):
        Q.quantize(x, "Q9_9")
    with pytest.raises(Q.QuantError, match="TQ1_0 is not implemented") as ei:
        Q.quantize(x, T.TQ1_0)
    assert "Q4_K" in str(ei.value)  # the fix lists what is available
    with pytest.raises(Q.QuantError, match="dequantizing Q8_K"):
        Q.dequantize(np.zeros((1, 292), np.uint8), T.Q8_K)


def test_non_float_inputs_and_bad_bytes_are_refused():
    with pytest.raises(Q.QuantError, match="must hold floats"):
        Q.quantize(np.zeros((2, 256), dtype=np.int32), T.Q4_K)
    with pytest.raises(Q.QuantError, match="scalar"):
        Q.quantize(np.float32(1.0), T.F32)
    with pytest.raises(Q.QuantError, match="144-byte blocks; got 100"):
        Q.dequantize(np.zeros((2, 100), np.uint8), T.Q4_K)
    with pytest.raises(Q.QuantError, match="uint8"):
        Q.dequantize(np.zeros((2, 144), np.float32), T.Q4_K)
    with pytest.raises(Q.QuantError, match="out has"):
        Q.quantize(np.zeros((2, 256), np.float32), T.Q4_K, out=np.zeros((2, 145), np.uint8))


def test_inputs_float16_float64_torch_bf16_and_memmap_give_the_c_path_bytes(tmp_path):
    rng = np.random.default_rng(5)
    x32 = (rng.standard_normal((6, 512)) * 0.02).astype(np.float32)
    want = Q.quantize(x32, T.Q6_K)
    # llama-quantize converts to f32 first; so do we (f64 rounds once to f32, never straight to fp16)
    assert np.array_equal(Q.quantize(x32.astype(np.float64), T.Q6_K), want)
    x16 = x32.astype(np.float16)
    assert np.array_equal(Q.quantize(x16, T.Q4_K), Q.quantize(x16.astype(np.float32), T.Q4_K))
    tb = torch.from_numpy(x32).to(torch.bfloat16)
    assert np.array_equal(Q.quantize(tb, T.Q4_K), Q.quantize(tb.float().numpy(), T.Q4_K))
    assert np.array_equal(Q.quantize(torch.from_numpy(x32).t().contiguous().t(), T.Q6_K), want)
    path = tmp_path / "w.f32"
    x32.tofile(path)
    mm = np.memmap(path, dtype=np.float32, mode="r", shape=x32.shape)
    out = np.lib.format.open_memmap(tmp_path / "q.npy", mode="w+", dtype=np.uint8,
                                    shape=Q.byte_shape(mm.shape, T.Q6_K))
    assert Q.quantize(mm, T.Q6_K, out=out) is out
    assert np.array_equal(np.asarray(out), want)


def test_byte_shape_out_and_float_types_are_raw_little_endian_bytes():
    x = np.array([[1.0, -2.5, 65504.0, 1e-8]], dtype=np.float32)
    assert np.array_equal(Q.quantize(x, T.F32), x.view(np.uint8))
    assert np.array_equal(Q.quantize(x, T.F16), x.astype(np.float16).view(np.uint8))
    bf = Q.quantize(x, "BF16").view(np.uint16)
    assert np.array_equal(bf, (x.view(np.uint32) + 0x7FFF + ((x.view(np.uint32) >> 16) & 1)) >> 16)
    assert Q.quantize(np.zeros((0, 256), np.float32), T.Q4_K).shape == (0, 144)


def test_dequantize_accepts_what_gguf_reader_yields():
    x = np.random.default_rng(2).standard_normal((3, 64)).astype(np.float32)
    assert np.array_equal(Q.dequantize(x, T.F32), x)                        # F32 arrives as float32
    assert np.array_equal(Q.dequantize(x.astype(np.float16), T.F16), x.astype(np.float16).astype(np.float32))
    bf = Q.quantize(x, T.BF16)
    assert np.array_equal(Q.dequantize(bf.view(np.uint16), T.BF16), Q.dequantize(bf, T.BF16))


def test_dequantize_every_type_gguf_can_decode_matches_gguf():
    rng = np.random.default_rng(4)
    types = Q.dequantizable()
    assert Q.QUANTIZABLE <= types
    extra = types - Q.QUANTIZABLE
    assert {T.TQ1_0, T.TQ2_0, T.MXFP4} <= extra and {T.IQ4_NL, T.IQ4_XS, T.IQ3_XXS} <= Q.QUANTIZABLE
    for qt in sorted(types, key=lambda t: t.value):
        bs, ts = GGML_QUANT_SIZES[qt]
        raw = rng.integers(0, 256, (3, 2 * ts), dtype=np.uint8)
        if qt in (T.F16, T.BF16, T.F32) or qt in Q.QUANTIZABLE:
            im = np.ones(2 * bs, np.float32) if qt in Q.IMATRIX_REQUIRED else None
            raw = Q.quantize(rng.standard_normal((3, 2 * bs)).astype(np.float32), qt, imatrix=im)
        with np.errstate(all="ignore"):
            want = np.asarray(gq.dequantize(raw, qt), dtype=np.float32)
        got = Q.dequantize(raw, qt)
        assert got.shape == (3, 2 * bs) and got.dtype == np.float32
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), qt.name


def test_parallel_entry_point_uses_the_requested_threads_and_matches(monkeypatch):
    import threading

    from ktconvert.quant import _api

    seen = set()
    real = _api._kernel
    # the first two threads to run a chunk wait for each other (a serial implementation would time out here), so
    # the check does not depend on how a loaded machine schedules the pool's threads
    meet = {"barrier": None}

    def spy_kernel(name):
        kernel = real(name)

        def spy(*args):
            me = threading.current_thread().name
            first = me not in seen
            seen.add(me)
            if meet["barrier"] is not None and first and len(seen) <= 2:
                meet["barrier"].wait()
            return kernel(*args)
        return spy

    monkeypatch.setattr(_api, "_kernel", spy_kernel)
    monkeypatch.setitem(_api._QUANT, T.Q8_0, (_api._QUANT[T.Q8_0][0], 4096))
    x = np.random.default_rng(9).standard_normal((64, 1024)).astype(np.float32)
    a = Q.quantize(x, T.Q8_0, workers=1)
    assert seen == {threading.current_thread().name}  # one worker: the caller's own thread
    seen.clear()
    meet["barrier"] = threading.Barrier(2, timeout=60)
    b = Q.quantize_parallel(x, T.Q8_0, workers=4)
    assert len(seen) > 1 and all(n.startswith("ktconvert-quant") for n in seen)
    assert np.array_equal(a, b)
    assert Q.cpu_count() >= 1


def test_importing_the_package_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, ktconvert.quant as q; q.byte_shape((2, 256), 'Q4_K'); print('torch' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "False"


def test_read_only_memmap_input_quantizes_silently(tmp_path):
    import warnings

    x = np.random.default_rng(8).standard_normal((8, 512)).astype(np.float32)
    x.tofile(tmp_path / "w.f32")
    mm = np.memmap(tmp_path / "w.f32", dtype=np.float32, mode="r", shape=x.shape)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for qt in (T.F16, T.Q8_0, T.Q4_0, T.Q4_K):
            assert np.array_equal(Q.quantize(mm, qt), Q.quantize(x, qt))


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q6_K], ids=lambda t: t.name)
def test_memory_stays_bounded_by_chunks_not_tensor_size(tmp_path, qtype):
    """A 64 MiB memmapped tensor into a memmapped output: numpy's traced peak is a few chunks per worker
    (about 8 MiB each for K-quants), not a copy of the tensor."""
    import tracemalloc

    rows, cols = 4096, 4096
    src = np.lib.format.open_memmap(tmp_path / "w.npy", mode="w+", dtype=np.float32, shape=(rows, cols))
    rng = np.random.default_rng(0)
    for i in range(0, rows, 256):
        src[i:i + 256] = rng.standard_normal((256, cols)).astype(np.float32)
    src.flush()
    x = np.load(tmp_path / "w.npy", mmap_mode="r")
    out = np.lib.format.open_memmap(tmp_path / "q.npy", mode="w+", dtype=np.uint8,
                                    shape=Q.byte_shape(x.shape, qtype))
    tracemalloc.start()
    try:
        Q.quantize_parallel(x, qtype, workers=2, out=out)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < x.nbytes / 2, f"peak {peak / 2**20:.1f} MiB for a {x.nbytes / 2**20:.0f} MiB tensor"
    assert np.array_equal(np.asarray(out[:4]), Q.quantize(np.asarray(x[:4]), qtype))


def test_numba_is_loaded_only_by_what_compiles():
    """numba (and llvmlite) add about 100 MiB to a process's resident size, which a streamed verify's fixed overhead
    and every budget pay: importing the verify, golden and streaming code loads none of it; decoding a K-quant does."""
    import subprocess
    import sys

    code = ("import sys, numpy as np\n"
            "import ktconvert.cli, ktconvert.verify.runner, ktconvert.golden.stream, ktconvert.model.executor\n"
            "from ktconvert import quant as Q\n"
            "before = 'numba' in sys.modules\n"
            "Q.dequantize(np.zeros((1, Q.type_size(Q.QType.Q8_0)), np.uint8), Q.QType.Q8_0)\n"
            "q8 = 'numba' in sys.modules\n"
            "Q.dequantize(np.zeros((1, Q.type_size(Q.QType.Q4_K)), np.uint8), Q.QType.Q4_K)\n"
            "print(before, q8, 'numba' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False", "True"]


def test_bf16_to_float32_widens_every_pattern_and_reports_finiteness():
    """The conversion's one-pass BF16 decode: every bf16 bit pattern widened exactly (as torch does), into a slice
    of rows, and its flag False as soon as one value is a NaN or an infinity."""
    bits = np.arange(1 << 16, dtype=np.uint16).reshape(256, 256)
    want = torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16).float().numpy()
    out = np.full((260, 256), 7.0, np.float32)
    assert Q.bf16_to_float32(bits, out[2:258]) is False  # the 0x7F80.. and 0xFF80.. rows hold inf and NaN
    assert out[2:258].view(np.uint32).tobytes() == want.view(np.uint32).tobytes()
    assert (out[:2] == 7.0).all() and (out[258:] == 7.0).all()
    finite = bits[(bits & 0x7F80) != 0x7F80][: 255 * 256].reshape(255, 256)
    assert Q.bf16_to_float32(finite, np.empty((255, 256), np.float32)) is True
    for bad in (0x7F80, 0xFF80, 0x7FC1, 0xFFFF):
        row = finite[:1].copy()
        row[0, 100] = bad
        assert Q.bf16_to_float32(row, np.empty((1, 256), np.float32)) is False
    with pytest.raises(Q.QuantError, match="2-D uint16 and float32"):
        Q.bf16_to_float32(bits.astype(np.int32), np.empty((256, 256), np.float32))
