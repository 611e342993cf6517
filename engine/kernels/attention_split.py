"""Decode attention over long contexts: each KV head's keys and values read once, split evenly.

In a decode batch (one query token per request) every query head of a KV group sees the same keys.
attention_vec's items split a group's heads in two (so that two threads share three KV heads evenly),
so each half converts and reads the group's K and V again. Here a step runs in three phases, each
split evenly over the threads:
  scores   per request, KV head and half of its keys: the group's heads as one tile of `rows` rows
           (the group padded to 1, 2, 4 or 8; the padding rows are computed and never used)
  softmax  per query head (the padding rows set to zero)
  values   one contiguous run of (request, KV head, 32 dims) units per thread, so that each thread reads
           whole V rows of whole heads where it can (three KV heads on two threads: one and a half
           each); the group's heads as one tile
Per query each phase runs attention_vec's own functions over the same keys in the same order, so a
query gets the bits attention_vec gives it; only who computes which part differs.

The scores loop asks for the K lines a little ahead, and a values pass over whole rows for V
(kv_prefetch; not on a Zen 4, where the hardware prefetcher alone ran faster: kv_prefetch.ASKS_AHEAD).
Measured on the Xeon (avx512, 2 threads), 30 layers' distinct caches at 2,000 keys, in
one process against values by halves of head_dim and no prefetch: fp16 110-120 -> 84-94 us per layer,
int8 80-87 -> 74-79; the model's decode step at 2,000 cached tokens (fp16, after the K prefetch and the
runs) 7.9-10.7 -> 7.2-7.7 ms while the step at 300 stayed 4.5-4.6 ms. See also SPLIT_MIN_KEYS.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from engine.kernels.attention_values import WIDE, _values
from engine.kernels.attention_vec import _scores, _softmax, cache_parts, first_key
from engine.kernels.kv_prefetch import ASKS_AHEAD, KEY_CHUNKS_AHEAD, VALUE_BLOCKS_AHEAD
from engine.kernels.simd import f32_mul, f32_splat, load_rows, store_rows

# Requests x keys (of the longest request) from which a decode batch takes this path: three phases cost two
# more wake-ups of the threads than one. Measured on the Xeon (avx512, 2 threads), SmolLM2's 30 layers,
# tiles -> split. One request, fp16 cache: 0.46 -> 0.56 ms at 300 keys, 0.69 -> 0.75 at 512, 1.19 -> 1.13 at
# 1,000, 2.38 -> 2.04 at 2,000 (46 MB of K/V in 2.04 ms: 22.5 GB/s; a plain vector read runs at ~32); int8
# cache 1.94 -> 1.83 ms at 2,000. Several requests: the tiles split a KV group's heads in two items of 2 and
# 1 rows per request, while this path's tiles of the whole group share each K/V load; forward of the decode
# batch against a second copy of the tiles' build: 2 requests at 512 keys 7.04 -> 6.54 ms, 3 at 400 8.27 ->
# 7.71, 4 at 256 8.13 -> 7.60, 8 at 300 12.13 -> 11.06, 16 at 300 21.23 -> 18.82, 8 at 600 17.88 -> 15.19
# (distinct contexts; 8 requests sharing a 288-token prefix: 7.83 -> 7.57 at 300); 2 at 300 (600, left on
# the tiles) 6.28 against 6.03 split, within noise. Where the loops do not ask for lines ahead (the Zen 4,
# kv_prefetch.ASKS_AHEAD) this path pays from fewer keys: measured there (2 threads), 30 layers, one request, fp16,
# two runs, tiles -> split, from cold caches: 0.62 / 0.71 -> 0.65 / 0.74 ms at 300 keys, 0.99 / 0.95 -> 0.98 / 0.91
# at 600, 1.19 / 1.55 -> 0.99 / 1.30 at 700, 1.27 / 1.61 -> 1.08 / 1.30 at 800, 1.33 / 1.38 -> 1.16 / 1.25 at 900,
# 1.58 / 1.43 -> 1.29 / 1.23 at 1,000 (with the K/V in cache 0.77 / 1.06 -> 0.69 / 0.80 at 700).
SPLIT_MIN_KEYS = 1024 if ASKS_AHEAD else 700
# An 8-row tile's scores and values loops keep 16 sums of 8 lanes, more than AVX2's 16 registers hold beside
# their operands: LLVM spills (72 instructions, 24 of them register moves, for a loop of 16 FMAs). Without
# AVX-512 the group runs as two 4-row passes over the same keys (each row's sums in the same order, so the
# same bits). Zen 3, 2 KV heads x 64 dims, 2,000 keys, fp16: group 8 took 2.72-2.94x group 4's time before.
HALVED_ROWS = not WIDE


@nb.njit(cache=True, inline="always")
def _tile_rows(group):
    """Rows of the tile that holds a KV group's query heads: the group padded to 1, 2, 4 or 8."""
    return 1 if group == 1 else 2 if group == 2 else 4 if group <= 4 else 8


