"""Quantizers with an importance matrix, byte for byte against ggml's C (``ggml_quantize_chunk(..., imatrix)``,
the ``quantize_row_*_impl`` searches ``llama-quantize --imatrix`` runs), and IQ4_NL/IQ4_XS with and without one.

The C is the pinned ggml built by tests/ggml_ref.py (the same reference as tests/test_quant_exact.py); set
KTCONVERT_REQUIRE_GGML_REF=1 to make "cannot build it" a failure.
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

F32 = np.float32
WEIGHTED = sorted(Q.IMATRIX_TYPES - Q.IQ_GRID_TYPES, key=lambda t: t.value)  # the grid types: test_quant_iq.py
IQ4 = [T.IQ4_NL, T.IQ4_XS]


@pytest.fixture(scope="session")
def ref() -> ggml_ref.GgmlRef:
    return ggml_ref.load_or_skip()


def _data(rng: np.random.Generator, n: int) -> list[tuple[str, np.ndarray]]:
    """Held-out inputs (seeded apart from test_quant_exact's corpus), rows of ``n``."""
    out = []

    def add(name, a):
        out.append((name, np.ascontiguousarray(np.asarray(a, dtype=np.float64).astype(F32))))

    add("gaussian", rng.standard_normal((12, n)) * 0.02)
    add("student_t2", rng.standard_t(2, (8, n)) * 0.01)
    x = rng.standard_normal((8, n)) * 0.01
    x[np.arange(8), rng.integers(0, n, 8)] = rng.standard_normal(8) * 40
    add("outliers", x)
    x = rng.standard_normal((4, n)) * 0.02
    x[:, : n // 2] = 0.0
    add("half_zero", x)
    add("all_positive", np.abs(rng.standard_normal((4, n))))
    add("offset", rng.standard_normal((4, n)) * 0.01 + 3.0)
    add("tiny", rng.standard_normal((4, n)) * 1e-20)
    add("constant", np.repeat(rng.standard_normal((4, 1)), n, axis=1))
    add("integers", rng.integers(-8, 8, (4, n)))
    return out


def _imatrices(rng: np.random.Generator, n: int) -> list[tuple[str, np.ndarray]]:
    im = [
        ("uniform", rng.uniform(0.1, 2.0, n)),
        ("lognormal", np.exp(rng.normal(0, 3, n))),                 # importances over many decades
        ("sparse", rng.uniform(0, 1, n) * (rng.random(n) < 0.3)),   # most columns never activated
        ("zeros", np.zeros(n)),                                      # no data at all
        ("tiny", rng.uniform(0, 1e-30, n)),
        ("ones", np.ones(n)),
    ]
    return [(k, v.astype(F32)) for k, v in im]


def _mismatch(ours: np.ndarray, theirs: np.ndarray) -> str:
    a, b = ours.reshape(-1, ours.shape[-1]), theirs.reshape(-1, theirs.shape[-1])
    rows = np.flatnonzero((a != b).any(axis=1))
    r = rows[0]
    c = int(np.flatnonzero(a[r] != b[r])[0])
    return f"{rows.size}/{a.shape[0]} rows differ; first: row {r} byte {c}: ours {a[r, c]} vs C {b[r, c]}"


@pytest.mark.parametrize("qtype", [*WEIGHTED, T.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("n", [256, 768, 2048])
def test_imatrix_quantize_bytes_equal_c(ref, qtype, n):
    rng = np.random.default_rng(1000 + n)
    data, ims = _data(rng, n), _imatrices(rng, n)
    for k, (dname, x) in enumerate(data):
        for iname, qw in (ims if k < 2 else ims[k % len(ims):][:2]):   # every imatrix on the first two inputs
            ours = Q.quantize(x, qtype, imatrix=qw)
            theirs = ref.quantize(x, qtype, qw)
            assert np.array_equal(ours, theirs), f"{qtype.name} n={n} {dname} x {iname}: {_mismatch(ours, theirs)}"


@pytest.mark.parametrize("qtype", WEIGHTED, ids=lambda t: t.name)
def test_imatrix_search_differs_from_the_reference_path(ref, qtype):
    """The weighted search is really taken (not the NULL path), and a different imatrix changes the bytes."""
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((16, 512)) * 0.02).astype(F32)
    qw = np.exp(rng.normal(0, 2, 512)).astype(F32)
    with_im = Q.quantize(x, qtype, imatrix=qw)
    assert np.array_equal(with_im, ref.quantize(x, qtype, qw))
    assert not np.array_equal(with_im, Q.quantize(x, qtype))
    assert not np.array_equal(with_im, Q.quantize(x, qtype, imatrix=qw[::-1].copy()))


def test_q8_0_ignores_the_imatrix(ref):
    x = (np.random.default_rng(6).standard_normal((4, 256)) * 0.1).astype(F32)
    qw = np.random.default_rng(7).uniform(0, 1, 256).astype(F32)
    assert np.array_equal(Q.quantize(x, T.Q8_0, imatrix=qw), Q.quantize(x, T.Q8_0))
    assert np.array_equal(Q.quantize(x, T.Q8_0, imatrix=qw), ref.quantize(x, T.Q8_0, qw))


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q5_0, T.IQ4_XS], ids=lambda t: t.name)
def test_per_expert_imatrix_matches_c_expert_by_expert(ref, qtype):
    rng = np.random.default_rng(8)
    x = (rng.standard_normal((3, 5, 512)) * 0.03).astype(F32)
    qw = rng.uniform(0, 3, (3, 512)).astype(F32)
    ours = Q.quantize(x, qtype, imatrix=qw)
    assert np.array_equal(ours, ref.quantize(x, qtype, qw))
    for e in range(3):  # and expert e's rows are exactly what that expert's importance row gives
        assert np.array_equal(ours[e], Q.quantize(x[e], qtype, imatrix=qw[e]))
    import torch

    assert np.array_equal(Q.quantize(torch.from_numpy(x), qtype, imatrix=torch.from_numpy(qw)), ours)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q4_0, T.IQ4_NL], ids=lambda t: t.name)
