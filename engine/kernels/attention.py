"""Append attention over a paged KV cache, for a ragged batch (Numba).

Each request appends T_i tokens on top of its cached prefix. A query at absolute
position p attends to keys 0..p of its own request: the whole cached prefix plus
the appended tokens up to itself (causal inside the run). The keys are visited in
position order with an online softmax, so a query's output depends only on its
request's keys and never on the batch or on how the prompt was chunked.

q·k is summed in LANES partial sums (lane l takes dims l, l + LANES, ...) that are
then added in lane order: a fixed order, so still exact-invariant, but the partial
sums are plain elementwise updates that LLVM vectorises without fastmath.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from engine.kernels.ops import _twice

LANES = 16
PARALLEL_MIN_WORK = 2048  # query-heads x keys below which one thread beats waking the pool


def _write_kv(qkv, k_cache, v_cache, slot_mapping, q_size, kv_size):
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


def _paged_attention(qkv, k_cache, v_cache, req_of_token, positions, block_tables, num_heads, scale, out):
    """out[t, h*hd:(h+1)*hd] = softmax(q·K^T * scale) V over keys 0..positions[t] of its request.

    qkv: [num_tokens, ...] (q heads first); out: [num_tokens, num_heads * head_dim].
    Unsigned inner indices spare LLVM the negative-index checks that block vectorisation.
    """
    block_size = k_cache.shape[1]
    num_kv, head_dim = k_cache.shape[2], k_cache.shape[3]
    group = num_heads // num_kv
    lanes = np.uint64(LANES)
    num_chunks = np.uint64(head_dim // LANES)
    num_full = head_dim // LANES * LANES
    for item in nb.prange(qkv.shape[0] * num_heads):
        t = item // num_heads
        h = item % num_heads
        kvh = h // group
        r = req_of_token[t]
        q = qkv[t, h * head_dim : (h + 1) * head_dim]
        acc = np.zeros(head_dim, dtype=np.float32)
        part = np.zeros(LANES, dtype=np.float32)
        m = np.float32(-np.inf)
        denom = np.float32(0.0)
        for j in range(positions[t] + 1):
            k_row = k_cache[block_tables[r, j // block_size], j % block_size, kvh]  # [head_dim]
            v_row = v_cache[block_tables[r, j // block_size], j % block_size, kvh]
            for lane in range(lanes):
                part[lane] = np.float32(0.0)
            for c in range(num_chunks):
                base = c * lanes
                for lane in range(lanes):
                    part[lane] += q[base + lane] * k_row[base + lane]
            for d in range(num_full, head_dim):  # head_dim not a multiple of LANES
                part[d - num_full] += q[d] * k_row[d]
            s = np.float32(0.0)
            for lane in range(lanes):
                s += part[lane]
            s *= scale
            if s > m:  # online softmax: rescale what was summed under the old maximum
                corr = np.exp(m - s)
                denom *= corr
                for d in range(head_dim):
                    acc[d] *= corr
                m = s
            p = np.exp(s - m)
            denom += p
            for d in range(np.uint64(head_dim)):
                acc[d] += p * v_row[d]
        inv = np.float32(1.0) / denom
        for d in range(head_dim):
            out[t, h * head_dim + d] = acc[d] * inv


_WRITE_KV = _twice(_write_kv)
_ATTENTION = _twice(_paged_attention)


def write_kv(qkv, k_cache, v_cache, slot_mapping, q_size, kv_size):
    fn = _WRITE_KV[1] if qkv.shape[0] >= 64 else _WRITE_KV[0]
    fn(qkv, k_cache, v_cache, slot_mapping, q_size, kv_size)


def paged_attention(qkv, k_cache, v_cache, req_of_token, positions, block_tables, num_heads, scale, out):
    num_tokens = qkv.shape[0]
    work = num_tokens * num_heads * (int(positions.max()) + 1) if num_tokens else 0
    fn = _ATTENTION[1] if work >= PARALLEL_MIN_WORK else _ATTENTION[0]
    fn(qkv, k_cache, v_cache, req_of_token, positions, block_tables, num_heads, np.float32(scale), out)
