"""RoPE on adjacent pairs: 8 pairs at a time (simd_rope) plus a scalar tail, the same bits as the
pair-by-pair float32 formula, for full and partial rotary dims, serial or parallel."""

import numpy as np
import pytest

import engine  # noqa: F401  (sets NUMBA_SLP_VECTORIZE before numba compiles anything)
from engine.kernels import ops


def rotate_reference(qkv, positions, cos, sin, num_rot_heads, head_dim, rope_dim):
    """(a, b) -> (a c - b s, a s + b c) per pair, each product and difference rounded to float32."""
    out = qkv.copy()
    for t, p in enumerate(positions):
        for h in range(num_rot_heads):
            base = h * head_dim
            a, b = qkv[t, base:base + rope_dim:2], qkv[t, base + 1:base + rope_dim:2]
            c, s = cos[p], sin[p]
            out[t, base:base + rope_dim:2] = a * c - b * s
            out[t, base + 1:base + rope_dim:2] = a * s + b * c
    return out


@pytest.mark.parametrize("head_dim, rope_dim", [(64, 64), (48, 40), (8, 8)])  # vectors; vectors + tail; tail only
def test_rope_adjacent_matches_the_pairwise_formula(head_dim, rope_dim):
    rng = np.random.default_rng(head_dim + rope_dim)
    heads, kv = 4, 2
    qkv = (rng.standard_normal((9, (heads + 2 * kv) * head_dim)) * 3).astype(np.float32)
    positions = rng.integers(0, 500, 9).astype(np.int32)
    cos, sin = ops.rope_tables(512, rope_dim, 10000.0, 1.0)
    want = rotate_reference(qkv, positions, cos, sin, heads + kv, head_dim, rope_dim)
    for fn in ops._ROPE:
        got = qkv.copy()
        fn(got, positions, cos, sin, heads + kv, head_dim, rope_dim)
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="C-contiguous"):
        ops.rope_adjacent(np.asfortranarray(qkv), positions, cos, sin, heads + kv, head_dim, rope_dim)