def test_parallel_and_long_rows_give_the_same_bytes(ref, qtype, monkeypatch):
    """Rows are never split with an importance matrix (Q4_0's weights use the whole row's mean square)."""
    from ktconvert.quant import _api

    rng = np.random.default_rng(9)
    x = (rng.standard_normal((6, 4096)) * 0.02).astype(F32)
    qw = rng.uniform(0, 1, 4096).astype(F32)
    want = ref.quantize(x, qtype, qw)
    monkeypatch.setattr(_api, "_CHUNK", 1024)  # work items of one row each (rows longer than a chunk stay whole)
    assert np.array_equal(Q.quantize(x, qtype, imatrix=qw), want)
    assert np.array_equal(Q.quantize_parallel(x, qtype, imatrix=qw, workers=3), want)


@pytest.mark.parametrize("qtype", IQ4, ids=lambda t: t.name)
def test_iq4_without_imatrix_equals_c_and_decodes_with_gguf(ref, qtype):
    rng = np.random.default_rng(10)
    for name, x in _data(rng, 512):
        ours = Q.quantize(x, qtype)
        assert np.array_equal(ours, ref.quantize(x, qtype)), f"{qtype.name} {name}: {_mismatch(ours, ref.quantize(x, qtype))}"
        back = np.asarray(gq.dequantize(ours, qtype), dtype=F32)
        assert np.array_equal(back.view(np.uint32), ref.dequantize(ours, qtype).view(np.uint32))
    x = (rng.standard_normal((8, 512))).astype(F32)
    err = np.abs(Q.dequantize(Q.quantize(x, qtype), qtype) - x).mean() / np.abs(x).mean()
    assert 0.02 < err < 0.15   # a 4.25-4.5 bit type: neither exact nor garbage


_finite = st.floats(width=32, allow_nan=False, allow_infinity=False, allow_subnormal=True)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(base=hnp.arrays(F32, (2, 256), elements=_finite),
       scale=st.sampled_from([1.0, 0.02, 1e-6, 1e-30, 3e4, 1e15]),
       qw=hnp.arrays(F32, 256, elements=st.floats(0, 1e6, width=32)),
       qtype=st.sampled_from(WEIGHTED))
def test_property_random_blocks_and_imatrices_match_c(ref, base, scale, qw, qtype):
    with np.errstate(over="ignore"):
        x = (base * F32(scale)).astype(F32)
    x[~np.isfinite(x)] = 0
    assert np.array_equal(Q.quantize(x, qtype, imatrix=qw), ref.quantize(x, qtype, qw))


@pytest.mark.parametrize("bad,msg", [
    (np.ones(255, F32), "shape (255,)"),
    (np.ones((2, 256), F32), "shape (2, 256)"),
    (np.array([-1.0] + [1.0] * 255, F32), "-1.0 at index (0,)"),
    (np.array([1.0] * 200 + [np.nan] * 56, F32), "nan at index (200,)"),
    (np.array(["a"] * 256), "not numbers"),
])
def test_bad_imatrix_is_one_line_and_nothing_is_written(bad, msg, tmp_path):
    x = np.ones((4, 256), F32)
    out = np.lib.format.open_memmap(tmp_path / "o.npy", mode="w+", dtype=np.uint8, shape=(4, 144))
    out[...] = 7
    with pytest.raises(Q.QuantError) as ei:
        Q.quantize(x, T.Q4_K, imatrix=bad, name="blk.0.ffn_up.weight", out=out)
    text = str(ei.value)
    assert msg in text and "blk.0.ffn_up.weight" in text and "\n" not in text
    assert ei.value.exit_code == 3
    assert (out == 7).all()
