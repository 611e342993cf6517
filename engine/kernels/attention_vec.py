"""Append attention with vector kernels, for head_dim and block_size multiples of 16.

K/V in float32, fp16 (uint16 bits, converted exactly on load) or int8 (llama.cpp's q8_0 blocks: 32
dims of one key and head share a scale, kept in float32 beside the values; head_dim a multiple
of 32). Work: a chunk of up to TOKENS_PER_ITEM (4, or 8 with AVX-512)
consecutive tokens of one request x one KV head x one half of its group's query heads (so two
threads share an odd number of KV heads evenly: decode attention at 2,000 tokens 117 -> 92 us
per layer on SmolLM2's 3 KV heads; decode batches from 1,024 keys: attention_split), or, for a
lone chunk of BY_TOKENS_MIN or more tokens (a verify) on an odd group, x one half of its tokens, so that
two threads also share a group's odd number of heads evenly. The items go to the
threads as prange's equal ranges of the items in zigzag order, or, where one of those would hold over
1.1x an even share of query rows x keys, as runs balanced by that cost (`_runs`). A tile is up to
TOKENS_PER_ITEM query rows sharing every K and V load: the heads of the KV group for a single token,
the item's heads x tokens as one run of tiles where they fit one tile (a verify of 4 on 2 heads) or
the item holds half of the tokens, or else one
head of the chunk's tokens. Row r attends to keys lo_r .. n_r - 1, n_r = keys0 + (r % period) * inc
(inc = 0 for heads; 1 for tokens, period = the chunk's tokens), where lo_r = 0, or, on a
sliding-window layer of `window` keys, max(0, n_r - window).

Per query, in a fixed order whatever the tile: each score is a sequential float32 sum of fused
multiply-adds over head_dim (int8: over each 32 dims, then fused into the score times their scale); softmax takes exp(score * scale - max) (simd.f32_exp) and sums them
in 16-lane partial sums over its keys (16-key chunks aligned to key 0, so they depend on the
query's own lo only), folded by a fixed tree; each output element is a sequential fused sum over
keys in order (int8: each weight times the key's scale of those dims first), times 1 / sum.
In a tile, a row gets exact zero weights for the keys it does not see (before its lo, after its last key:
adding +-0 changes no sum), so every row's sums run over the tile's whole key range in one pass. So a
query's output depends only on its q and its request's keys: not on the batch, the tile, or how
its prompt was chunked.

Builds: Numba types a constant argument of a call between jitted functions as a literal, and builds the
callee once per literal value. `rows` and the values pass's `width` are literals by design (they fix the
registers), and so are the tiles' zero offsets and prefetch distance (literal zeros keep a tile of 8's
loops as tight as they were: as run-time values they cost it 3-13%). The rest goes as np.int64: the
tiles' token arithmetic (inc, phase, period) and the values passes' first dim. That is 45
builds of _scores, _values, _value_sums, _tile and _tiles where there were 62 (49 while a tile still summed its
later rows' extra keys in passes of their own).
"""

from __future__ import annotations

import numba as nb
import numpy as np
from numba import types
from numba.extending import overload

from engine.kernels.attention_items import BY_TOKENS_MIN, _equal_ranges_top, _least_top, _part, _runs, _zigzag
from engine.kernels.attention_values import (
    HALF_WIDTH_512,
    PAIRED_ROWS_FLOAT,
    PAIRED_ROWS_INT8,
    TOKENS_PER_ITEM,
    _values,
)
from engine.kernels.kv_prefetch import chunk_cursor, line_rows, next_chunk, prefetch_key_chunk
from engine.kernels.simd import (
    f32_add,
    f32_exp,
    f32_fma,
    f32_hmax,
    f32_hsum,
    f32_keep,
    f32_keep_from,
    f32_max,
    f32_mul,
    f32_splat,
    f32_sub,
    f32_zero,
    load_rows,
    row_f32,
    store_rows,
    tok_f32,
    wide_registers,
)


def cache_parts(entry):
    """A cache entry as (values, flat scales): an int8 cache's (values, scales) pair, or (array, None)."""
    if isinstance(entry, tuple):
        return entry[0], entry[1].reshape(-1)
    return entry, None


@overload(cache_parts, inline="always")
def _cache_parts(entry):
    if isinstance(entry, types.BaseTuple):
        return lambda entry: (entry[0], entry[1].reshape(-1))
    return lambda entry: (entry, None)


