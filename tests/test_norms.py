"""RMSNorm's sum of squares: 16 lane sums, a fixed fold, then the tail. Checked against a float64
reference, against a NumPy emulation of that documented order (same bits), and for a row alone or in
a batch, serial or parallel, with and without the residual add."""

import numpy as np
import pytest

import engine  # noqa: F401  (sets NUMBA_SLP_VECTORIZE before numba compiles anything)
from engine.kernels import ops


def ordered_sum_squares(row: np.ndarray) -> np.float32:
    """The order ops.sum_squares documents, in NumPy float32."""
    body = len(row) - len(row) % 16
    lanes = np.zeros(16, np.float32)
    for i in range(0, body, 16):
        lanes = lanes + row[i:i + 16] * row[i:i + 16]
    while len(lanes) > 1:  # (0..7) + (8..15), then (0..3) + (4..7), ...
        half = len(lanes) // 2
        lanes = lanes[:half] + lanes[half:]
    acc = lanes[0]
    for v in row[body:]:
        acc = np.float32(acc + v * v)
    return acc


@pytest.mark.parametrize("hidden", [576, 64, 100, 7])  # whole vectors, vectors + a tail, a tail only
def test_rms_norm_order_reference_and_row_locality(hidden):
    rng = np.random.default_rng(hidden)
    x = (rng.standard_normal((9, hidden)) * 3).astype(np.float32)
    w = rng.standard_normal(hidden).astype(np.float32)
    eps = np.float32(1e-5)
    serial, parallel = (np.full((9, hidden), np.nan, np.float32) for _ in range(2))
    ops._RMS_NORM[0](x, w, eps, serial)
    ops._RMS_NORM[1](x, w, eps, parallel)
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt((x64 ** 2).mean(axis=1, keepdims=True) + 1e-5) * w
    np.testing.assert_allclose(serial, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(serial, parallel)
    for t in range(9):
        inv = np.float32(1.0) / np.sqrt(ordered_sum_squares(x[t]) / np.float32(hidden) + eps)
        np.testing.assert_array_equal(serial[t], x[t] * inv * w)
        alone = np.empty((1, hidden), np.float32)
        ops._RMS_NORM[0](x[t:t + 1], w, eps, alone)
        np.testing.assert_array_equal(alone[0], serial[t])


def test_add_rms_norm_is_the_norm_of_the_sum():
    rng = np.random.default_rng(1)
    x, delta = (rng.standard_normal((9, 100)).astype(np.float32) for _ in range(2))
    w = rng.standard_normal(100).astype(np.float32)
    want_x, want = x + delta, np.empty_like(x)
    ops.rms_norm(want_x, w, 1e-5, want)
    for pair in ops._ADD_RMS_NORM:
        got_x, got = x.copy(), np.empty_like(x)
        pair(got_x, delta, w, np.float32(1e-5), got)
        np.testing.assert_array_equal(got_x, want_x)
        np.testing.assert_array_equal(got, want)


def test_norms_take_any_layout_or_say_why_not():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((100, 9)).astype(np.float32).T  # rows not contiguous
    w = rng.standard_normal(100).astype(np.float32)
    got, want = np.empty((9, 100), np.float32), np.empty((9, 100), np.float32)
    ops.rms_norm(x, w, 1e-5, got)
    ops.rms_norm(np.ascontiguousarray(x), w, 1e-5, want)
    np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="C-contiguous"):
        ops.add_rms_norm(x, np.zeros((9, 100), np.float32), w, 1e-5, got)
