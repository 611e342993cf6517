"""Paged append attention: the vectorised path (block_size, head_dim multiples of 16) computes the
same bits as the general kernel, and both match a float64 softmax-attention reference."""

import numpy as np
import pytest

import engine  # noqa: F401  (sets NUMBA_SLP_VECTORIZE before numba compiles anything)
from engine.kernels import attention as A

NUM_HEADS, NUM_KV = 6, 2


def make_case(head_dim: int, block_size: int, runs: list[tuple[int, int]], seed: int = 0):
    """Requests given as (cached tokens, appended tokens); blocks shuffled in a shared cache."""
    rng = np.random.default_rng(seed)
    tables = [-(-(c + t) // block_size) for c, t in runs]
    num_blocks = sum(tables) + 1
    k_cache = rng.standard_normal((num_blocks, NUM_KV, head_dim, block_size)).astype(np.float32)
    v_cache = rng.standard_normal((num_blocks, block_size, NUM_KV, head_dim)).astype(np.float32)
    order = rng.permutation(num_blocks).astype(np.int32)
    block_tables = np.zeros((len(runs), max(tables)), np.int32)
    start = 0
    for r, n in enumerate(tables):
        block_tables[r, :n] = order[start:start + n]
        start += n
    cu_q = np.concatenate([[0], np.cumsum([t for _, t in runs])]).astype(np.int32)
    positions = np.concatenate([c + np.arange(t) for c, t in runs]).astype(np.int32)
    qkv = rng.standard_normal((cu_q[-1], (NUM_HEADS + 2 * NUM_KV) * head_dim)).astype(np.float32)
    return qkv, k_cache, v_cache, cu_q, positions, block_tables


def reference(qkv, k_cache, v_cache, cu_q, positions, block_tables, scale):
    """float64 attention of each query over keys 0..position of its own request."""
    head_dim, block_size = k_cache.shape[2], k_cache.shape[3]
    out = np.zeros((qkv.shape[0], NUM_HEADS * head_dim))
    for r in range(len(cu_q) - 1):
        keys = np.concatenate([k_cache[b].transpose(2, 0, 1) for b in block_tables[r]]).astype(np.float64)  # [T, kv, hd]
        vals = np.concatenate([v_cache[b] for b in block_tables[r]]).astype(np.float64)
        for t in range(cu_q[r], cu_q[r + 1]):
            n = positions[t] + 1
            for h in range(NUM_HEADS):
                kvh = h // (NUM_HEADS // NUM_KV)
                s = keys[:n, kvh] @ qkv[t, h * head_dim:(h + 1) * head_dim].astype(np.float64) * scale
                p = np.exp(s - s.max())
                out[t, h * head_dim:(h + 1) * head_dim] = p @ vals[:n, kvh] / p.sum()
    return out


def run(kernel, case, scale):
    out = np.full((case[0].shape[0], NUM_HEADS * case[1].shape[2]), np.nan, np.float32)
    kernel(*case, NUM_HEADS, np.float32(scale), out)
    return out


@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (32, 32), (128, 16)])
def test_vectorised_path_gives_the_general_kernels_bits(head_dim, block_size):
    case = make_case(head_dim, block_size, [(37, 1), (5, 4), (0, 9), (80, 3)])
    want = run(A._ATTENTION[0], case, 0.125)
    for kernel in (*A._ATTENTION_16, A._ATTENTION[1]):
        np.testing.assert_array_equal(run(kernel, case, 0.125), want)
    out = np.empty_like(want)
    A.paged_attention(*case, NUM_HEADS, 0.125, out)
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (40, 4), (64, 24)])
def test_matches_a_float64_reference(head_dim, block_size):
    case = make_case(head_dim, block_size, [(21, 1), (3, 5), (0, 7)], seed=1)
    out = np.empty((case[0].shape[0], NUM_HEADS * head_dim), np.float32)
    A.paged_attention(*case, NUM_HEADS, 1 / np.sqrt(head_dim), out)
    np.testing.assert_allclose(out, reference(*case, 1 / np.sqrt(head_dim)), rtol=1e-4, atol=1e-5)
