"""How append attention's work is cut into items and dealt to the threads (attention_vec).

An item is a chunk of up to TOKENS_PER_ITEM consecutive tokens of one request x one KV head x one half of
the group's query heads, or, for a lone chunk (a verify) on an odd group, x one half of its tokens
(`_part`). Items go to the threads as prange's equal ranges of their zigzag order, or as runs balanced by
their cost, query rows x keys (`_runs`). Which thread computes an item changes no bit of its result.
"""

from __future__ import annotations

import numba as nb
import numpy as np

# Tokens of a lone chunk from which an odd group's two items each take half of its tokens (every head) instead of
# half of its heads (every token): SmolLM2's 3 x 3 heads then split 36:36 query rows between two threads at T = 8
# instead of 40:32. 30 layers at 300 keys, two threads (Zen 4): T = 8 1.58 -> 1.34 ms, 6 1.19 -> 1.03, 4 0.77 -> 0.74;
# at T = 2 halves of one token ran each head alone (0.47 -> 0.79 ms), so fewer tokens keep the heads' split.
BY_TOKENS_MIN = 4


@nb.njit(cache=True)
def _runs(costs, threads):
    """Items as one run per thread, the costliest first to the least loaded thread (Numba's prange hands each
    thread one contiguous range of equal length, whatever its items cost: a verify of 9 tokens is a chunk
    of 8 and one of 1, and one thread got all of the first). Returns (items in run order, run starts
    [threads + 1]); an item's result does not depend on its thread."""
    loads = np.zeros(threads, np.int64)
    owner = np.empty(costs.shape[0], np.int64)
    for i in np.argsort(-costs, kind="mergesort"):
        t = np.argmin(loads)
        owner[i] = t
        loads[t] += costs[i]
    starts = np.zeros(threads + 1, np.int64)
    for i in range(costs.shape[0]):
        starts[owner[i] + 1] += 1
    starts = np.cumsum(starts)
    order = np.empty(costs.shape[0], np.int64)
    filled = starts[:threads].copy()
    for i in range(costs.shape[0]):
        order[filled[owner[i]]] = i
        filled[owner[i]] += 1
    return order, starts


@nb.njit(cache=True, inline="always")
def _part(part, group, num_tokens, by_tokens):
    """(first head, last head + 1, first token, last token + 1) of item half `part` (0, 1) of a KV group's heads x a
    chunk's tokens, relative to the group and the chunk: by_tokens, every head x half of the tokens (the first
    half the larger), else half of the heads (the first the larger) x every token."""
    if by_tokens:
        half = (num_tokens + 1) // 2
        return 0, group, part * half, min(num_tokens, (part + 1) * half)
    half = (group + 1) // 2
    return part * half, min(group, (part + 1) * half), 0, num_tokens


@nb.njit(cache=True, inline="always")
def _zigzag(i, n):
    """The i-th of n chunks taken from both ends in turn (0, n-1, 1, n-2, ...): a causal prompt's chunks
    grow in cost, so equal contiguous ranges of this order even the threads' work."""
    return i // 2 if i % 2 == 0 else n - 1 - i // 2


@nb.njit(cache=True)
def _equal_ranges_top(costs, threads):
    """The heaviest of `threads` contiguous ranges of (nearly) equal length, as prange cuts them."""
    top = 0
    n = costs.shape[0]
    for t in range(threads):
        top = max(top, costs[t * n // threads : (t + 1) * n // threads].sum())
    return top


@nb.njit(cache=True)
def _least_top(costs, threads):
    """A lower bound on the heaviest run of any split: the costliest item, or an even share."""
    return max(costs.max(), (costs.sum() + threads - 1) // threads)