@nb.njit(cache=True)
def splits(num_tokens, cu_q, num_keys, num_heads, num_kv):
    """Whether a batch takes this path: a decode batch (one token per request) whose requests x the keys of
    its longest request reach SPLIT_MIN_KEYS, with up to 8 query heads per KV head, and the group's padding
    rows (read as queries, never used) inside a qkv row ((heads + 2 kv) * head_dim)."""
    group = num_heads // num_kv
    return (num_tokens == cu_q.shape[0] - 1 and num_tokens * num_keys >= SPLIT_MIN_KEYS and group <= 8
            and _tile_rows(group) - group <= 2 * num_kv)


@nb.njit(cache=True)
def never(num_tokens, cu_q, num_keys, num_heads, num_kv):
    """`splits` for a layer whose attention is not the vector kernel's."""
    return False


@nb.njit(cache=True, inline="always")
def _group_scores(qkv, k_cache, k_scale, table, q0, hd, kvh, lo, num_keys, rows, scores):
    """_scores with `rows` as a literal (1, 2, 4 or 8), asking for the K lines ahead. Without AVX-512 a group
    of 8 runs as two passes of 4 rows (see HALVED_ROWS)."""
    if rows == 8 and HALVED_ROWS:
        for half in range(2):
            _scores(qkv, k_cache, k_scale, table, q0 + 4 * half * hd, hd, kvh, lo, num_keys, 4,
                    scores[4 * half : 4 * half + 4], np.int64(KEY_CHUNKS_AHEAD))
    elif rows == 1:
        _scores(qkv, k_cache, k_scale, table, q0, hd, kvh, lo, num_keys, 1, scores, np.int64(KEY_CHUNKS_AHEAD))
    elif rows == 2:
        _scores(qkv, k_cache, k_scale, table, q0, hd, kvh, lo, num_keys, 2, scores, np.int64(KEY_CHUNKS_AHEAD))
    elif rows == 4:
        _scores(qkv, k_cache, k_scale, table, q0, hd, kvh, lo, num_keys, 4, scores, np.int64(KEY_CHUNKS_AHEAD))
    else:
        _scores(qkv, k_cache, k_scale, table, q0, hd, kvh, lo, num_keys, 8, scores, np.int64(KEY_CHUNKS_AHEAD))


@nb.njit(cache=True, inline="always")
def _group_values(v_cache, v_scale, table, kvh, lo, num_keys, scores, s0, vals, v0, hd, rows, d0, d1):
    """_values with `rows` as a literal (1, 2, 4 or 8), asking for the V blocks ahead (8 rows: as _group_scores)."""
    if rows == 8 and HALVED_ROWS:
        ld = scores.shape[1]
        for half in range(2):
            _values(v_cache, v_scale, table, kvh, lo, num_keys, scores, s0 + 4 * half * ld, vals, v0 + 4 * half * hd,
                    hd, 4, d0, d1, np.int64(VALUE_BLOCKS_AHEAD))
    elif rows == 1:
        _values(v_cache, v_scale, table, kvh, lo, num_keys, scores, s0, vals, v0, hd, 1, d0, d1,
                np.int64(VALUE_BLOCKS_AHEAD))
    elif rows == 2:
        _values(v_cache, v_scale, table, kvh, lo, num_keys, scores, s0, vals, v0, hd, 2, d0, d1,
                np.int64(VALUE_BLOCKS_AHEAD))
    elif rows == 4:
        _values(v_cache, v_scale, table, kvh, lo, num_keys, scores, s0, vals, v0, hd, 4, d0, d1,
                np.int64(VALUE_BLOCKS_AHEAD))
    else:
        _values(v_cache, v_scale, table, kvh, lo, num_keys, scores, s0, vals, v0, hd, 8, d0, d1,
                np.int64(VALUE_BLOCKS_AHEAD))


