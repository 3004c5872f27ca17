"""Byte-for-byte equality of ktconvert.quant with ggml's C reference (``ggml_quantize_chunk`` without an
importance matrix, built from the pinned llama-cpp-python sdist by tests/ggml_ref.py) and, where the
``gguf`` package implements a type, with it too.

Set KTCONVERT_REQUIRE_GGML_REF=1 (CI does) to turn "cannot build the reference" into a failure.
"""

from __future__ import annotations


import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants as gq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import ggml_ref
from ktconvert import quant as Q

pytestmark = pytest.mark.interop

TYPES = sorted(Q.QUANTIZABLE - Q.IQ_GRID_TYPES, key=lambda t: t.value)  # grid types: test_quant_iq.py (ggml aborts on huge rows)
F32 = np.float32


@pytest.fixture(scope="session")
def ref() -> ggml_ref.GgmlRef:
    return ggml_ref.load_or_skip()


def corpus() -> list[tuple[str, np.ndarray]]:
    """Named float32 inputs, rows along the last axis, every row length a multiple of 256."""
    rng = np.random.default_rng(20240601)
    out: list[tuple[str, np.ndarray]] = []

    def add(name: str, a) -> None:
        out.append((name, np.ascontiguousarray(np.asarray(a, dtype=np.float64).astype(F32))))

    n = 512
    add("gaussian", rng.standard_normal((64, n)) * 0.02)
    add("gaussian_unit", rng.standard_normal((32, 1024)))
    add("student_t2", rng.standard_t(2, (64, n)) * 0.01)
    add("cauchy", rng.standard_t(1, (32, n)))
    add("laplace", rng.laplace(0, 0.05, (32, n)))
    add("zeros", np.zeros((4, n)))
    add("negative_zeros", np.full((4, n), -0.0))
    add("signed_zero_mix", np.where(rng.random((8, n)) < 0.5, 0.0, -0.0))
    add("constant_rows", np.repeat(rng.standard_normal((16, 1)), n, axis=1))
    add("constant_negative", np.full((4, n), -0.75))
    x = rng.standard_normal((32, n)) * 0.01
    x[np.arange(32), rng.integers(0, n, 32)] = rng.standard_normal(32) * 50
    add("single_outlier", x)
    x = np.zeros((16, n))
    x[np.arange(16), rng.integers(0, n, 16)] = rng.standard_normal(16)
    add("lone_nonzero", x)
    add("tiny_1e-7", rng.standard_normal((16, n)) * 1e-7)
    add("tiny_1e-20", rng.standard_normal((16, n)) * 1e-20)
    add("tiny_1e-36", rng.standard_normal((16, n)) * 1e-36)
    add("subnormal", rng.standard_normal((16, n)) * 1e-40)
    add("subnormal_ulps", rng.integers(-40, 40, (16, n)) * 1.401298464324817e-45)
    x = rng.standard_normal((16, n)) * 0.02
    x[:, 100:140] = 1e-40
    add("normal_with_subnormal_run", x)
    add("huge_1e4", rng.standard_normal((16, n)) * 1e4)
    add("huge_1e6", rng.standard_normal((16, n)) * 1e6)
    add("huge_1e15", rng.standard_normal((16, n)) * 1e15)
    add("huge_1e30", rng.standard_normal((16, n)) * 1e30)
    add("near_fp16_max", rng.uniform(-70000, 70000, (8, n)))
    add("near_float_max", rng.uniform(-3.4e38, 3.4e38, (8, n)))       # x - min overflows to inf
    add("positive_near_float_max", rng.uniform(0, 3.4e38, (8, n)))
    add("squares_overflow_1e19", rng.standard_normal((8, n)) * 1e19)  # x*x overflows in the weights
    add("mixed_scales", rng.uniform(-1, 1, (32, n)) * 10.0 ** rng.integers(-30, 30, (32, 1)))
    x = rng.standard_normal((16, n)) * 0.02
    x[:, ::7] = 0.0
    add("sparse", x)
    add("all_positive", np.abs(rng.standard_normal((16, n))))
    add("all_negative", -np.abs(rng.standard_normal((16, n))))
    add("offset_negative", rng.standard_normal((16, n)) * 0.01 - 1000.0)
    add("ulp_steps", -(F32(1000) + rng.integers(0, 3, (8, n)) * np.spacing(F32(1000))))
    add("integers", rng.integers(-8, 8, (16, n)))
    add("small_integers", rng.integers(-2, 3, (16, n)))
    add("halves", rng.integers(-40, 40, (16, n)) * 0.5)
    add("steps_of_16", np.repeat(rng.standard_normal((16, n // 16)), 16, axis=1))
    x = np.abs(rng.standard_normal((16, n)))
    x[:, 1::2] = -x[:, ::2]
    add("plus_minus_pairs", x)
    b = (rng.standard_normal((32, n)) * 0.05).astype(F32).view(np.uint32) & np.uint32(0xFFFF0000)
    add("bf16_valued", b.view(F32))
    add("fp16_valued", (rng.standard_normal((32, n)) * 0.05).astype(np.float16))
    add("expert_stack_3d", rng.standard_normal((4, 24, n)) * 0.03)
    add("expert_stack_3d_wide", rng.standard_normal((3, 4, 2048)) * 0.02)
    add("single_row_1d", rng.standard_normal(1024) * 0.1)
    return out


CORPUS = corpus()


def _cases():
    return [pytest.param(name, id=name) for name, _ in CORPUS]


def _mismatch(ours: np.ndarray, theirs: np.ndarray) -> str:
    a = ours.reshape(-1, ours.shape[-1])
    b = theirs.reshape(-1, theirs.shape[-1])
    rows = np.flatnonzero((a != b).any(axis=1))
    r = rows[0]
    col = int(np.flatnonzero(a[r] != b[r])[0])
    return f"{rows.size}/{a.shape[0]} rows differ; first: row {r} byte {col}: ours {a[r, col]} vs {b[r, col]}"


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_quantize_bytes_equal_c_reference_on_corpus(ref, qtype):
    compared = 0
    for name, x in CORPUS:
        ours = Q.quantize(x, qtype)
        theirs = ref.quantize(x, qtype)
        assert ours.shape == theirs.shape == Q.byte_shape(x.shape, qtype)
        assert np.array_equal(ours, theirs), f"{qtype.name} on {name}: {_mismatch(ours, theirs)}"
        compared += x.size
    assert compared > 400_000


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantize_bit_identical_to_c_reference(ref, qtype):
    for name, x in CORPUS:
        q = ref.quantize(x, qtype)
        ours = Q.dequantize(q, qtype)
        theirs = ref.dequantize(q, qtype)
        assert ours.shape == x.shape
        assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32)), f"{qtype.name} on {name}"


@pytest.mark.parametrize("qtype", [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K], ids=lambda t: t.name)
def test_k_quant_dequantize_of_any_bytes_is_the_c_reference(ref, qtype):
    """Blocks no quantizer would write (every byte random: fp16 scales that are inf, NaN or subnormal, every code
    and sub-scale) decode bit for bit as ggml's C decodes them, NaN payloads included; the compiled in-place
    decoders are also checked on a slice of rows, as the streamed decode hands them chunk by chunk."""
    ts = Q.type_size(qtype)
    q = np.random.default_rng(int(qtype)).integers(0, 256, (3, 700 * ts), dtype=np.uint8)
    d_at = {T.Q2_K: 80, T.Q3_K: 108, T.Q6_K: 208}.get(qtype, 0)  # the block's fp16 scale d
    for block, bits in ((0, 0x7C00), (1, 0x7E01), (2, 0x0001)):  # inf, a NaN with a payload, a subnormal
        q[0, block * ts + d_at:block * ts + d_at + 2] = np.array([bits], "<u2").view(np.uint8)
    theirs = ref.dequantize(q, qtype)
    ours = Q.dequantize(q, qtype)
    assert np.isnan(theirs).any() and np.isinf(theirs).any()  # the odd scales are there
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))
    assert np.array_equal(Q.dequantize(q[1:2, 5 * ts:9 * ts], qtype).view(np.uint32),
                          theirs[1:2, 5 * 256:9 * 256].view(np.uint32))


