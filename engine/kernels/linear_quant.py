"""Numba kernels for GGUF Q4_1 and Q8_0 weights kept exactly, in strip layout (see linear_jit).

Two kernels per format give the same bits (same float32 weights, same per-element k order):
`*_small` decodes the quants in registers inside the product, for groups of 4 tokens (a group of
3 repeats its last row), then a pair or a single token (best up to a few tokens: a verify step);
`*_scratch` decodes each strip once into a per-thread [K, 16] float32 scratch and runs the
4-token f32 tiles over it (best for many tokens, where decoding once per group would dominate).
"""

import numpy as np
from numba import get_thread_id, njit, prange

from engine.kernels.linear_jit import FOUR, NIBBLE, U0, U1, U2, U3, U4, U16, U32, store_tile, tiles4


@njit(cache=True, inline="always")
def _q4_1_quad(x, qs, d, m, s, t0, t1, t2, t3, acc):
    """acc[0:4] = rows t0..t3 of x against strip s (rows may repeat), nibbles decoded in registers."""
    num_blocks = np.uint64(d.shape[1])
    acc[:] = 0
    for b in range(num_blocks):
        for p in range(U16):
            k = b * U32 + p + p
            x0, x1, x2, x3 = x[t0, k], x[t1, k], x[t2, k], x[t3, k]
            y0, y1, y2, y3 = x[t0, k + U1], x[t1, k + U1], x[t2, k + U1], x[t3, k + U1]
            for r in range(U16):
                q = np.int32(qs[s, b * U16 + p, r])
                w0 = d[s, b, r] * np.float32(np.int32(q & NIBBLE)) + m[s, b, r]
                w1 = d[s, b, r] * np.float32(np.int32(q >> FOUR)) + m[s, b, r]
                acc[0, r] += w0 * x0
                acc[1, r] += w0 * x1
                acc[2, r] += w0 * x2
                acc[3, r] += w0 * x3
                acc[0, r] += w1 * y0
                acc[1, r] += w1 * y1
                acc[2, r] += w1 * y2
                acc[3, r] += w1 * y3


@njit(cache=True, inline="always")
def _q4_1_pair(x, qs, d, m, s, t0, acc):
    """acc[0:2] = rows t0, t0+1 of x against strip s, nibbles decoded in registers."""
    num_blocks = np.uint64(d.shape[1])
    acc[:] = 0
    for b in range(num_blocks):
        for p in range(U16):
            k = b * U32 + p + p
            x0 = x[t0, k]
            y0 = x[t0, k + U1]
            x1 = x[t0 + U1, k]
            y1 = x[t0 + U1, k + U1]
            for r in range(U16):
                q = np.int32(qs[s, b * U16 + p, r])
                w0 = d[s, b, r] * np.float32(np.int32(q & NIBBLE)) + m[s, b, r]
                w1 = d[s, b, r] * np.float32(np.int32(q >> FOUR)) + m[s, b, r]
                acc[0, r] += w0 * x0
                acc[1, r] += w0 * x1
                acc[0, r] += w1 * y0
                acc[1, r] += w1 * y1


@njit(cache=True, inline="always")
def _q4_1_single(x, qs, d, m, s, t0, acc):
    num_blocks = np.uint64(d.shape[1])
    acc[:] = 0
    for b in range(num_blocks):
        for p in range(U16):
            k = b * U32 + p + p
            x0 = x[t0, k]
            y0 = x[t0, k + U1]
            for r in range(U16):
                q = np.int32(qs[s, b * U16 + p, r])
                acc[0, r] += (d[s, b, r] * np.float32(np.int32(q & NIBBLE)) + m[s, b, r]) * x0
                acc[0, r] += (d[s, b, r] * np.float32(np.int32(q >> FOUR)) + m[s, b, r]) * y0


@njit(parallel=True, cache=True)
def q4_1_linear_small(x, qs, d, m, out):
    """x [T, K] @ Q4_1 strips -> out [T, N], tokens in groups of 4 (or 3), then a pair or one."""
    num_tokens = np.uint64(x.shape[0])
    n = np.uint64(out.shape[1])
    for s in prange(qs.shape[0]):
        acc = np.empty((4, 16), np.float32)  # [group tokens, strip rows]
        su = np.uint64(s)
        n0 = su * U16
        num_rows = min(U16, n - n0)
        t0 = U0
        while num_tokens - t0 >= U3:
            last = num_tokens - U1  # a group of 3 repeats its last row
            _q4_1_quad(x, qs, d, m, su, t0, t0 + U1, t0 + U2, min(t0 + U3, last), acc)
            num_group = min(U4, num_tokens - t0)
            store_tile(acc, num_group, out, t0, n0, num_rows)
            t0 += num_group
        if num_tokens - t0 == U2:
            _q4_1_pair(x, qs, d, m, su, t0, acc)
            store_tile(acc, U2, out, t0, n0, num_rows)
            t0 += U2
        if t0 < num_tokens:
            _q4_1_single(x, qs, d, m, su, t0, acc)
            store_tile(acc, U1, out, t0, n0, num_rows)


