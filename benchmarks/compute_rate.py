"""The CPU's peak integer rate for the kernels' 4-dot, and the rate the model's weight products reach.

peak      every thread runs a loop of independent 4-dots (`acc_add` of the host's path: vpmaddubsw
          + vpaddw on avx2, 256-bit vpdpbusd on vnni, 512-bit on avx512) on L1-resident bytes: nothing but the instruction
          the integer products are built on, so its rate bounds theirs.
combined  the same loop with a Q4_1 block's float combine beside each token's 8 4-dots: 3 independent 16-lane
          multiplies (d * xd, times the block's sum, m * xm; int_tiles), whose results nothing else waits on. Where
          the CPU issues its float multiplies on the pipes of its integer dot products (the Zen 4 does: each
          512-bit multiply took one `vpdpbusd`'s place, an add or a conversion none), this rate is below the peak,
          and it, not the peak, bounds a tile's products; elsewhere the two are level.
reached   the whole model's weight products (every layer's q|k|v, o, gate|up, down and the LM head),
          activations quantized as in a forward, on T rows, called from compiled code as a forward calls them.
Both in multiply-adds per second (GMAC/s), on the threads the runner uses.
"""

from __future__ import annotations

import time

import numba as nb
import numpy as np

from engine.kernels.simd import (  # noqa: F401  (the compiled loops')
    f32_add,
    f32_from_i32,
    f32_mul,
    i32_add,
    row_f32,
    store_rows,
    wbytes,
    xbcast,
)
from engine.kernels.simd_paths import specialize

MACS_PER_ITERATION = 2 * 4 * 16 * 4  # two accumulators x 4 tokens x 16 lanes x a 4-dot: one token's Q4_1 block
MULTIPLIES = 0  # 16-lane float multiplies per iteration (bound per build: 0 for the peak, 3 for the combined rate)


def _peak_loop(w, x, s, iterations, out):
    """Per thread: 2 x 4 tokens of independent 4-dots per iteration over 4 KiB of weights and 512 B of x, and
    MULTIPLIES chains of 16-lane multiplies by s's values (ones)."""
    for th in nb.prange(out.shape[0] // 64):
        a = acc_zero(4)  # noqa: F821  (bound per path by specialize)
        b = acc_zero(4)  # noqa: F821
        p0 = p1 = p2 = row_f32(s, 0)  # products of loaded values: nothing folds them away
        for i in range(iterations):
            j = (i + th) & 31
            a = acc_add(a, wbytes(w, 64 * j), xbcast(x, 4 * j, 128, 4))  # noqa: F821
            b = acc_add(b, wbytes(w, 2048 + 64 * j), xbcast(x, 4 * j + 1, 128, 4))  # noqa: F821
            if MULTIPLIES >= 1:  # a constant: the peak's build has no multiplies
                p0 = f32_mul(p0, row_f32(s, 16 * (j & 7)))
            if MULTIPLIES >= 2:
                p1 = f32_mul(p1, row_f32(s, 128 + 16 * (j & 7)))
            if MULTIPLIES >= 3:
                p2 = f32_mul(p2, row_f32(s, 256 + 16 * (j & 7)))
        ints = f32_from_i32(i32_add(acc_i32(a), acc_i32(b)))  # noqa: F821
        store_rows(out, 64 * th, 16, ints, 16)  # (keeps the loop)
        store_rows(out, 64 * th, 0, f32_add(row_f32(out, 64 * th), f32_add(p0, f32_add(p1, p2))), 16)


def peak_gmacs(path: str, iterations: int = 20_000_000, repeats: int = 3, multiplies: int = 0) -> float:
    """The host's peak rate of the path's 4-dot over all threads (best of `repeats`), GMAC/s; with `multiplies`
    (0-3) float multiplies beside each token's 8 4-dots (3: a Q4_1 block's combine), the rate they leave."""
    loop = specialize(_peak_loop, path, {"MULTIPLIES": multiplies}, tag=f"peak{multiplies or ''}")
    rng = np.random.default_rng(0)
    w = rng.integers(0, 16, 4096).astype(np.uint8)
    x = rng.integers(-127, 128, 512).astype(np.int8)
    s = np.ones(384, np.float32)  # [3 chains x 8 vectors x 16 lanes]
    out = np.zeros(64 * nb.get_num_threads(), np.float32)  # [threads x 4 tokens x 16 lanes]
    loop(w, x, s, 100, out)
    best = min(_timed(lambda: loop(w, x, s, iterations, out)) for _ in range(repeats))
    return nb.get_num_threads() * iterations * MACS_PER_ITERATION / best / 1e9


def products_gmacs(runner, num_tokens: int, repeats: int = 3) -> float:
    """Rate of one pass of the model's weight products over `num_tokens` rows (best of `repeats`), GMAC/s.

    Every layer's products and the LM head, each as a layer calls it (its compiled product: the rows
    quantized, then the kernel), grouped by product kind and input width so that one compiled loop runs a
    group: no Python between two products, as in a forward (called from Python one by one, each cost ~5 us
    more: the pass at T = 8 189 against 213 GMAC/s on the Zen 4)."""
    from engine.kernels import layer as layer_kernels
    from engine.kernels.int_linear import QuantRows, host_path

    weights = [w for layer in runner.layers for w, _ in runner.layer_products(layer)] + [runner.lm_head]
    groups: dict[tuple, list] = {}
    for w in weights:
        groups.setdefault((layer_kernels.product_key(w), w.k), []).append(w)
    rng = np.random.default_rng(0)
    runs = []
    for (key, k), ws in groups.items():
        product = layer_kernels.product(key, host_path())
        rows = QuantRows(k, num_tokens + 1)
        x = rng.standard_normal((num_tokens, k)).astype(np.float32)  # [T, k]
        out = np.empty((num_tokens, max(w.n for w in ws)), np.float32)  # [T, widest n]
        runs.append((product, x, tuple(layer_kernels.product_args(w) for w in ws), out,
                     (rows.xq, rows.xd, rows.xm, rows.xs)))

    def one_pass():
        for run in runs:
            _products_loop(*run)

    one_pass()
    best = min(_timed(one_pass) for _ in range(repeats))
    return num_tokens * sum(w.n * w.k for w in weights) / best / 1e9


@nb.njit
def _products_loop(product, x, ws, out, rows):
    """product(x, w, out, rows) for each w of ws (one group's weights, alike in type)."""
    for w in ws:
        product(x, w, out, rows)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(runner, prefill_tokens: int) -> dict:
    """The host path's 4-dot peak and the products' rate at T = 8 (a verify step) and at a prefill."""
    from engine.kernels.int_linear import host_path

    path = host_path()
    reached = {t: products_gmacs(runner, t) for t in (8, prefill_tokens)}
    return {"path": path, "peak_gmacs": peak_gmacs(path), "combined_gmacs": peak_gmacs(path, multiplies=3),
            "products_gmacs": reached}


def report(rate: dict, numerics: str) -> None:
    peak, combined = rate["peak_gmacs"], rate["combined_gmacs"]
    print(f"integer 4-dot peak      {peak:.1f} GMAC/s ({rate['path']}, all threads)")
    print(f"  with Q4_1's combine   {combined:.1f} GMAC/s (3 float multiplies per token and block)")
    for t, gmacs in rate["products_gmacs"].items():
        share = f" ({gmacs / peak:.0%} of the peak, {gmacs / combined:.0%} of the rate with the combine)"
        print(f"  products at T={t:<4d}   {gmacs:.1f} GMAC/s{share if numerics == 'int8' else ''}")