def _gguf_can_quantize(qtype) -> bool:
    try:
        gq.quantize(np.zeros((1, Q.block_size(qtype)), dtype=F32), qtype)
    except NotImplementedError:
        return False
    return True


GGUF_TYPES = [t for t in TYPES if _gguf_can_quantize(t)]
# gguf takes a block's max from argmax(|x|), so an all-zero block holding -0.0 gets scale +0.0 where the
# C (which never leaves its +0.0 start) stores -0.0; we follow the C. Only the fp16 sign bit differs.
SIGNED_ZERO_INPUTS = {"negative_zeros", "signed_zero_mix"}


@pytest.mark.parametrize("qtype", GGUF_TYPES, ids=lambda t: t.name)
def test_agrees_with_gguf_package_where_it_has_the_type(qtype):
    checked = 0
    for name, x in CORPUS:
        ours = Q.quantize(x, qtype)
        with np.errstate(all="ignore"):
            theirs = np.asarray(gq.quantize(x, qtype))
        theirs = np.ascontiguousarray(theirs).view(np.uint8).reshape(ours.shape)
        if name in SIGNED_ZERO_INPUTS and qtype in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1):
            ts = Q.type_size(qtype)
            diff = np.flatnonzero((ours != theirs).reshape(-1))
            assert np.all(np.isin(diff % ts, (1, 3))), f"{qtype.name} on {name}: not only scale sign bits"
            assert np.all((ours.reshape(-1)[diff] ^ theirs.reshape(-1)[diff]) == 0x80)
            continue
        assert np.array_equal(ours, theirs), f"{qtype.name} on {name}: {_mismatch(ours, theirs)}"
        with np.errstate(all="ignore"):
            back = np.asarray(gq.dequantize(ours, qtype), F32)
        assert np.array_equal(Q.dequantize(ours, qtype).view(np.uint32), back.view(np.uint32))
        checked += 1
    assert checked >= len(CORPUS) - len(SIGNED_ZERO_INPUTS)


