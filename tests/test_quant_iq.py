"""The IQ grid quantizers (IQ3_XXS, ...: ``ktconvert/quant/_jit_iq.py``), byte for byte against ggml's C
``quantize_iq*`` through ``ggml_quantize_chunk`` (the pinned ggml built by tests/ggml_ref.py), with an importance
matrix and, where ggml allows it, without one; on held-out random rows and adversarial ones (zeros, tiny,
subnormal, huge, constant, all negative, outliers)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import ggml_ref
from ktconvert import quant as Q
from test_quant_imatrix import _data, _imatrices, _mismatch

pytestmark = pytest.mark.interop

F32 = np.float32
GRID = sorted(Q.IQ_GRID_TYPES, key=lambda t: t.value)
WITHOUT_OK = [t for t in GRID if t not in Q.IMATRIX_REQUIRED]


@pytest.fixture(scope="session")
def ref() -> ggml_ref.GgmlRef:
    return ggml_ref.load_or_skip()


def _adversarial(rng: np.random.Generator, n: int) -> list[tuple[str, np.ndarray]]:
    out = []

    def add(name, a):
        out.append((name, np.ascontiguousarray(np.asarray(a, dtype=np.float64).astype(F32))))

    add("zeros", np.zeros((2, n)))
    add("negative", -np.abs(rng.standard_normal((3, n))) * 0.05)
    add("huge", rng.standard_normal((3, n)) * 1e11)     # (from about 1e12 the distances overflow: see below)
    add("huge_outlier", np.where(rng.random((2, n)) < 0.01, 3e11, rng.standard_normal((2, n))))
    add("subnormal", rng.integers(-3, 4, (3, n)) * 1.4e-45)           # sub-block maxima that are barely not 0
    x = rng.standard_normal((3, n)) * 0.02
    x[:, 32:64] = 0.0                                                   # one all-zero sub-block in each super-block
    x[1, 256 - 32:] = 0.0
    add("zero_sub_blocks", x)
    add("one_sign_per_8", np.tile([-1.0, 2, 3, 4, 5, 6, 7, 8], (2, n // 8)))   # odd negatives per group of 8
    add("all_equal_negative", np.full((2, n), -0.75))
    return out


@pytest.mark.parametrize("qtype", GRID, ids=lambda t: t.name)
@pytest.mark.parametrize("n", [256, 1024])
def test_grid_quantize_with_imatrix_bytes_equal_c(ref, qtype, n):
    rng = np.random.default_rng(2000 + n)
    data, ims = _data(rng, n) + _adversarial(rng, n), _imatrices(rng, n)
    for k, (dname, x) in enumerate(data):
        for iname, qw in (ims if k < 2 else ims[k % len(ims):][:2]):
            ours = Q.quantize(x, qtype, imatrix=qw)
            theirs = ref.quantize(x, qtype, qw)
            assert np.array_equal(ours, theirs), f"{qtype.name} n={n} {dname} x {iname}: {_mismatch(ours, theirs)}"


@pytest.mark.parametrize("qtype", WITHOUT_OK, ids=lambda t: t.name)
def test_grid_quantize_without_imatrix_bytes_equal_c_and_decode(ref, qtype):
    rng = np.random.default_rng(11)
    for name, x in _data(rng, 512) + _adversarial(rng, 512):
        ours = Q.quantize(x, qtype)
        theirs = ref.quantize(x, qtype)
        assert np.array_equal(ours, theirs), f"{qtype.name} {name}: {_mismatch(ours, theirs)}"
        with np.errstate(all="ignore"):
            back = Q.dequantize(ours, qtype)   # the gguf package's decoder, which verify reads IQ GGUFs with
        assert np.array_equal(back.view(np.uint32), ref.dequantize(ours, qtype).view(np.uint32))


@pytest.mark.parametrize("qtype", GRID, ids=lambda t: t.name)
def test_grid_quantize_error_and_importance_are_real(ref, qtype):
    """A fair reconstruction for the type's bits, and the importance matrix changes the bytes."""
    rng = np.random.default_rng(12)
    x = (rng.standard_normal((8, 1024)) * 0.02).astype(F32)
    qw = np.exp(rng.normal(0, 2, 1024)).astype(F32)
    q = Q.quantize(x, qtype, imatrix=qw)
    err = np.abs(Q.dequantize(q, qtype) - x).mean() / np.abs(x).mean()
    assert 0.05 < err < (0.75 if qtype in (Q.QType.IQ1_S, Q.QType.IQ1_M) else 0.6), err  # 1.6-3.4 bits per weight: lossy, not garbage
    assert not np.array_equal(q, Q.quantize(x, qtype, imatrix=qw[::-1].copy()))