@njit(parallel=True, cache=True)
def q4_1_linear_scratch(x, qs, d, m, out, scratch):
    """x [T, K] @ Q4_1 strips -> out [T, N]; scratch [num_threads, K, 16] float32."""
    n = np.uint64(out.shape[1])
    num_blocks = np.uint64(d.shape[1])
    for s in prange(qs.shape[0]):
        acc = np.empty((4, 16), np.float32)  # [tile tokens, strip rows]
        su = np.uint64(s)
        tid = np.uint64(get_thread_id())
        for b in range(num_blocks):
            for p in range(U16):
                k = b * U32 + p + p
                for r in range(U16):
                    q = np.int32(qs[su, b * U16 + p, r] & NIBBLE)
                    scratch[tid, k, r] = d[su, b, r] * np.float32(q) + m[su, b, r]
                for r in range(U16):
                    q = np.int32(qs[su, b * U16 + p, r] >> FOUR)
                    scratch[tid, k + U1, r] = d[su, b, r] * np.float32(q) + m[su, b, r]
        n0 = su * U16
        tiles4(x, scratch, tid, out, n0, min(U16, n - n0), acc)


@njit(cache=True, inline="always")
def _q8_0_quad(x, qs, d, s, t0, t1, t2, t3, acc):
    num_blocks = np.uint64(d.shape[1])
    acc[:] = 0
    for b in range(num_blocks):
        for j in range(U32):
            k = b * U32 + j
            x0, x1, x2, x3 = x[t0, k], x[t1, k], x[t2, k], x[t3, k]
            for r in range(U16):
                wv = d[s, b, r] * np.float32(np.int32(qs[s, k, r]))
                acc[0, r] += wv * x0
                acc[1, r] += wv * x1
                acc[2, r] += wv * x2
                acc[3, r] += wv * x3


@njit(cache=True, inline="always")
def _q8_0_pair(x, qs, d, s, t0, acc):
    num_blocks = np.uint64(d.shape[1])
    acc[:] = 0
    for b in range(num_blocks):
        for j in range(U32):
            k = b * U32 + j
            x0 = x[t0, k]
            x1 = x[t0 + U1, k]
            for r in range(U16):
                wv = d[s, b, r] * np.float32(np.int32(qs[s, k, r]))
                acc[0, r] += wv * x0
                acc[1, r] += wv * x1


@njit(cache=True, inline="always")
def _q8_0_single(x, qs, d, s, t0, acc):
    num_blocks = np.uint64(d.shape[1])
    acc[:] = 0
    for b in range(num_blocks):
        for j in range(U32):
            k = b * U32 + j
            x0 = x[t0, k]
            for r in range(U16):
                acc[0, r] += d[s, b, r] * np.float32(np.int32(qs[s, k, r])) * x0


@njit(parallel=True, cache=True)
def q8_0_linear_small(x, qs, d, out):
    """x [T, K] @ Q8_0 strips -> out [T, N], tokens in groups of 4 (or 3), then a pair or one."""
    num_tokens = np.uint64(x.shape[0])
    n = np.uint64(out.shape[1])
    for s in prange(qs.shape[0]):
        acc = np.empty((4, 16), np.float32)  # [group tokens, strip rows]
        su = np.uint64(s)
        n0 = su * U16
        num_rows = min(U16, n - n0)
        t0 = U0
        while num_tokens - t0 >= U3:
            last = num_tokens - U1  # a group of 3 repeats its last row
            _q8_0_quad(x, qs, d, su, t0, t0 + U1, t0 + U2, min(t0 + U3, last), acc)
            num_group = min(U4, num_tokens - t0)
            store_tile(acc, num_group, out, t0, n0, num_rows)
            t0 += num_group
        if num_tokens - t0 == U2:
            _q8_0_pair(x, qs, d, su, t0, acc)
            store_tile(acc, U2, out, t0, n0, num_rows)
            t0 += U2
        if t0 < num_tokens:
            _q8_0_single(x, qs, d, su, t0, acc)
            store_tile(acc, U1, out, t0, n0, num_rows)


@njit(parallel=True, cache=True)
def q8_0_linear_scratch(x, qs, d, out, scratch):
    """x [T, K] @ Q8_0 strips -> out [T, N]; scratch [num_threads, K, 16] float32."""
    n = np.uint64(out.shape[1])
    num_blocks = np.uint64(d.shape[1])
    for s in prange(qs.shape[0]):
        acc = np.empty((4, 16), np.float32)  # [tile tokens, strip rows]
        su = np.uint64(s)
        tid = np.uint64(get_thread_id())
        for b in range(num_blocks):
            for j in range(U32):
                k = b * U32 + j
                for r in range(U16):
                    scratch[tid, k, r] = d[su, b, r] * np.float32(np.int32(qs[su, k, r]))
        n0 = su * U16
        tiles4(x, scratch, tid, out, n0, min(U16, n - n0), acc)
