"""A draft head's causal attention over one request's KVStore, compiled (Numba).

Layout (KVStore): k [kv heads, head_dim, capacity] (keys contiguous for each dim, so a query's scores
are vector multiply-adds over keys), v [capacity, kv heads, head_dim]. Each score is a sequential
float32 sum over head_dim, the softmax and the weighted V sum run in key order, per query row: a
row's output depends only on its q and its request's keys, never on the other rows of the call.
"""

from __future__ import annotations

import numba as nb
import numpy as np


@nb.njit(cache=True)
def store_and_attend(qkv, k_store, v_store, p0, lo, num_heads, scale, out):
    """qkv [m, (heads + 2 kv) hd] (RoPE applied) for positions p0..p0+m-1: writes its K/V rows to the
    store at those positions, then row r attends to keys lo..p0+r -> out [m, heads * hd]."""
    num_kv, hd = k_store.shape[0], k_store.shape[1]
    group = num_heads // num_kv
    m = qkv.shape[0]
    for r in range(m):
        for h in range(num_kv):
            for d in range(hd):
                k_store[h, d, p0 + r] = qkv[r, (num_heads + h) * hd + d]
                v_store[p0 + r, h, d] = qkv[r, (num_heads + num_kv + h) * hd + d]
    scores = np.empty(p0 + m - lo, np.float32)  # [keys]
    acc = np.empty(hd, np.float32)
    for r in range(m):
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