def score_scale(scale):
    """A kernel's `scale` as (scale, soft cap): a float32 alone, or a (scale, cap) pair for a model that soft-caps
    its attention logits (Gemma 2: s -> cap * tanh(s * scale / cap) before the softmax); cap 0 = none."""
    if isinstance(scale, tuple):
        return scale[0], scale[1]
    return scale, np.float32(0.0)


@overload(score_scale, inline="always")
def _score_scale(scale):
    if isinstance(scale, types.BaseTuple):
        return lambda scale: (scale[0], scale[1])
    return lambda scale: (scale, np.float32(0.0))


@nb.njit(cache=True, inline="always")
def soft_cap(row, lo, hi, scale, cap):
    """row[lo:hi] = cap * tanh(row * scale / cap) in place, key by key (the same bits in every kernel)."""
    k = scale / cap
    for j in range(lo, hi):
        row[j] = cap * np.tanh(row[j] * k)


@nb.njit(cache=True, inline="always")
def _scaled(part, acc, k_scale, sidx):
    """The score sum after one span of dims: the span's sum alone (float cache, one span of head_dim),
    or acc + part * the keys' scales (int8 cache, spans of 32 dims)."""
    if k_scale is None:
        return part
    return f32_fma(part, row_f32(k_scale, sidx), acc)


@nb.njit(cache=True)
def _scores(qkv, k_cache, k_scale, table, q0, qstride, kvh, lo, num_keys, rows, scores, ahead):
    """scores[r, key] = q_r . k_key (rows literal; q_r at flat q0 + r * qstride) for the 16-key chunks
    from lo's to num_keys, two chunks at a time where registers allow and the CPU gains by it (HALF_WIDTH_512;
    each chunk's sums are its own);
    ahead > 0: also ask for the K lines of the chunks that far on (kv_prefetch; the tiles pass 0)."""
    wide_registers()
    nb.literally(rows)
    num_blocks, hd, bs = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    span = hd if k_scale is None else 32  # dims per scale
    ld = scores.shape[1]
    chunks = (num_keys + 15) // 16
    c0 = lo // 16
    paired = rows <= (PAIRED_ROWS_FLOAT if k_scale is None else PAIRED_ROWS_INT8) and not (ahead and HALF_WIDTH_512)
    step = line_rows(k_cache)
    i, o = chunk_cursor(c0, bs)  # the next chunk read
    pi, po = chunk_cursor(c0 + ahead, bs)  # the next chunk asked for
    for c in range(c0, chunks - 1 if paired else c0, 2):
        if ahead:
            prefetch_key_chunk(k_cache, k_scale, table, kvh, c + ahead, chunks, pi, po, step)
            pi, po = next_chunk(pi, po, bs)
            prefetch_key_chunk(k_cache, k_scale, table, kvh, c + ahead + 1, chunks, pi, po, step)
            pi, po = next_chunk(pi, po, bs)
        ba, oa = kvh * num_blocks + table[i], o
        i, o = next_chunk(i, o, bs)
        bb, ob = kvh * num_blocks + table[i], o
        i, o = next_chunk(i, o, bs)
        a, b = ba * hd * bs + oa, bb * hd * bs + ob
        sa = f32_zero(rows)
        sb = f32_zero(rows)
        for d0 in range(0, hd, span):
            pa = f32_zero(rows)
            pb = f32_zero(rows)
            for d in range(d0, d0 + span):
                q = tok_f32(qkv, q0 + d, qstride, rows)
                pa = f32_fma(q, row_f32(k_cache, a + d * bs), pa)
                pb = f32_fma(q, row_f32(k_cache, b + d * bs), pb)
            sa = _scaled(pa, sa, k_scale, _scale_index(ba, oa, d0, hd, bs))
            sb = _scaled(pb, sb, k_scale, _scale_index(bb, ob, d0, hd, bs))
        store_rows(scores, 16 * c, ld, sa, 16)
        store_rows(scores, 16 * c + 16, ld, sb, 16)
    for c in range(chunks - (chunks - c0) % 2 if paired else c0, chunks):  # (i, o): chunk c's cursor
        if ahead:
            prefetch_key_chunk(k_cache, k_scale, table, kvh, c + ahead, chunks, pi, po, step)
            pi, po = next_chunk(pi, po, bs)
        ba, oa = kvh * num_blocks + table[i], o
        i, o = next_chunk(i, o, bs)
        a = ba * hd * bs + oa
        sa = f32_zero(rows)
        for d0 in range(0, hd, span):
            pa = f32_zero(rows)
            for d in range(d0, d0 + span):
                pa = f32_fma(tok_f32(qkv, q0 + d, qstride, rows), row_f32(k_cache, a + d * bs), pa)
            sa = _scaled(pa, sa, k_scale, _scale_index(ba, oa, d0, hd, bs))
        store_rows(scores, 16 * c, ld, sa, 16)


