"""Software prefetch of the paged K/V cache, a little ahead of the attention loops (attention_vec).

A decode step at 2,000 cached tokens reads ~1.5 MB of fp16 K/V per layer, and the layers' caches
together (46 MB for SmolLM2) outgrow what this VM keeps in cache, so every step streams them from
memory. The hardware prefetcher alone left the loads waiting: measured on the Xeon (avx512, 2 threads),
30 layers' distinct caches at 2,000 keys, in one process, the scores phase of the split decode
attention took 59-63 us per layer, and 48-54 us when each pair of 16-key chunks asks for the pair two
chunks on (a plain read of the same K: 44-51 us). Only attention_split asks: in the tiles (prefill,
verify) it measured a few percent slower. The values phase asks for V two blocks ahead where a pass
reads whole rows (attention_values): decode attention 90-101 -> 82-94 us per layer (one block ahead
about as good, four worse). Prefetches change no arithmetic, so no bits.

Not on every CPU: on an AMD Zen 4 the same asks made the split decode slower than the hardware prefetcher
alone (ASKS_AHEAD).

Layouts (attention_vec): K [kv, blocks, hd, bs], its int8 scales [kv, blocks, hd / 32, bs];
V [kv, blocks, bs, hd], its int8 scales [kv, blocks, bs, hd / 32].
"""

from __future__ import annotations

import llvmlite.binding as llvm
import numba as nb

from engine.kernels.simd import item_bytes, prefetch

LINE = 64  # bytes per cache line
KEY_CHUNKS_AHEAD = 2  # the scores loop asks for the 16-key chunks this far past the ones it reads
VALUE_BLOCKS_AHEAD = 2  # a values pass over whole V rows asks for the block this far past the one it reads
# Whether the loops that stream K/V from memory ask for lines at all. Not on an AMD Zen 4 (LLVM `znver4`):
# measured there (2 threads, fp16 cache), SmolLM2's 30 layers of split decode attention at 2,000 keys from
# cold caches, one process per build, five pairs alternated, asks on -> off: 4.07-4.81 -> 2.39-3.04 ms (the
# scores phase alone 2.05-2.96 -> 1.22-1.52, the values phase alone 2.03-2.53 -> 1.41-1.66); three pairs of
# `python -m benchmarks.long_step`: attention 3.40-3.77 -> 2.14-3.06 ms, the decode step at 2,000 over the
# step at 300 1.53-1.79x -> 1.21-1.44x; an int8 cache level (1.97-2.21 against 2.05-2.15 ms). The scores
# loop keeps HALF_WIDTH_512's one chunk at a time (two at a time without the asks: 1.84-2.19 ms against
# 1.31-1.69). The Xeon gains by the asks (above); the Zen 3 and Zen 5 are not measured without them.
ASKS_AHEAD = llvm.get_host_cpu_name() != "znver4"


@nb.njit(cache=True, inline="always")
def chunk_cursor(c, bs):
    """(index in the block table, key offset in that block) of 16-key chunk c: a block holds bs // 16
    whole chunks. The scores loop divides once, here, and steps with next_chunk. Dividing by the run-time
    block size per chunk had put 9-11 divisions (idivq / divl, with Python's sign fix-ups) in each pass
    over a pair of chunks; measured on the Xeon (avx512, 2 threads, half-rate VM), 30 layers' fp16
    attention in one process against the divisions, same bits: at 300 keys T = 1 / 4 0.94x / 0.92x cold,
    T = 8 1.00x; the split decode at 2,000 keys 1.01x (its loads bound it)."""
    return 16 * c // bs, 16 * c % bs


@nb.njit(cache=True, inline="always")
def next_chunk(i, o, bs):
    """The cursor of the chunk after the one at (i, o)."""
    if o + 16 == bs:
        return i + 1, 0
    return i, o + 16


@nb.njit(cache=True, inline="always")
def line_rows(k_cache):
    """K rows (dims) per cache line in a 16-key chunk, whose rows lie bs apart (once per call: a division)."""
    return max(1, LINE // (k_cache.shape[3] * item_bytes(k_cache)))


@nb.njit(cache=True, inline="always")
def prefetch_key_chunk(k_cache, k_scale, table, kvh, c, chunks, i, o, step):
    """Ask for the lines of 16-key chunk c of KV head kvh, at cursor (i, o) (nothing when c >= chunks);
    step = line_rows(k_cache); nothing where not ASKS_AHEAD."""
    if c >= chunks or not ASKS_AHEAD:
        return
    num_blocks, hd, bs = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    block = kvh * num_blocks + table[i]
    d = 0
    while d < hd:  # (a range with a run-time step would divide for its trip count)
        prefetch(k_cache, block * hd * bs + o + d * bs)
        d += step
    if k_scale is not None:
        for d0 in range(0, hd, 32):  # 16 float32 scales per span of 32 dims: one line
            prefetch(k_scale, block * (hd // 32) * bs + d0 // 32 * bs + o)


@nb.njit(cache=True, inline="always")
def prefetch_block(v_cache, v_scale, first):
    """Ask for the lines of one V block of one KV head: bs x hd elements from flat index `first`, and in
    an int8 cache their scales (bs x hd / 32 float32, from first / 32); nothing where not ASKS_AHEAD."""
    if not ASKS_AHEAD:
        return
    per_line = LINE // item_bytes(v_cache)
    for e in range(0, v_cache.shape[2] * v_cache.shape[3], per_line):
        prefetch(v_cache, first + e)
    if v_scale is not None:
        for e in range(0, v_cache.shape[2] * v_cache.shape[3] // 32, LINE // 4):
            prefetch(v_scale, first // 32 + e)
