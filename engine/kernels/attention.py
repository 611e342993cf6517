"""Append attention over a paged KV cache, for a ragged batch (Numba).

Each request appends T_i tokens on top of its cached prefix. A query at absolute
position p attends to keys 0..p of its own request: the whole cached prefix plus
the appended tokens up to itself (causal inside the run). On a sliding-window layer of
`window` keys it attends to keys max(0, p + 1 - window)..p only (window 0: no window).

Layout: k_cache [num_kv_heads, num_blocks, head_dim, block_size] (K transposed inside
a block), v_cache [num_kv_heads, num_blocks, block_size, head_dim]: a KV head's blocks are
contiguous, so a request whose blocks follow each other is one stream per head (read in
2 KB pieces 6 KB apart, with the heads inside a block, the hardware prefetcher kept this
VM at half the rate). A query computes
the scores of a whole block at once (a vector op over the block's keys, each score a
sequential sum over head_dim), then max, exp and sum in key order, then the weighted
V sum in key order. Every step depends only on the query and its request's keys, so
a query's output is the same whatever the batch or the prefill chunking.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from engine.kernels.attention_split import decode_attention, splits
from engine.kernels.attention_vec import first_key, paged_attention_vec, score_scale, soft_cap
from engine.kernels.ops import _twice, q8_scale
from engine.kernels.simd import f16_bits

PARALLEL_MIN_WORK = 2048  # query-heads x keys below which one thread beats waking the pool


def _write_kv(qkv, k_cache, v_cache, slot_mapping, q_size, kv_size):
    """Scatter the new K/V rows into a float32 cache. qkv: [num_tokens, q_size + 2 * kv_size]."""
    num_kv, head_dim, block_size = k_cache.shape[0], k_cache.shape[2], k_cache.shape[3]
    for t in nb.prange(qkv.shape[0]):
        slot = slot_mapping[t]
        b = slot // block_size
        o = slot % block_size
        for h in range(num_kv):
            for d in range(head_dim):
                k_cache[h, b, d, o] = qkv[t, q_size + h * head_dim + d]
                v_cache[h, b, o, d] = qkv[t, q_size + kv_size + h * head_dim + d]


def _write_kv_f16(qkv, k_cache, v_cache, slot_mapping, q_size, kv_size):
    """Scatter the new K/V rows into an fp16 cache (uint16 bits, nearest, ties to even)."""
    num_kv, head_dim, block_size = k_cache.shape[0], k_cache.shape[2], k_cache.shape[3]
    for t in nb.prange(qkv.shape[0]):
        slot = slot_mapping[t]
        b = slot // block_size
        o = slot % block_size
        for h in range(num_kv):
            for d in range(head_dim):
                k_cache[h, b, d, o] = f16_bits(qkv[t, q_size + h * head_dim + d])
                v_cache[h, b, o, d] = f16_bits(qkv[t, q_size + kv_size + h * head_dim + d])


@nb.njit(cache=True, inline="always")
def _q8_block(src, start, values, scales, scale_at):
    """Quantize src[start:start+32] as a q8_0 block (scale = max|x| / 127, q = round-half-even(x / scale),
    as the weight products quantize activations): the 32 int8 to values[0..31], the scale to scales[scale_at]."""
    scale, inv = q8_scale(src, start)
    for j in range(32):
        values[j] = np.int8(min(max(np.rint(src[start + j] * inv), -127.0), 127.0))
    scales[scale_at] = scale


def _write_kv_q8(qkv, k_cache, v_cache, slot_mapping, q_size, kv_size):
    """Scatter the new K/V rows into an int8 cache: k_cache = (values [kv, blocks, hd, bs] int8,
    scales [kv, blocks, hd / 32, bs] float32), v_cache = (values [kv, blocks, bs, hd], scales [kv, blocks, bs, hd / 32])."""
    kq, ks = k_cache
    vq, vs = v_cache
    num_kv, head_dim, block_size = kq.shape[0], kq.shape[2], kq.shape[3]
    for t in nb.prange(qkv.shape[0]):
        slot = slot_mapping[t]
        b = slot // block_size
        o = slot % block_size
        row = qkv[t]
        for h in range(num_kv):
            for g in range(head_dim // 32):
                _q8_block(row, q_size + h * head_dim + 32 * g, kq[h, b, 32 * g : 32 * g + 32, o], ks[h, b, :, o], g)
                _q8_block(row, q_size + kv_size + h * head_dim + 32 * g, vq[h, b, o, 32 * g : 32 * g + 32], vs[h, b, o], g)


@nb.njit(cache=True, inline="always")
def _softmax_rows(scores, positions, t0, num_q, scale, window):
    """scores[qi, lo:keys] = exp(scores * scale - max) over keys lo..position, in key order; [num_q] 1 / sums."""
    inv = np.empty(num_q, dtype=np.float32)
    scale, cap = score_scale(scale)
    for qi in range(num_q):
        num_keys = positions[t0 + qi] + 1
        lo = first_key(num_keys, window)
        if cap > 0:
            soft_cap(scores[qi], lo, num_keys, scale, cap)
        m = np.float32(-np.inf)
        for j in range(lo, num_keys):
            if cap == 0:
                scores[qi, j] *= scale
            if scores[qi, j] > m:
                m = scores[qi, j]
        denom = np.float32(0.0)
        for j in range(lo, num_keys):
            e = np.exp(scores[qi, j] - m)
            scores[qi, j] = e
            denom += e
        inv[qi] = np.float32(1.0) / denom
    return inv


def _paged_attention(qkv, k_cache, v_cache, cu_q, positions, block_tables, num_heads, scale, window, out, threads):
    """Any block size and head_dim. out[t, h*hd:(h+1)*hd] = softmax(q·K^T * scale) V over keys lo..positions[t] of its request.

    qkv: [num_tokens, ...] (q heads first); out: [num_tokens, num_heads * head_dim].
    One work item = one request x one query head: all of the request's appended tokens
    (a verify run) share each K/V block while it is in cache. threads: unused (the vector kernel's arguments).
    """
    num_kv, head_dim, block_size = k_cache.shape[0], k_cache.shape[2], k_cache.shape[3]
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
        first_block = first_key(positions[t0] + 1, window) // block_size
        scores = np.empty((num_q, num_blocks * block_size), dtype=np.float32)  # [queries, keys]
        for i in range(first_block, num_blocks):  # scores, one K block at a time
            k_blk = k_cache[kvh, block_tables[r, i]]  # [head_dim, block_size]
            for qi in range(num_q):
                s = scores[qi, i * block_size : (i + 1) * block_size]
                for o in range(bs):
                    s[o] = np.float32(0.0)
                for d in range(hd):
                    qd = qkv[t0 + qi, h * head_dim + d]
                    for o in range(bs):
                        s[o] += qd * k_blk[d, o]
        inv = _softmax_rows(scores, positions, t0, num_q, scale, window)
        acc = np.zeros((num_q, head_dim), dtype=np.float32)
        for i in range(first_block, num_blocks):  # weighted V sum, one V block at a time, keys in order
            v_blk = v_cache[kvh, block_tables[r, i]]  # [block_size, head_dim]
            for qi in range(num_q):
                num_keys = positions[t0 + qi] + 1
                lo = first_key(num_keys, window)
                for o in range(max(0, lo - i * block_size), min(block_size, num_keys - i * block_size)):
                    p = scores[qi, i * block_size + o]
                    for d in range(hd):
                        acc[qi, d] += p * v_blk[o, d]
        for qi in range(num_q):
            for d in range(head_dim):
                out[t0 + qi, h * head_dim + d] = acc[qi, d] * inv[qi]


_WRITE_KV = _twice(_write_kv)
_WRITE_KV_F16 = _twice(_write_kv_f16)
_WRITE_KV_Q8 = _twice(_write_kv_q8)
_ATTENTION = _twice(_paged_attention)
_ATTENTION_VEC = _twice(paged_attention_vec)


def vector_shapes(head_dim: int, block_size: int) -> bool:
    """Whether the vector kernel (and an fp16 cache) serves these shapes (an int8 cache: head_dim a multiple of 32)."""
    return head_dim % 16 == 0 and block_size % 16 == 0


def write_kv(qkv, k_cache, v_cache, slot_mapping, q_size, kv_size):
    """k_cache/v_cache: float32 or fp16 arrays, or an int8 cache's (values, scales) pairs."""
    if isinstance(k_cache, tuple):
        pair = _WRITE_KV_Q8
    else:
        pair = _WRITE_KV_F16 if k_cache.dtype == np.uint16 else _WRITE_KV
    fn = pair[1] if qkv.shape[0] >= 64 else pair[0]
    fn(qkv, k_cache, v_cache, slot_mapping, q_size, kv_size)


def paged_attention(qkv, k_cache, v_cache, cu_q, positions, block_tables, num_heads, scale, out, window: int = 0,
                    softcap: float = 0.0):
    """softcap > 0: scores soft-capped as cap * tanh(score * scale / cap) before the softmax (Gemma 2)."""
    num_tokens = qkv.shape[0]
    scale = (np.float32(scale), np.float32(softcap)) if softcap else np.float32(scale)
    work = num_tokens * num_heads * (int(positions.max()) + 1) if num_tokens else 0
    values = k_cache[0] if isinstance(k_cache, tuple) else k_cache
    vector = vector_shapes(values.shape[2], values.shape[3])
    if vector and num_tokens and splits(num_tokens, cu_q, int(positions.max()) + 1, num_heads, values.shape[0]):
        decode_attention(qkv, k_cache, v_cache, cu_q, positions, block_tables, num_heads, scale, window, out,
                         nb.get_num_threads())
        return
    if vector:
        pair = _ATTENTION_VEC
    elif k_cache.dtype == np.uint16:
        raise ValueError("an fp16 KV cache needs head_dim and block_size to be multiples of 16")
    else:
        pair = _ATTENTION
    fn = pair[1] if work >= PARALLEL_MIN_WORK else pair[0]
    fn(qkv, k_cache, v_cache, cu_q, positions, block_tables, num_heads, scale, window, out, nb.get_num_threads())
