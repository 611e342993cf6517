"""The weighted sum of values in attention (attention_vec, attention_split), and the register budget the
vector attention kernels plan their tiles with.

_values sums p * v over keys, in key order, for every output element; how many dims it carries per pass
over the keys changes what each pass reads, never an element's sum. Up to QUAD_ROWS rows carry 64 dims
(a whole row of SmolLM2's head_dim: each key's V read once, contiguously), else 32 (two 16-lane chunks)
or 16. Measured on the Xeon (avx512, 2 threads), 30 layers' distinct fp16 caches at
2,000 keys, in one process, with attention_split handing each thread a contiguous run of heads x dims:
decode attention 106-129 -> 91-114 us per layer against 32 dims per pass.
"""

from __future__ import annotations

import llvmlite.binding as llvm
import numba as nb
import numpy as np

from engine.kernels.kv_prefetch import prefetch_block
from engine.kernels.simd import (
    f32_fma,
    f32_mul,
    f32_splat,
    f32_zero,
    row_f32,
    store_rows,
    tok_f32,
    wide_registers,
)

# 32 vector registers of 16 lanes (AVX-512), else 16 of 8 lanes (AVX2): how many rows a tile takes, and
# how many sums it can keep in flight.
WIDE = llvm.get_host_cpu_features().get("avx512f", False)
# Tokens of one request per work item, and the most rows a tile takes: 8 where a 16-lane vector is one
# register (8 rows of scores fit; measured 1.8 -> 1.6 ms for a verify of 8 at 300 tokens on SmolLM2's
# 30 layers), else 4.
TOKENS_PER_ITEM = 8 if WIDE else 4
# Rows that take two 16-key (or 16-dim) chunks at a time, keeping 2 x rows sums in flight (a fused add
# waits 4 cycles on the previous one): with AVX-512 up to 8 on a float cache (its span sums are the
# scores) and 4 on an int8 one (its extra sums would spill); with AVX2 up to 2. Measured on the Xeon
# (avx512, 2 threads): a verify of 4 / 8 at 300 tokens over 30 layers 1.09 -> 0.95 / 1.57 -> 1.40 ms.
PAIRED_ROWS_FLOAT, PAIRED_ROWS_INT8 = (8, 4) if WIDE else (2, 2)
# AMD Zen 4 (LLVM `znver4`) issues a 512-bit operation as two 256-bit halves, one 512-bit fused multiply-add a cycle,
# so one chunk's 4 rows of sums already cover that add's latency. There a scores loop that streams its K from memory
# (the split decode path, the one that passes `ahead`) reads one chunk at a time. Measured on a Zen 4 (2 threads),
# SmolLM2's 30 layers at 2,000 keys from cold caches, three processes each, alternated: fp16 attention 3.54-3.80 ->
# 2.85-2.98 ms, the decode step 7.31-7.94 -> 6.53-6.58 ms; int8 cache (two each) 2.63 / 2.05 -> 2.41 / 2.33 ms, step
# 6.05 / 5.54 -> 5.25 / 5.41. With the K in cache the scores loop took as long or less. Same bits: each chunk's
# sums are its own.
HALF_WIDTH_512 = WIDE and llvm.get_host_cpu_name() == "znver4"
# Rows whose values sums take four 16-dim chunks at a time (4 x rows sums, plus the weights and values
# in flight, in 32 zmm registers): AVX-512 only.
QUAD_ROWS = 4 if WIDE else 0


@nb.njit(cache=True)
def _values(v_cache, v_scale, table, kvh, k0, k1, scores, s0, out, o0, ostride, rows, d0, d1, ahead):
    """out rows = sum over keys k0..k1-1, in order, of p * v (p = scores[s0 + r * ld + key], times the
    key's scale of these dims in an int8 cache), for dims d0..d1-1 (multiples of 32 where hd is, else of
    16). Each pass over the keys carries 64, 32 or 16 dims (see
    the module docstring); each dim's sum is its own. ahead > 0: a pass over whole rows asks for the
    V block that many blocks on (kv_prefetch; the tiles pass 0)."""
    nb.literally(rows)
    hd = v_cache.shape[3]
    c = np.int64(d0)  # a run-time value: one build of each pass for the tiles' d0 = 0 and later dims (attention_vec)
    if rows <= QUAD_ROWS and hd % 32 == 0:
        while d1 - c >= 64:
            _value_sums(v_cache, v_scale, table, kvh, k0, k1, scores, s0, out, o0, ostride, rows, c, 64, ahead)
            c += 64
    if hd % 32 == 0 and rows <= PAIRED_ROWS_FLOAT:
        while c < d1:
            _value_sums(v_cache, v_scale, table, kvh, k0, k1, scores, s0, out, o0, ostride, rows, c, 32, ahead)
            c += 32
    while c < d1:
        _value_sums(v_cache, v_scale, table, kvh, k0, k1, scores, s0, out, o0, ostride, rows, c, 16, ahead)
        c += 16


@nb.njit(cache=True)
def _value_sums(v_cache, v_scale, table, kvh, k0, k1, scores, s0, out, o0, ostride, rows, c, width, ahead):
    """_values for dims c..c+width-1 in one pass over the keys (rows and width literal: 16, 32 or 64; in an
    int8 cache each 32 dims have their own scale, so a 64-dim pass weighs each half by its own)."""
    wide_registers()
    nb.literally(rows)
    nb.literally(width)
    num_blocks, bs, hd = v_cache.shape[1], v_cache.shape[2], v_cache.shape[3]
    ld = scores.shape[1]
    a0 = f32_zero(rows)
    a1 = f32_zero(rows)
    a2 = f32_zero(rows)
    a3 = f32_zero(rows)
    last = (k1 + bs - 1) // bs - 1
    for i in range(k0 // bs, last + 1):
        if width == 64 and ahead and i + ahead <= last:  # whole rows: the block's lines are one run
            prefetch_block(v_cache, v_scale, (kvh * num_blocks + table[i + ahead]) * bs * hd)
        base = (kvh * num_blocks + table[i]) * bs * hd + c
        for j in range(max(k0, i * bs), min(k1, (i + 1) * bs)):
            v = base + (j - i * bs) * hd
            p = tok_f32(scores, s0 + j, ld, rows)
            q = p
            if v_scale is not None:  # [kv, blocks, bs, hd / 32]: one scale per 32 dims
                q = f32_mul(p, f32_splat(v_scale[v // 32 + 1], rows)) if width == 64 else p
                p = f32_mul(p, f32_splat(v_scale[v // 32], rows))
            a0 = f32_fma(p, row_f32(v_cache, v), a0)
            if width >= 32:
                a1 = f32_fma(p, row_f32(v_cache, v + 16), a1)
            if width == 64:
                a2 = f32_fma(q, row_f32(v_cache, v + 32), a2)
                a3 = f32_fma(q, row_f32(v_cache, v + 48), a3)
    store_rows(out, o0 + c, ostride, a0, 16)
    if width >= 32:
        store_rows(out, o0 + c + 16, ostride, a1, 16)
    if width == 64:
        store_rows(out, o0 + c + 32, ostride, a2, 16)
        store_rows(out, o0 + c + 48, ostride, a3, 16)
