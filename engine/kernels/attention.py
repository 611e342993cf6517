"""Append attention over a paged KV cache, for a ragged batch (Numba).

Each request appends T_i tokens on top of its cached prefix. A query at absolute
position p attends to keys 0..p of its own request: the whole cached prefix plus
the appended tokens up to itself (causal inside the run).

Layout: k_cache [num_blocks, num_kv_heads, head_dim, block_size] (K transposed inside
a block), v_cache [num_blocks, block_size, num_kv_heads, head_dim]. A query computes
the scores of a whole block at once (a vector op over the block's keys, each score a
sequential sum over head_dim), then max, exp and sum in key order, then the weighted
V sum in key order. Every step depends only on the query and its request's keys, so
a query's output is the same whatever the batch or the prefill chunking.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from engine.kernels.ops import _twice

PARALLEL_MIN_WORK = 2048  # query-heads x keys below which one thread beats waking the pool
U0, U1, U16 = np.uint64(0), np.uint64(1), np.uint64(16)


def _write_kv(qkv, k_cache, v_cache, slot_mapping, q_size, kv_size):
    """Scatter the new K/V rows into the cache. qkv: [num_tokens, q_size + 2 * kv_size]."""
    num_kv, head_dim, block_size = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    for t in nb.prange(qkv.shape[0]):
        slot = slot_mapping[t]
        b = slot // block_size
        o = slot % block_size
        for h in range(num_kv):
            for d in range(head_dim):
                k_cache[b, h, d, o] = qkv[t, q_size + h * head_dim + d]
                v_cache[b, o, h, d] = qkv[t, q_size + kv_size + h * head_dim + d]


@nb.njit(cache=True, inline="always")
def _softmax_rows(scores, positions, t0, num_q, scale):
    """scores[qi, :keys] = exp(scores * scale - max) over keys 0..position, in key order; [num_q] 1 / sums."""
    inv = np.empty(num_q, dtype=np.float32)
    for qi in range(num_q):
        num_keys = positions[t0 + qi] + 1
        m = np.float32(-np.inf)
        for j in range(num_keys):
            scores[qi, j] *= scale
            if scores[qi, j] > m:
                m = scores[qi, j]
        denom = np.float32(0.0)
        for j in range(num_keys):
            e = np.exp(scores[qi, j] - m)
            scores[qi, j] = e
            denom += e
        inv[qi] = np.float32(1.0) / denom
    return inv


def _paged_attention(qkv, k_cache, v_cache, cu_q, positions, block_tables, num_heads, scale, out):
    """Any block size and head_dim. out[t, h*hd:(h+1)*hd] = softmax(q·K^T * scale) V over keys 0..positions[t] of its request.

    qkv: [num_tokens, ...] (q heads first); out: [num_tokens, num_heads * head_dim].
    One work item = one request x one query head: all of the request's appended tokens
    (a verify run) share each K/V block while it is in cache.
    """
    num_kv, head_dim, block_size = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    group = num_heads // num_kv
    bs = np.uint64(block_size)
    hd = np.uint64(head_dim)
    num_reqs = cu_q.shape[0] - 1
    for item in nb.prange(num_reqs * num_heads):
        r = item // num_heads
        h = item % num_heads
        kvh = h // group
        t0 = cu_q[r]
        num_q = cu_q[r + 1] - t0
        num_blocks = (positions[t0 + num_q - 1] + block_size) // block_size
        scores = np.empty((num_q, num_blocks * block_size), dtype=np.float32)  # [queries, keys]
        for i in range(num_blocks):  # scores, one K block at a time
            k_blk = k_cache[block_tables[r, i], kvh]  # [head_dim, block_size]
            for qi in range(num_q):
                s = scores[qi, i * block_size : (i + 1) * block_size]
                for o in range(bs):
                    s[o] = np.float32(0.0)
                for d in range(hd):
                    qd = qkv[t0 + qi, h * head_dim + d]
                    for o in range(bs):
                        s[o] += qd * k_blk[d, o]
        inv = _softmax_rows(scores, positions, t0, num_q, scale)
        acc = np.zeros((num_q, head_dim), dtype=np.float32)
        for i in range(num_blocks):  # weighted V sum, one V block at a time, keys in order
            v_blk = v_cache[block_tables[r, i]]  # [block_size, num_kv, head_dim]
            for qi in range(num_q):
                num_keys = positions[t0 + qi] + 1
                for o in range(min(block_size, num_keys - i * block_size)):
                    p = scores[qi, i * block_size + o]
                    for d in range(hd):
                        acc[qi, d] += p * v_blk[o, kvh, d]
        for qi in range(num_q):
            for d in range(head_dim):
                out[t0 + qi, h * head_dim + d] = acc[qi, d] * inv[qi]


def _paged_attention_16(qkv, k_cache, v_cache, cu_q, positions, block_tables, num_heads, scale, out):
    """Same arithmetic, same bits as _paged_attention, for block_size and head_dim multiples of 16:
    16 scores (or 16 output dims) are summed side by side in one register-resident lane, with
    constant trip counts and unsigned indices so LLVM vectorises them (about 1.8x faster)."""
    hd, bs = np.uint64(k_cache.shape[2]), np.uint64(k_cache.shape[3])
    group = num_heads // k_cache.shape[1]
    for item in nb.prange((cu_q.shape[0] - 1) * num_heads):
        r, h = item // num_heads, item % num_heads
        kvh, q0 = h // group, np.uint64(h) * hd
        t0 = cu_q[r]
        num_q = cu_q[r + 1] - t0
        num_blocks = (positions[t0 + num_q - 1] + k_cache.shape[3]) // k_cache.shape[3]
        lane = np.empty((1, 16), dtype=np.float32)
        scores = np.empty((num_q, num_blocks * k_cache.shape[3]), dtype=np.float32)  # [queries, keys]
        for i in range(num_blocks):  # scores, one K block at a time
            b = block_tables[r, i]
            for qi in range(num_q):
                for c in range(U0, bs, U16):
                    lane[:] = 0
                    for d in range(hd):
                        qd = qkv[np.uint64(t0 + qi), q0 + d]
                        for o in range(U16):
                            lane[0, o] += qd * k_cache[b, kvh, d, c + o]
                    for o in range(U16):
                        scores[qi, np.uint64(i) * bs + c + o] = lane[0, o]
        inv = _softmax_rows(scores, positions, t0, num_q, scale)
        for qi in range(num_q):  # weighted V sum, keys in order, 16 output dims at a time
            n = np.uint64(positions[t0 + qi] + 1)
            for c in range(U0, hd, U16):
                lane[:] = 0
                for i in range((n + bs - U1) // bs):
                    b = block_tables[r, i]
                    for o in range(min(bs, n - i * bs)):
                        p = scores[qi, i * bs + o]
                        for e in range(U16):
                            lane[0, e] += p * v_cache[b, o, kvh, c + e]
                for e in range(U16):
                    out[np.uint64(t0 + qi), q0 + c + e] = lane[0, e] * inv[qi]


_WRITE_KV = _twice(_write_kv)
_ATTENTION = _twice(_paged_attention)
_ATTENTION_16 = _twice(_paged_attention_16)


def write_kv(qkv, k_cache, v_cache, slot_mapping, q_size, kv_size):
    fn = _WRITE_KV[1] if qkv.shape[0] >= 64 else _WRITE_KV[0]
    fn(qkv, k_cache, v_cache, slot_mapping, q_size, kv_size)


def paged_attention(qkv, k_cache, v_cache, cu_q, positions, block_tables, num_heads, scale, out):
    num_tokens = qkv.shape[0]
    work = num_tokens * num_heads * (int(positions.max()) + 1) if num_tokens else 0
    pair = _ATTENTION_16 if k_cache.shape[2] % 16 == 0 and k_cache.shape[3] % 16 == 0 else _ATTENTION
    fn = pair[1] if work >= PARALLEL_MIN_WORK else pair[0]
    fn(qkv, k_cache, v_cache, cu_q, positions, block_tables, num_heads, np.float32(scale), out)
