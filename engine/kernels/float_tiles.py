"""Float weight products on strips as explicit vectors: float32, fp16 or bf16 weights, float32 activations.

Each output is one sequential float32 sum over k = 0..K-1 of `w * x`, each product and each addition
rounded on its own (fmul then fadd, never fused), with the strip element widened exactly to float32 as
it is loaded (`simd.row_f32`: a uint16 strip holds fp16 bits, an int16 strip bf16 bits). So any tile,
tail or batch gives a row the bits it has alone, and F16 / BF16 weights give the bits of their float32
values at half the bytes.

An item is one strip (16 output rows); its tokens run in tiles of `TILE` (8 on paths with 32 vector
registers, else 4), one pass over k each, then the rest in one pass (5 = 4 + 1, 6 = 4 + 2 and 3 = 2 + 1
as a pair of tiles; 7 as 4 + 2, then 1). Every pass
asks for the strip-major stream's line AHEAD_BYTES further on: without it the hardware prefetcher
stalls at each strip start, and a second pass over a strip (T = 5..8 as two tiles of 4) left the
memory idle. Zen 5, one [49152, 768] fp16 matrix (75 MB), 2 threads: T = 4 1.45 -> 1.03-1.06 ms and
T = 8 (one tile of 8) 5.3 -> 1.7 ms with the prefetch; the loops of linear_jit this replaced took
1.45-1.76 and 4.07-4.13 ms.
Layout: w [S, K, 16] (S = ceil(N / 16) strips, k-major, rows past N zero), x [T, K], out [T, N].
"""

from __future__ import annotations

import functools

import numba as nb

from engine.kernels.simd import (
    f32_add,
    f32_mul,
    f32_zero,
    prefetch,
    row_f32,
    specialize,
    store_rows,
    tok_f32,
    wide_registers,
)

TILE = {"avx512": 8}  # tokens per tile on paths with 32 vector registers (else 4)
AHEAD_BYTES = 32768  # prefetch distance in the weight stream (4-32 KB measured within 5% at T = 4 and 8)


@nb.njit(cache=True, inline="always")
def _tile(w, x, a, t0, tt):
    """[tt x 16] sums for tokens t0 .. t0+tt-1 of x against the strip at flat index a of w."""
    k_dim = x.shape[1]
    ahead = AHEAD_BYTES // w.itemsize
    acc = f32_zero(tt)
    xi = t0 * k_dim
    for k in range(k_dim):
        prefetch(w, a + 16 * k + ahead)
        xs = tok_f32(x, xi + k, k_dim, tt)  # [tt x 16]: each token's x[t, k] in all lanes
        acc = f32_add(acc, f32_mul(row_f32(w, a + 16 * k), xs))
    return acc


@nb.njit(cache=True, inline="always")
def _pair(w, x, a, t0, ta, tb):
    """_tile for ta tokens from t0 and tb tokens after them, in one pass: ([ta x 16], [tb x 16])."""
    k_dim = x.shape[1]
    ahead = AHEAD_BYTES // w.itemsize
    acc_a = f32_zero(ta)
    acc_b = f32_zero(tb)
    xa = t0 * k_dim
    xb = xa + ta * k_dim
    for k in range(k_dim):
        prefetch(w, a + 16 * k + ahead)
        wk = row_f32(w, a + 16 * k)
        acc_a = f32_add(acc_a, f32_mul(wk, tok_f32(x, xa + k, k_dim, ta)))
        acc_b = f32_add(acc_b, f32_mul(wk, tok_f32(x, xb + k, k_dim, tb)))
    return acc_a, acc_b


@nb.njit(cache=True, inline="always")
def _store_pair(out, s, t0, ta, accs, rows):
    n = out.shape[1]
    store_rows(out, t0 * n + 16 * s, n, accs[0], rows)
    store_rows(out, (t0 + ta) * n + 16 * s, n, accs[1], rows)


def _float_linear(x, w, out):
    """out [T, N] = x [T, K] @ W.T for strips w [S, K, 16]; `TILE` is bound per path."""
    num_tokens = x.shape[0]
    n = out.shape[1]
    per_strip = w.shape[1] * 16
    for s in nb.prange(w.shape[0]):
        wide_registers()
        a = s * per_strip
        rows = min(16, n - 16 * s)
        t0 = 0
        while num_tokens - t0 >= TILE:  # noqa: F821  (bound per path)
            if TILE == 8:  # noqa: F821  (a constant: other paths compile no tile of 8)
                store_rows(out, t0 * n + 16 * s, n, _tile(w, x, a, t0, 8), rows)
            else:
                store_rows(out, t0 * n + 16 * s, n, _tile(w, x, a, t0, 4), rows)
            t0 += TILE  # noqa: F821
        rest = num_tokens - t0  # 0 .. TILE - 1, in one pass where two tiles fit the registers
        if rest >= 6:
            _store_pair(out, s, t0, 4, _pair(w, x, a, t0, 4, 2), rows)
            t0 += 6
        elif rest == 5:
            _store_pair(out, s, t0, 4, _pair(w, x, a, t0, 4, 1), rows)
            t0 += 5
        elif rest == 4:
            store_rows(out, t0 * n + 16 * s, n, _tile(w, x, a, t0, 4), rows)
            t0 += 4
        elif rest == 3:
            _store_pair(out, s, t0, 2, _pair(w, x, a, t0, 2, 1), rows)
            t0 += 3
        elif rest == 2:
            store_rows(out, t0 * n + 16 * s, n, _tile(w, x, a, t0, 2), rows)
            t0 += 2
        if num_tokens - t0 == 1:  # a rest of 1, or of 7 after its 4 + 2
            store_rows(out, t0 * n + 16 * s, n, _tile(w, x, a, t0, 1), rows)


@functools.cache
def kernel(path: str):
    """The compiled float product for one ISA path (float32, fp16 and bf16 strips: one specialization each)."""
    return specialize(_float_linear, path, {"TILE": TILE.get(path, 4)}, tag="float")

