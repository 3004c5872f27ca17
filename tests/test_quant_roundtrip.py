"""Round-trip error bounds per type (quantize then dequantize), the table in docs/formats/quantizers.md.

rel_rmse = sqrt(mean((x' - x)^2) / mean(x^2)) over N(0,1) rows of 4096 (the ratio is scale-free);
block_err = max over blocks of max|x' - x| / max|x| in the block (32 elements for the 32-blocks and
F16/BF16, 256 for K-quants and IQ4_XS), on the same data and on Student-t(3) data. The bounds sit ~10-20% above
what these quantizers measure, so a regression in the search or the packing trips them.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from ktconvert import quant as Q

#            rel_rmse bound, block_err bound
BOUNDS = {
    T.F32: (0.0, 0.0),
    T.F16: (2.3e-4, 5.0e-4),
    T.BF16: (1.9e-3, 3.95e-3),
    T.Q8_0: (5.9e-3, 4.45e-3),
    T.Q6_K: (1.95e-2, 1.8e-2),
    T.Q5_1: (4.2e-2, 3.45e-2),
    T.Q5_0: (4.7e-2, 6.4e-2),
    T.Q5_K: (4.0e-2, 6.0e-2),
    T.Q4_1: (8.6e-2, 6.85e-2),
    T.Q4_0: (9.5e-2, 1.27e-1),
    T.Q4_K: (7.9e-2, 1.25e-1),
    T.IQ4_XS: (8.7e-2, 1.17e-1),
    T.IQ4_NL: (8.6e-2, 1.3e-1),
    T.Q3_K: (1.66e-1, 2.5e-1),
    T.Q2_K: (3.26e-1, 4.9e-1),
    T.IQ3_XXS: (2.35e-1, 6.1e-1),     # without an importance matrix (weights x^2: the large values win)
    T.IQ3_S: (1.82e-1, 4.4e-1),
    T.IQ2_XXS: (3.6e-1, 7.0e-1),      # with an importance matrix of ones (ggml requires one)
    T.IQ2_XS: (3.15e-1, 5.9e-1),
    T.IQ2_S: (2.8e-1, 6.4e-1),        # without an importance matrix (weights sigma2/4 + x^2)
    T.IQ1_S: (5.1e-1, 1.0),           # 1.56 bits per weight, an importance matrix of ones
    T.IQ1_M: (6.1e-1, 1.3),           # 1.75 bits per weight without an importance matrix (weights x^2)
}
assert set(BOUNDS) == set(Q.QUANTIZABLE)


@pytest.fixture(scope="module")
def data() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {
        "gaussian": rng.standard_normal((128, 4096)).astype(np.float32),
        "student_t3": rng.standard_t(3, (128, 4096)).astype(np.float32),
    }


def _round_trip(x: np.ndarray, qtype) -> np.ndarray:
    """Quantized and back; the types ggml quantizes only with an importance matrix get one of ones."""
    im = np.ones(x.shape[-1], np.float32) if qtype in Q.IMATRIX_REQUIRED else None
    return Q.dequantize(Q.quantize(x, qtype, imatrix=im), qtype)


def _errors(x: np.ndarray, qtype) -> tuple[float, float]:
    y = _round_trip(x, qtype)
    assert y.dtype == np.float32 and y.shape == x.shape
    e = (y - x).astype(np.float64)
    rel = float(np.sqrt((e ** 2).mean() / (x.astype(np.float64) ** 2).mean()))
    bs = max(Q.block_size(qtype), 32)
    blk = np.abs(e.reshape(-1, bs)).max(axis=1) / np.abs(x.reshape(-1, bs)).max(axis=1)
    return rel, float(blk.max())


@pytest.mark.parametrize("qtype", sorted(BOUNDS, key=lambda t: t.value), ids=lambda t: t.name)
def test_round_trip_error_within_bounds(data, qtype):
    rel_bound, blk_bound = BOUNDS[qtype]
    rel, blk = _errors(data["gaussian"], qtype)
    assert rel <= rel_bound, f"{qtype.name}: relative RMSE {rel:.4g} > {rel_bound}"
    assert blk <= blk_bound, f"{qtype.name}: block error {blk:.4g} > {blk_bound}"
    _, blk_t = _errors(data["student_t3"], qtype)
    assert blk_t <= blk_bound, f"{qtype.name}: block error on t(3) {blk_t:.4g} > {blk_bound}"
    if qtype != T.F32:
        assert rel > 0  # a lossy type that returns its input exactly is not quantizing


def test_more_bits_means_less_error(data):
    rel = {t: _errors(data["gaussian"], t)[0] for t in BOUNDS}
    order = [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_0, T.BF16, T.F16, T.F32]
    errs = [rel[t] for t in order]
    assert errs == sorted(errs, reverse=True), dict(zip([t.name for t in order], errs))


@pytest.mark.parametrize("qtype", sorted(Q.QUANTIZABLE, key=lambda t: t.value), ids=lambda t: t.name)
def test_zero_rows_come_back_as_zero(qtype):
    z = np.zeros((2, 256), dtype=np.float32)
    y = _round_trip(z, qtype)
    assert not y.any()


def test_small_integers_exact_in_float_types_and_within_half_step_in_q8_0():
    x = np.random.default_rng(1).integers(-7, 8, (4, 256)).astype(np.float32)
    x[:, ::32] = 7.0  # every Q8_0 block has amax 7: step 7/127
    for qtype in (T.F32, T.F16, T.BF16):
        assert np.array_equal(Q.dequantize(Q.quantize(x, qtype), qtype), x)
    y = Q.dequantize(Q.quantize(x, T.Q8_0), T.Q8_0)
    d = 7 / 127  # half a step, plus 127 steps of the fp16 rounding of d
    assert np.abs(y - x).max() <= d * (0.5 + 127 * 2 ** -11)
