"""Decode attention at the long context against the time to read its K/V: what bounds the long step.

A decode step at 2,000 cached tokens differs from one at 300 by its attention, which reads every
layer's cached K and V (46 MB for SmolLM2 in fp16), and the weights' stream pushes those out of the
caches between steps. This times that attention alone, from cold caches, as a forward calls it (each
layer's kernel in turn from compiled code: the split decode kernel where a forward takes it), and a
plain read of the same K/V bytes by the same threads, so a report shows how close attention runs
to the machine's read rate.
"""

from __future__ import annotations

import numba as nb
import numpy as np
from numba.typed import List

from benchmarks.compute_rate import _timed
from engine.kernels.attention import _ATTENTION_VEC, vector_shapes
from engine.kernels.attention_split import decode_attention, splits
from engine.kernels.attention_vec import cache_parts
from engine.kernels.simd import f32_add, f32_hsum, f32_zero, row_f32

_ATTEND_P = _ATTENTION_VEC[1]  # the vector kernel's parallel build, as a layer binds it (`_attend_p`)


@nb.njit
def _attend_all(ks, vs, qkv, cu_q, positions, tables, num_heads, scale, out, threads, split):
    """Every layer's decode attention in turn, as the layers call it (window 0: every key)."""
    for i in range(len(ks)):
        if split:
            decode_attention(qkv, ks[i], vs[i], cu_q, positions, tables, num_heads, scale, 0, out, threads)
        else:
            _ATTEND_P(qkv, ks[i], vs[i], cu_q, positions, tables, num_heads, scale, 0, out, threads)


@nb.njit(parallel=True)
def _read_all(arrays, start, run, threads):
    """Sum elements start .. start + run - 1 of every KV head's row in each array [kv, blocks x block's
    elements]: the bytes one request's attention reads; each thread takes an even share of the runs."""
    parts = np.zeros(threads, np.float32)
    heads = arrays[0].shape[0]
    total = len(arrays) * heads
    for t in nb.prange(threads):
        s = f32_zero(1)
        for j in range(t * total // threads, (t + 1) * total // threads):
            a = arrays[j // heads]
            first = j % heads * (a.size // heads) + start
            for e in range(first, first + run - 15, 16):
                s = f32_add(s, row_f32(a, e))
        parts[t] = f32_hsum(s)
    return parts.sum()


def measure(runner, context: int, table: list[int], repeats: int = 7) -> dict | None:
    """Median ms of every layer's decode attention over `context` cached keys in the blocks of `table` (already
    written: untouched pages would read as the shared zero page) and of reading the same K/V (and an int8
    cache's scales); None where the vector kernels do not serve the model's shapes."""
    cfg = runner.config
    entries = [runner.layer_kv(i) for i in range(cfg.num_layers)]
    parts = [cache_parts(e[i]) for e in entries for i in (0, 1)]  # (values, flat scales or None) per K and V
    k0 = parts[0][0]  # [kv, num_blocks, hd, bs]
    kv, num_blocks, hd, bs = k0.shape
    blocks = -(-(context + 1) // bs)
    if not vector_shapes(hd, bs) or blocks > len(table):
        return None
    heads = cfg.num_heads
    qkv = np.random.default_rng(0).standard_normal((1, (heads + 2 * kv) * hd)).astype(np.float32)
    cu_q, positions = np.array([0, 1], np.int32), np.array([context], np.int32)
    tables = np.zeros((1, num_blocks), np.int32)
    tables[0, :blocks] = table[:blocks]
    split = bool(splits(1, cu_q, context + 1, heads, kv))
    args = (List([e[0] for e in entries]), List([e[1] for e in entries]), qkv, cu_q, positions, tables, heads,
            np.float32(1.0 / np.sqrt(hd)), np.zeros((1, heads * hd), np.float32), nb.get_num_threads(), split)
    per = bs * hd  # elements of one block of one head
    # the table's blocks are consecutive (context_tables): one run per head and array
    reads = [(List([v.reshape(kv, -1) for v, _ in parts]), table[0] * per, blocks * per)]
    if parts[0][1] is not None:  # int8: [kv, blocks, hd / 32, bs] float32 scales beside the values
        reads.append((List([sc.reshape(kv, -1) for _, sc in parts]), table[0] * per // 32, blocks * per // 32))
    flush = np.ones(64 << 20, np.float32)  # 256 MB, past any cache

    def read_all():
        for arrays, start, run in reads:
            _read_all(arrays, start, run, nb.get_num_threads())

    _attend_all(*args)
    read_all()
    attend, read = [], []
    for _ in range(repeats):
        flush.sum()
        attend.append(_timed(lambda: _attend_all(*args)))
        flush.sum()
        read.append(_timed(read_all))
    nbytes = sum(len(arrays) * kv * run * arrays[0].itemsize for arrays, _, run in reads)
    return {"context": context, "kv_mb": nbytes / 1e6, "split": split,
            "attention_ms": 1000 * float(np.median(attend)), "read_ms": 1000 * float(np.median(read))}


def report(rate: dict | None) -> None:
    if rate is None:
        return
    print(f"attention at {rate['context']} ctx {rate['attention_ms']:.2f} ms for {rate['kv_mb']:.1f} MB of K/V, cold "
          f"(reading them alone {rate['read_ms']:.2f} ms; {rate['attention_ms'] / rate['read_ms']:.2f}x)")