@nb.njit(cache=True, inline="always")
def _scale_index(block, o, d0, hd, bs):
    """Flat index in k_scale [kv, blocks, hd / 32, bs] of dims d0..d0+31 of the keys from offset o of
    cache block `block` (kvh * num_blocks + its table entry)."""
    return block * (hd // 32 * bs) + d0 // 32 * bs + o


@nb.njit(cache=True)
def _softmax(scores, r, lo, num_keys, scale):
    """scores[r, lo:num_keys] = exp(s * scale - max) in place (zero before lo in its 16-key chunk);
    returns 1 / their sum. A (scale, cap) pair soft-caps the scores first (score_scale)."""
    wide_registers()
    scale, cap = score_scale(scale)
    if cap > 0:
        soft_cap(scores[r], lo, num_keys, scale, cap)
        scale = np.float32(1.0)
    tops = f32_splat(np.float32(-np.inf), 1)  # lane maxima, folded once
    for c in range(lo - lo % 16, num_keys, 16):
        s = f32_keep(f32_mul(row_f32(scores[r], c), f32_splat(scale, 1)), num_keys - c, -np.inf)
        tops = f32_max(tops, f32_keep_from(s, lo - c, -np.inf))
    top = f32_hmax(tops)
    total = f32_zero(1)
    for c in range(lo - lo % 16, num_keys, 16):
        s = f32_sub(f32_mul(row_f32(scores[r], c), f32_splat(scale, 1)), f32_splat(top, 1))
        e = f32_keep_from(f32_keep(f32_exp(s), num_keys - c, 0.0), lo - c, 0.0)
        store_rows(scores[r], c, 0, e, 16)
        total = f32_add(total, e)
    return np.float32(1.0) / f32_hsum(total)


@nb.njit(cache=True, inline="always")
def first_key(num_keys, window):
    """The first key a query that sees keys 0..num_keys-1 attends to (window 0: no window)."""
    return max(0, num_keys - window) if window > 0 else 0


@nb.njit(cache=True, inline="always")
def _row_keys(keys0, inc, phase, period, r):
    """Keys of tile row r: keys0 + ((phase + r) % period) * inc (row r is token (phase + r) % period of a run);
    inc = 0 (a decode's heads) skips the division."""
    return keys0 + (phase + r) % period * inc if inc else keys0


@nb.njit(cache=True)
def _tile(qkv, k_cache, v_cache, k_scale, v_scale, table, q0, qstride, o0, ostride, kvh, keys0, inc, phase, period,
          window, scale, out, scores, inv, rows):
    """One tile of `rows` (literal) query rows; row r sees keys first_key(n_r, window) .. n_r - 1, n_r = _row_keys(r)."""
    nb.literally(rows)
    hd = k_cache.shape[2]
    k_min = k_max = _row_keys(keys0, inc, phase, period, 0)
    for r in range(1, rows):
        k_min = min(k_min, _row_keys(keys0, inc, phase, period, r))
        k_max = max(k_max, _row_keys(keys0, inc, phase, period, r))
    lo0 = first_key(k_min, window)
    _scores(qkv, k_cache, k_scale, table, q0, qstride, kvh, lo0, k_max, rows, scores, 0)
    for r in range(rows):
        n = _row_keys(keys0, inc, phase, period, r)
        lo = first_key(n, window)
        inv[r] = _softmax(scores, r, lo, n, scale)  # zero in n's 16-key chunk past n
        for j in range(lo0, lo - lo % 16):  # keys the tile's first row sees and this row does not
            scores[r, j] = np.float32(0.0)
        for j in range((n + 15) // 16 * 16, k_max):  # keys a later row sees and this row does not
            scores[r, j] = np.float32(0.0)
    # every row over keys lo0 .. k_max - 1 in one pass, the keys a row does not see at exact zero weight, instead of
    # a pass to k_min and each later row's extra keys alone. Same bits; a tile of 8 rows alone 0.91x at 300 keys and
    # 0.74x at 40; 30 layers' attention (fp16 K/V) at 300 keys, a verify of 8 / 4 0.96x / 0.94x (Xeon, journal)
    _values(v_cache, v_scale, table, kvh, lo0, k_max, scores, 0, out, o0, ostride, rows, 0, hd, 0)
    for r in range(rows):
        for c in range(0, hd, 16):
            store_rows(out, o0 + r * ostride + c, 0, f32_mul(load_rows(out, o0 + r * ostride + c, 0, 1), f32_splat(inv[r], 1)), 16)


@nb.njit(cache=True)
def _tiles(qkv, k_cache, v_cache, k_scale, v_scale, table, q0, qstride, o0, ostride, kvh, keys0, inc, period, window,
           count, scale, out, scores, inv):
    """`count` rows in tiles of 8 (see TOKENS_PER_ITEM), 4, 2, 1; row r sees _row_keys(keys0, inc, 0, period, r)."""
    r = np.int64(0)  # a run-time value (module docstring: builds)
    while TOKENS_PER_ITEM == 8 and count - r >= 8:
        _tile(qkv, k_cache, v_cache, k_scale, v_scale, table, q0 + r * qstride, qstride, o0 + r * ostride, ostride, kvh,
              keys0, inc, r, period, window, scale, out, scores, inv, 8)
        r += 8
    while count - r >= 4:
        _tile(qkv, k_cache, v_cache, k_scale, v_scale, table, q0 + r * qstride, qstride, o0 + r * ostride, ostride, kvh,
              keys0, inc, r, period, window, scale, out, scores, inv, 4)
        r += 4
    if count - r >= 2:
        _tile(qkv, k_cache, v_cache, k_scale, v_scale, table, q0 + r * qstride, qstride, o0 + r * ostride, ostride, kvh,
              keys0, inc, r, period, window, scale, out, scores, inv, 2)
        r += 2
    if count - r == 1:
        _tile(qkv, k_cache, v_cache, k_scale, v_scale, table, q0 + r * qstride, qstride, o0 + r * ostride, ostride, kvh,
              keys0, inc, r, period, window, scale, out, scores, inv, 1)


@nb.njit(cache=True)
def _heads_by_tokens(qkv, k_cache, v_cache, k_scale, v_scale, table, t0, h0, num_heads, num_tokens, kvh, keys0, window,
                     scale, out, scores, inv):
    """Heads h0.. (num_heads of them) x tokens t0.. (num_tokens) as tiles of one run of rows, row i * num_tokens + t
    for head h0 + i and token t0 + t (copied in and out, so that the rows are one stride apart): a verify of 4
    on two heads fills a tile of 8 rows instead of two of 4."""
    hd, rows = k_cache.shape[2], num_heads * num_tokens
    q_rows = np.empty((rows, hd), np.float32)  # [head x token, head_dim]
    o_rows = np.empty((rows, hd), np.float32)
    for i in range(num_heads):
        for t in range(num_tokens):
            q_rows[i * num_tokens + t] = qkv[t0 + t, (h0 + i) * hd : (h0 + i + 1) * hd]
    zero, one = np.int64(0), np.int64(1)  # run-time values (module docstring: builds)
    _tiles(q_rows, k_cache, v_cache, k_scale, v_scale, table, zero, hd, zero, hd, kvh, keys0, one, num_tokens, window, rows,
           scale, o_rows, scores, inv)
    for i in range(num_heads):
        for t in range(num_tokens):
            out[t0 + t, (h0 + i) * hd : (h0 + i + 1) * hd] = o_rows[i * num_tokens + t]


def paged_attention_vec(qkv, k_entry, v_entry, cu_q, positions, block_tables, num_heads, scale, window, out, threads):
    """qkv [T, (heads + 2 kv) * hd], out [T, heads * hd]; window: keys a query sees (0: all); K/V entries: a
    float32 or fp16 array, or an int8 cache's (values, scales) pair (see cache_parts); threads: the caller's
    numba.get_num_threads() (called in here, it would keep Numba from caching this kernel and every layer that
    calls it: a dynamic global). See the module docstring."""
    k_cache, k_scale = cache_parts(k_entry)
    v_cache, v_scale = cache_parts(v_entry)
    num_kv = k_cache.shape[0]
    group = num_heads // num_kv
    num_reqs = cu_q.shape[0] - 1
    firsts = np.empty(qkv.shape[0], np.int32)  # first token of each chunk
    owners = np.empty(qkv.shape[0], np.int32)  # its request
    num_chunks = 0
    for r in range(num_reqs):
        for t in range(cu_q[r], cu_q[r + 1], TOKENS_PER_ITEM):
            firsts[num_chunks], owners[num_chunks] = t, r
            num_chunks += 1
    # each KV head's query rows in two items, so 2 threads share 3 KV heads evenly: halves of the group's heads, or,
    # for one chunk of BY_TOKENS_MIN or more tokens on an odd group, halves of its tokens (every head of the group)
    by_tokens = num_chunks == 1 and group % 2 == 1 and cu_q[owners[0] + 1] - firsts[0] >= BY_TOKENS_MIN
    num_items = num_chunks * num_kv * 2
    costs = np.empty(num_items, np.int64)  # query rows x keys, items in zigzag order (see _zigzag)
    for item in range(num_items):
        chunk, part = _zigzag(item // (2 * num_kv), num_chunks), item % 2
        num_tokens = min(TOKENS_PER_ITEM, cu_q[owners[chunk] + 1] - firsts[chunk])
        h0, h1, t0, t1 = _part(part, group, num_tokens, by_tokens)
        keys = positions[firsts[chunk]] + num_tokens
        costs[item] = (h1 - h0) * (t1 - t0) * (min(keys, window + num_tokens) if window > 0 else keys)
    if num_chunks == 1 or _equal_ranges_top(costs, threads) * 10 <= _least_top(costs, threads) * 11:
        for item in nb.prange(num_items):  # prange's equal ranges of the zigzag order suffice
            chunk, kvh, part = _zigzag(item // (2 * num_kv), num_chunks), item // 2 % num_kv, item % 2
            _item(qkv, k_cache, v_cache, k_scale, v_scale, block_tables, firsts[chunk], owners[chunk], cu_q, positions,
                  kvh, part, by_tokens, group, window, scale, out)
        return
    order, starts = _runs(costs, threads)
    for t in nb.prange(threads):
        for i in range(starts[t], starts[t + 1]):
            item = order[i]
            chunk, kvh, part = _zigzag(item // (2 * num_kv), num_chunks), item // 2 % num_kv, item % 2
            _item(qkv, k_cache, v_cache, k_scale, v_scale, block_tables, firsts[chunk], owners[chunk], cu_q, positions,
                  kvh, part, by_tokens, group, window, scale, out)


@nb.njit(cache=True, inline="always")
def _item(qkv, k_cache, v_cache, k_scale, v_scale, block_tables, t0, r, cu_q, positions, kvh, part, by_tokens, group,
          window, scale, out):
    """Half `part` of KV head kvh's group x the chunk of tokens from t0 of request r (see _part)."""
    hd, bs = k_cache.shape[2], k_cache.shape[3]
    qs, os_ = qkv.shape[1], out.shape[1]
    chunk_tokens = min(TOKENS_PER_ITEM, cu_q[r + 1] - t0)
    first, last, ta, tb = _part(part, group, chunk_tokens, by_tokens)
    if first >= last or ta >= tb:
        return
    keys = (positions[t0] + chunk_tokens + bs - 1) // bs * bs  # the chunk's keys, whole blocks
    scores = np.empty((TOKENS_PER_ITEM, keys), np.float32)  # [tile rows, keys]
    inv = np.empty(TOKENS_PER_ITEM, np.float32)
    table = block_tables[r]
    h0, t0, num_tokens = kvh * group + first, t0 + ta, tb - ta
    keys0 = positions[t0] + 1
    if num_tokens == 1:  # the group's heads share the loads
        _tiles(qkv, k_cache, v_cache, k_scale, v_scale, table, t0 * qs + h0 * hd, hd, t0 * os_ + h0 * hd, hd,
               kvh, keys0, np.int64(0), np.int64(1), window, last - first, scale, out, scores, inv)
    elif by_tokens or (last - first) * num_tokens <= TOKENS_PER_ITEM:  # the item's heads x tokens share them
        _heads_by_tokens(qkv, k_cache, v_cache, k_scale, v_scale, table, t0, h0, last - first, num_tokens, kvh,
                         keys0, window, scale, out, scores, inv)
    else:  # per head, the chunk's tokens share the loads
        for h in range(h0, kvh * group + last):
            _tiles(qkv, k_cache, v_cache, k_scale, v_scale, table, t0 * qs + h * hd, qs, t0 * os_ + h * hd, os_,
                   kvh, keys0, np.int64(1), num_tokens, window, num_tokens, scale, out, scores, inv)