@nb.njit(cache=True, inline="always")
def _run(t, threads, units):
    """Thread t's contiguous run [u0, u1) of `units` values units, cut evenly into `threads` runs."""
    return t * units // threads, (t + 1) * units // threads


@nb.njit(parallel=True, cache=True)
def decode_attention(qkv, k_entry, v_entry, cu_q, positions, block_tables, num_heads, scale, window, out, threads):
    """attention_vec.paged_attention_vec's result for a decode batch (cu_q[r + 1] - cu_q[r] == 1 for every
    r), for groups of up to 8 query heads per KV head. qkv [R, (heads + 2 kv) * hd], out [R, heads * hd];
    threads: numba.get_num_threads() of the caller (the values phase hands each one a run)."""
    k_cache, k_scale = cache_parts(k_entry)
    v_cache, v_scale = cache_parts(v_entry)
    num_kv, hd = k_cache.shape[0], k_cache.shape[2]
    group = num_heads // num_kv
    rows = _tile_rows(group)
    qs, os_ = qkv.shape[1], out.shape[1]
    num_reqs = cu_q.shape[0] - 1
    width = (positions[:num_reqs].max() + 16) // 16 * 16
    scores = np.empty((num_reqs * num_kv * rows, width), np.float32)  # [request, kv head, tile row] x keys
    vals = np.empty((num_reqs * num_kv * rows, hd), np.float32)  # the same rows x head_dim, before 1 / sum
    inv = np.empty(num_reqs * num_kv * rows, np.float32)
    for item in nb.prange(num_reqs * num_kv * 2):  # scores: half of a group's key chunks
        r, kvh, half = item // (2 * num_kv), item // 2 % num_kv, item % 2
        num_keys = positions[cu_q[r]] + 1
        c0, chunks = first_key(num_keys, window) // 16, (num_keys + 15) // 16
        mid = (c0 + chunks) // 2
        a, b = (c0, mid) if half == 0 else (mid, chunks)
        row0 = (r * num_kv + kvh) * rows
        if a < b:
            _group_scores(qkv, k_cache, k_scale, block_tables[r], cu_q[r] * qs + kvh * group * hd, hd, kvh,
                          16 * a, min(num_keys, 16 * b), rows, scores[row0 : row0 + rows])
    for item in nb.prange(num_reqs * num_kv * rows):  # softmax per query head; padding rows to zero
        r, j = item // (num_kv * rows), item % rows
        num_keys = positions[cu_q[r]] + 1
        lo = first_key(num_keys, window)
        if j < group:
            inv[item] = _softmax(scores, item, lo, num_keys, scale)
        else:
            scores[item, lo - lo % 16 : (num_keys + 15) // 16 * 16] = 0.0
    step = 32 if hd % 32 == 0 else 16  # dims per values unit
    per_group = hd // step
    for t in nb.prange(threads):  # values: a contiguous run of (request, KV head, dims) units per thread
        u, end = _run(t, threads, num_reqs * num_kv * per_group)
        while u < end:
            g = u // per_group  # request x KV head
            r, kvh = g // num_kv, g % num_kv
            d0, d1 = (u - g * per_group) * step, (min(end, (g + 1) * per_group) - g * per_group) * step
            num_keys = positions[cu_q[r]] + 1
            row0 = (r * num_kv + kvh) * rows
            _group_values(v_cache, v_scale, block_tables[r], kvh, first_key(num_keys, window), num_keys, scores,
                          row0 * width, vals, row0 * hd, hd, rows, d0, d1)
            for j in range(group):
                o = cu_q[r] * os_ + (kvh * group + j) * hd
                for c in range(d0, d1, 16):
                    store_rows(out, o + c, 0, f32_mul(load_rows(vals, (row0 + j) * hd + c, 0, 1),
                                                      f32_splat(inv[row0 + j], 1)), 16)
            u = (g + 1) * per_group