@pytest.mark.parametrize("qtype", GRID, ids=lambda t: t.name)
def test_grid_per_expert_imatrix_and_threads_match_c(ref, qtype, monkeypatch):
    from ktconvert.quant import _api

    rng = np.random.default_rng(13)
    x = (rng.standard_normal((3, 4, 512)) * 0.03).astype(F32)
    qw = rng.uniform(0, 3, (3, 512)).astype(F32)
    want = ref.quantize(x, qtype, qw)
    assert np.array_equal(Q.quantize(x, qtype, imatrix=qw), want)
    monkeypatch.setattr(_api, "_CHUNK", 512)        # one row per work item, over three threads
    assert np.array_equal(Q.quantize_parallel(x, qtype, imatrix=qw, workers=3), want)


# bounded so the C's distances stay finite (from about 1e12 ggml aborts: see the test below)
_finite = st.floats(-1e6, 1e6, width=32, allow_subnormal=True)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(base=hnp.arrays(F32, (1, 256), elements=_finite),
       scale=st.sampled_from([1.0, 0.02, 1e-6, 1e-30, 1e-40, 3e4]),
       qw=hnp.arrays(F32, 256, elements=st.floats(0, 1e6, width=32)),
       qtype=st.sampled_from(GRID))
def test_property_grid_blocks_match_c(ref, base, scale, qw, qtype):
    x = (base * F32(scale)).astype(F32)
    assert np.array_equal(Q.quantize(x, qtype, imatrix=qw), ref.quantize(x, qtype, qw))


_ABORT_IN_C = """
import sys, numpy as np
sys.path.insert(0, "tests")
import ggml_ref
from gguf import GGMLQuantizationType as T
x = np.full((1, 256), 1e17, np.float32); x[0, ::3] = -3e16
ggml_ref.load().quantize(x, T[sys.argv[1]], np.ones(256, np.float32))
print("returned")
"""


@pytest.mark.parametrize("qtype", GRID[:1], ids=lambda t: t.name)
def test_rows_ggml_aborts_on_are_one_error_and_nothing_is_returned(ref, qtype, tmp_path):
    """Values near 1e17 overflow the search's float32 distances: ggml's C aborts the process
    (``GGML_ASSERT(grid_index >= 0)``); we raise one QuantError naming the tensor and row instead."""
    import subprocess
    import sys
    from pathlib import Path

    x = np.zeros((3, 256), F32)
    x[2] = 1e17
    x[2, ::3] = -3e16
    with pytest.raises(Q.QuantError) as ei:
        Q.quantize(x, qtype, imatrix=np.ones(256, F32), name="blk.0.ffn_down.weight")
    text = str(ei.value)
    assert "row 2" in text and "blk.0.ffn_down.weight" in text and "\n" not in text and ei.value.exit_code == 3
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", _ABORT_IN_C, qtype.name], cwd=root, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0 and "returned" not in proc.stdout, proc.stdout
    assert "GGML_ASSERT" in proc.stderr


@pytest.mark.parametrize("qtype", sorted(Q.IMATRIX_REQUIRED, key=lambda t: t.value), ids=lambda t: t.name)
def test_types_ggml_needs_an_imatrix_for_are_refused_without_one(qtype, tmp_path):
    x = np.ones((4, 256), F32)
    out = np.lib.format.open_memmap(tmp_path / "o.npy", mode="w+", dtype=np.uint8,
                                    shape=Q.byte_shape(x.shape, qtype))
    out[...] = 7
    with pytest.raises(Q.QuantError) as ei:
        Q.quantize(x, qtype, name="blk.1.ffn_up_exps.weight", out=out)
    text = str(ei.value)
    assert f"{qtype.name} needs an importance matrix" in text and "blk.1.ffn_up_exps.weight" in text
    assert "\n" not in text and ei.value.exit_code == 3
    assert (out == 7).all()
