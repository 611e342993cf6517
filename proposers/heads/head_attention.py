"""A draft head's causal attention over one request's KVStore, compiled (Numba).

Layout (KVStore): k [kv heads, head_dim, capacity] (keys contiguous for each dim), v [capacity, kv
heads, head_dim]; the capacity is a multiple of 16. Per query row and head, 16 keys (or, for the
values, 16 dims) at a time: each score a sequential float32 sum of fused multiply-adds over head_dim,
the softmax as the target's attention takes it (attention_vec._softmax: exp(score * scale - max),
16-lane partial sums folded in a fixed order, keys in 16-key chunks aligned to key 0), each output
element a sequential fused sum over keys in order, times 1 / sum. A row's output depends only on
its q and its request's keys, never on the other rows of the call. (One key at a time with a scalar
exp, 9 heads x 300 keys took 50 us a draft token.) A head_dim that is not a multiple of 16 takes a
scalar loop in the same order of keys.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from engine.kernels.attention_vec import _softmax
from engine.kernels.simd import (
    f32_fma,
    f32_mul,
    f32_splat,
    f32_zero,
    load_rows,
    store_rows,
)


@nb.njit(cache=True)
def store_kv(qkv, k_store, v_store, p0, num_heads):
    """K/V rows of qkv [m, ...] into the store at positions p0..p0+m-1."""
    num_kv, hd = k_store.shape[0], k_store.shape[1]
    for r in range(qkv.shape[0]):
        for h in range(num_kv):
            for d in range(hd):
                k_store[h, d, p0 + r] = qkv[r, (num_heads + h) * hd + d]
                v_store[p0 + r, h, d] = qkv[r, (num_heads + num_kv + h) * hd + d]


@nb.njit(cache=True)
def _score_span(qkv, r, q0, k_store, k0, cap, scores, c, tt):
    """scores[0, c : c + 16 tt] = q . k for 16 tt keys (tt literal: that many sums in flight)."""
    nb.literally(tt)
    acc = f32_zero(tt)
    for d in range(k_store.shape[1]):
        acc = f32_fma(f32_splat(qkv[r, q0 + d], tt), load_rows(k_store, k0 + d * cap + c, 16, tt), acc)
    store_rows(scores, c, 16, acc, 16)


@nb.njit(cache=True)
def _value_span(v_store, kvh, c, lo, end, scores, inv, out, o, tt):
    """out[o : o + 16 tt] = sum over keys lo..end-1, in order, of p * v (dims c..c + 16 tt), times inv."""
    nb.literally(tt)
    num_kv, hd = v_store.shape[1], v_store.shape[2]
    acc = f32_zero(tt)
    for j in range(lo, end):
        acc = f32_fma(f32_splat(scores[0, j], tt), load_rows(v_store, (j * num_kv + kvh) * hd + c, 16, tt), acc)
    store_rows(out, o, 16, f32_mul(acc, f32_splat(inv, tt)), 16)


@nb.njit(cache=True, inline="always")
def _row_first(first, window, end):
    """The first key a row that ends at key end - 1 sees: `first`, or within the last `window` keys (0: no window)."""
    return max(first, end - window) if window > 0 else first


@nb.njit(cache=True)
def _attend_vec(qkv, k_store, v_store, p0, first, window, num_heads, scale, out):
    num_kv, hd, cap = k_store.shape
    group = num_heads // num_kv
    scores = np.empty((1, cap), np.float32)  # [1, keys]: chunk-aligned scores of one head
    for r in range(qkv.shape[0]):
        end = p0 + r + 1  # this row sees keys lo..end-1
        lo = _row_first(first, window, end)
        last = (end + 15) // 16 * 16  # <= cap: the loads stay in the store
        for h in range(num_heads):
            kvh = h // group
            c = lo - lo % 16
            while c + 64 <= last:  # 4 chunks of 16 keys at a time
                _score_span(qkv, r, h * hd, k_store, kvh * hd * cap, cap, scores, c, 4)
                c += 64
            for tail in range(c, last, 16):
                _score_span(qkv, r, h * hd, k_store, kvh * hd * cap, cap, scores, tail, 1)
            inv = _softmax(scores, 0, lo, end, scale)
            o = r * out.shape[1] + h * hd
            for c in range(0, hd - hd % 64, 64):
                _value_span(v_store, kvh, c, lo, end, scores, inv, out, o + c, 4)
            for c in range(hd - hd % 64, hd, 16):
                _value_span(v_store, kvh, c, lo, end, scores, inv, out, o + c, 1)


@nb.njit(cache=True)
def _attend_scalar(qkv, k_store, v_store, p0, first, window, num_heads, scale, out):
    num_kv, hd = k_store.shape[0], k_store.shape[1]
    group = num_heads // num_kv
    scores = np.empty(p0 + qkv.shape[0] - first, np.float32)  # [keys]
    acc = np.empty(hd, np.float32)
    for r in range(qkv.shape[0]):
        lo = _row_first(first, window, p0 + r + 1)
        n = p0 + r + 1 - lo  # keys this row sees
        for h in range(num_heads):
            kvh = h // group
            scores[:n] = np.float32(0.0)
            for d in range(hd):
                qd = qkv[r, h * hd + d]
                keys = k_store[kvh, d, lo : lo + n]  # a view from `lo`: no signed offsets in the vector loop
                for j in range(n):
                    scores[j] += qd * keys[j]
            top = np.float32(-np.inf)
            for j in range(n):
                scores[j] *= scale
                top = max(top, scores[j])
            total = np.float32(0.0)
            for j in range(n):
                scores[j] = np.exp(scores[j] - top)
                total += scores[j]
            acc[:] = np.float32(0.0)
            for j in range(n):
                p = scores[j]
                values = v_store[lo + j, kvh]
                for d in range(hd):
                    acc[d] += p * values[d]
            inv = np.float32(1.0) / total
            for d in range(hd):
                out[r, h * hd + d] = acc[d] * inv


@nb.njit(cache=True)
def store_and_attend(qkv, k_store, v_store, p0, lo, window, num_heads, scale, out):
    """qkv [m, (heads + 2 kv) hd] (RoPE applied) for positions p0..p0+m-1: writes its K/V rows to the
    store at those positions, then row r attends to keys max(lo, p0 + r + 1 - window)..p0+r (window 0:
    from lo) -> out [m, heads * hd] (C-contiguous)."""
    store_kv(qkv, k_store, v_store, p0, num_heads)
    if k_store.shape[1] % 16 == 0 and k_store.shape[2] % 16 == 0:
        _attend_vec(qkv, k_store, v_store, p0, lo, window, num_heads, scale, out)
    else:
        _attend_scalar(qkv, k_store, v_store, p0, lo, window, num_heads, scale, out)
