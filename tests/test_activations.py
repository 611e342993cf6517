"""The gated FFN activations (SwiGLU, GeGLU with tanh-GELU): 16 lanes at a time plus a scalar tail,
against a float64 reference, and the same bits for a row alone or in a batch, serial or parallel."""

import numba as nb
import numpy as np
import pytest

import engine  # noqa: F401  (sets NUMBA_SLP_VECTORIZE before numba compiles anything)
from engine.kernels import arch_ops, ops
from engine.kernels.simd import f32_exp, row_f32, store_rows


def silu_ref(g):
    return g / (1 + np.exp(-g))


def gelu_tanh_ref(g):
    return 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g**3)))


@pytest.mark.parametrize("pair, act", [(ops._SWIGLU, silu_ref), (arch_ops._GEGLU, gelu_tanh_ref)], ids=["swiglu", "geglu"])
@pytest.mark.parametrize("inter", [64, 72, 7])  # whole vectors, vectors + a tail, a tail only
def test_gated_activation_matches_float64_and_is_row_local(pair, act, inter):
    rng = np.random.default_rng(inter)
    gate_up = (rng.standard_normal((9, 2 * inter)) * 4).astype(np.float32)
    gate_up[0, :inter] = np.linspace(-60, 60, inter)  # far tails of the sigmoid
    g, up = gate_up[:, :inter].astype(np.float64), gate_up[:, inter:].astype(np.float64)
    want = act(g) * up
    serial, parallel = (np.full((9, inter), np.nan, np.float32) for _ in range(2))
    pair[0](gate_up, serial)
    pair[1](gate_up, parallel)
    np.testing.assert_allclose(serial, want, rtol=2e-5, atol=1e-6 * np.abs(up).max())
    np.testing.assert_array_equal(serial, parallel)
    for t in range(9):
        alone = np.empty((1, inter), np.float32)
        pair[0](gate_up[t:t + 1], alone)
        np.testing.assert_array_equal(alone[0], serial[t])


@nb.njit(cache=True)
def _exp_lanes(x, out):
    for i in range(0, x.shape[0], 16):
        store_rows(out, i, 0, f32_exp(row_f32(x, i)), 16)


def test_vector_exp_is_within_an_ulp_and_a_half_of_float64():
    """simd.f32_exp (softmax, the sigmoid of SwiGLU / GeGLU) over its domain x <= 0, against float64: its fused
    range reduction and polynomial keep every lane within 1.5 units in the last place (0.98 measured); exp(0) is 1."""
    x = np.concatenate([-np.geomspace(1e-7, 87.0, 2**17 - 16), np.zeros(16)]).astype(np.float32)  # [131072]
    got = np.empty_like(x)
    _exp_lanes(x, got)
    want = np.exp(x.astype(np.float64))
    ulps = np.abs(got - want) / np.spacing(want.astype(np.float32)).astype(np.float64)
    assert ulps.max() <= 1.5, (ulps.max(), x[ulps.argmax()])
    assert np.all(got[-16:] == 1.0)