def test_k_quants_are_what_gguf_dequantizes():
    """gguf cannot produce K-quants, but it decodes them: our bytes must decode to our values there too."""
    x = CORPUS[0][1]
    for qtype in (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K):
        q = Q.quantize(x, qtype)
        assert np.array_equal(np.asarray(gq.dequantize(q, qtype), F32), Q.dequantize(q, qtype))


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0], ids=lambda t: t.name)
def test_parallel_and_chunked_paths_give_the_same_bytes(ref, qtype, monkeypatch):
    from ktconvert.quant import _api

    x = (np.random.default_rng(3).standard_normal((6, 3, 4096)) * 0.02).astype(F32)
    want = ref.quantize(x, qtype)
    monkeypatch.setitem(_api._QUANT, qtype, (_api._QUANT[qtype][0], 1024))  # rows split across chunks
    assert np.array_equal(Q.quantize(x, qtype, workers=1), want)
    assert np.array_equal(Q.quantize_parallel(x, qtype, workers=3), want)
    xt = np.ascontiguousarray(x.transpose(0, 2, 1)).transpose(0, 2, 1)  # not viewable as 2-D rows
    assert not xt.flags.c_contiguous
    assert np.array_equal(Q.quantize(xt, qtype, workers=2), want)


_finite = st.floats(width=32, allow_nan=False, allow_infinity=False, allow_subnormal=True)
_scales = st.sampled_from([1.0, 0.02, 1e-6, 1e-30, 1e-39, 3e4, 1e8, 1e20])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(base=hnp.arrays(F32, (2, 256), elements=_finite), scale=_scales,
       qtype=st.sampled_from(TYPES))
def test_property_random_blocks_match_c_reference(ref, base, scale, qtype):
    with np.errstate(over="ignore"):
        x = (base * F32(scale)).astype(F32)
    x[~np.isfinite(x)] = 0
    assert np.array_equal(Q.quantize(x, qtype), ref.quantize(x, qtype))


def _mixed_rows(seed: int, rows: int, n: int) -> np.ndarray:
    """Every row from a random family at a random scale: catches what the named corpus does not."""
    rng = np.random.default_rng(seed)
    out = np.empty((rows, n), dtype=F32)
    for r in range(rows):
        fam = rng.integers(0, 6)
        if fam == 0:
            v = rng.standard_normal(n)
        elif fam == 1:
            v = rng.standard_t(rng.uniform(1, 5), n)
        elif fam == 2:
            v = rng.uniform(-1, 1, n) + rng.uniform(-3, 3)
        elif fam == 3:
            v = rng.standard_normal(n) * (rng.random(n) < rng.uniform(0.05, 0.5))
        elif fam == 4:
            v = np.repeat(rng.standard_normal(n // 32), 32) + rng.standard_normal(n) * 1e-3
        else:
            v = np.round(rng.standard_normal(n) * rng.integers(1, 20)) / rng.integers(1, 8)
        with np.errstate(over="ignore", under="ignore"):
            out[r] = (v * 10.0 ** rng.uniform(-12, 8)).astype(F32)
    return out


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_bulk_mixed_rows_match_c_reference(ref, qtype):
    x = np.concatenate([_mixed_rows(seed, 256, 1024) for seed in range(4)])
    assert np.isfinite(x).all()
    ours, theirs = Q.quantize(x, qtype), ref.quantize(x, qtype)
    assert np.array_equal(ours, theirs), f"{qtype.name}: {_mismatch(ours, theirs)}"
