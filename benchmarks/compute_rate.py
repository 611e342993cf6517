"""The CPU's peak integer rate for the kernels' 4-dot, and the rate the model's weight products reach.

peak      every thread runs a loop of independent 4-dots (`acc_add` of the host's path: vpmaddubsw
          + vpaddw on avx2, 256-bit vpdpbusd on vnni, 512-bit on avx512) on L1-resident bytes: nothing but the instruction
          the integer products are built on, so its rate bounds theirs.
reached   the whole model's weight products (every layer's q|k|v, o, gate|up, down and the LM head),
          activations quantized as in a forward, on T rows.
Both in multiply-adds per second (GMAC/s), on the threads the runner uses.
"""

from __future__ import annotations

import time

import numba as nb
import numpy as np

from engine.kernels.simd import f32_from_i32, i32_add, store_rows, wbytes, xbcast  # noqa: F401  (the compiled loop's)
from engine.kernels.simd_paths import specialize

MACS_PER_ITERATION = 2 * 4 * 16 * 4  # two accumulators x 4 tokens x 16 lanes x a 4-dot


def _peak_loop(w, x, iterations, out):
    """Per thread: 2 x 4 tokens of independent 4-dots per iteration over 4 KiB of weights and 512 B of x."""
    for th in nb.prange(out.shape[0] // 64):
        a = acc_zero(4)  # noqa: F821  (bound per path by specialize)
        b = acc_zero(4)  # noqa: F821
        for i in range(iterations):
            j = (i + th) & 31
            a = acc_add(a, wbytes(w, 64 * j), xbcast(x, 4 * j, 128, 4))  # noqa: F821
            b = acc_add(b, wbytes(w, 2048 + 64 * j), xbcast(x, 4 * j + 1, 128, 4))  # noqa: F821
        store_rows(out, 64 * th, 16, f32_from_i32(i32_add(acc_i32(a), acc_i32(b))), 16)  # noqa: F821  (keeps the loop)


def peak_gmacs(path: str, iterations: int = 20_000_000, repeats: int = 3) -> float:
    """The host's peak rate of the path's 4-dot over all threads (best of `repeats`), GMAC/s."""
    loop = specialize(_peak_loop, path, {}, tag="peak")
    rng = np.random.default_rng(0)
    w = rng.integers(0, 16, 4096).astype(np.uint8)
    x = rng.integers(-127, 128, 512).astype(np.int8)
    out = np.zeros(64 * nb.get_num_threads(), np.float32)  # [threads x 4 tokens x 16 lanes]
    loop(w, x, 100, out)
    best = min(_timed(lambda: loop(w, x, iterations, out)) for _ in range(repeats))
    return nb.get_num_threads() * iterations * MACS_PER_ITERATION / best / 1e9


def products_gmacs(runner, num_tokens: int, repeats: int = 3) -> float:
    """Rate of one pass of the model's weight products over `num_tokens` rows (best of `repeats`), GMAC/s."""
    from engine.kernels.linear import linear

    weights = [w for layer in runner.layers for w, _ in runner.layer_products(layer)] + [runner.lm_head]
    rng = np.random.default_rng(0)
    xs = {k: rng.standard_normal((num_tokens, k)).astype(np.float32) for k in {w.k for w in weights}}
    outs = [np.empty((num_tokens, w.n), np.float32) for w in weights]

    def one_pass():
        for w, out in zip(weights, outs):
            linear(xs[w.k], w, out)

    one_pass()
    best = min(_timed(one_pass) for _ in range(repeats))
    return num_tokens * sum(w.n * w.k for w in weights) / best / 1e9


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(runner, prefill_tokens: int) -> dict:
    """The host path's 4-dot peak and the products' rate at T = 8 (a verify step) and at a prefill."""
    from engine.kernels.int_linear import host_path

    path = host_path()
    reached = {t: products_gmacs(runner, t) for t in (8, prefill_tokens)}
    return {"path": path, "peak_gmacs": peak_gmacs(path), "products_gmacs": reached}


def report(rate: dict, numerics: str) -> None:
    peak = rate["peak_gmacs"]
    print(f"integer 4-dot peak      {peak:.1f} GMAC/s ({rate['path']}, all threads)")
    for t, gmacs in rate["products_gmacs"].items():
        share = f" ({gmacs / peak:.0%} of the peak)" if numerics == "int8" else ""
        print(f"  products at T={t:<4d}   {gmacs:.1f} GMAC/s{share}")
