"""Append attention over a paged KV cache, for a ragged batch (Numba).

Each request appends T_i tokens on top of its cached prefix. A query at absolute
position p attends to keys 0..p of its own request: the whole cached prefix plus
the appended tokens up to itself (causal inside the run). The keys are visited in
position order with an online softmax, so a query's output depends only on its
request's keys and never on the batch or on how the prompt was chunked.
"""

from __future__ import annotations

import numba as nb
import numpy as np


@nb.njit(parallel=True, cache=True)
def write_kv(qkv, k_cache, v_cache, slot_mapping, q_size, kv_size):
    """Scatter the new K/V rows into the cache.

    qkv: [num_tokens, q_size + 2 * kv_size]; k_cache/v_cache: [num_blocks, block_size, num_kv_heads, head_dim].
    """
    block_size = k_cache.shape[1]
    num_kv, head_dim = k_cache.shape[2], k_cache.shape[3]
    for t in nb.prange(qkv.shape[0]):
        slot = slot_mapping[t]
        b = slot // block_size
        o = slot % block_size
        for h in range(num_kv):
            for d in range(head_dim):
                k_cache[b, o, h, d] = qkv[t, q_size + h * head_dim + d]
                v_cache[b, o, h, d] = qkv[t, q_size + kv_size + h * head_dim + d]


@nb.njit(parallel=True, cache=True)
def paged_attention(qkv, k_cache, v_cache, req_of_token, positions, block_tables, num_heads, scale, out):
    """out[t, h*hd:(h+1)*hd] = softmax(q·K^T * scale) V over keys 0..positions[t] of its request.

    qkv: [num_tokens, ...] (q heads first); out: [num_tokens, num_heads * head_dim].
    """
    block_size = k_cache.shape[1]
    num_kv, head_dim = k_cache.shape[2], k_cache.shape[3]
    group = num_heads // num_kv
    num_items = qkv.shape[0] * num_heads
    for item in nb.prange(num_items):
        t = item // num_heads
        h = item % num_heads
        kvh = h // group
        r = req_of_token[t]
        q = qkv[t, h * head_dim : (h + 1) * head_dim]
        acc = np.zeros(head_dim, dtype=np.float32)
        m = np.float32(-np.inf)
        denom = np.float32(0.0)
        for j in range(positions[t] + 1):
            b = block_tables[r, j // block_size]
            o = j % block_size
            s = np.float32(0.0)
            for d in range(head_dim):
                s += q[d] * k_cache[b, o, kvh, d]
            s *= scale
            if s > m:
                corr = np.exp(m - s)
                denom *= corr
                for d in range(head_dim):
                    acc[d] *= corr
                m = s
            p = np.exp(s - m)
            denom += p
            for d in range(head_dim):
                acc[d] += p * v_cache[b, o, kvh, d]
        inv = np.float32(1.0) / denom
        for d in range(head_dim):
            out[t, h * head_dim + d] = acc[d] * inv
