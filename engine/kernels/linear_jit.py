"""Numba loops for y = x @ W.T on strip-packed weights: the 4-token tiles of the exact Q4_1 / Q8_0
kernels (linear_quant), which decode each strip into float32 scratch first. Float weights (F32, F16,
BF16) run on float_tiles' explicit vectors, which give the same sums. See shared/CPU-KERNELS.md.

Each output element is one sequential float32 sum over k = 0..K-1 in which every step rounds
`w * x` and then `acc + (w * x)` separately (fastmath off, so LLVM never fuses them into an FMA).
Tile widths, tails, the kernel chosen for a given T and the rows sharing a batch therefore cannot
change a single bit of any row: that is what keeps speculative verification lossless.
Quantized weights are decoded to exactly the float32 values gguf-py's dequantize produces
(`d * q` for Q8_0, `d * q + m` for Q4_1, each rounded in float32).

Layouts (S = ceil(N / 16) strips of 16 output rows, stored k-major so one k reads 16 rows at once):
  f32   w  [S, K, 16] float32 (float_tiles also takes the F16 / BF16 file's 2-byte values)
  q8_0  qs [S, K, 16] int8;  d [S, K/32, 16] float32
  q4_1  qs [S, K/2, 16] uint8, low nibble = even k, high nibble = odd k;  d, m [S, K/32, 16] float32
Vectorisation notes: the strip's 16 rows form the vector, so each accumulator acc[t, 0:16] must
stay in registers. That holds when the helpers are inlined at Numba-IR level (inline="always",
so the parfor body keeps its noalias arguments) and acc is allocated at the top of the prange body.
Index arithmetic is unsigned (uint64) and nibbles are widened to int32 before conversion: signed
indices add wraparound checks and 64-bit integers have no AVX2 conversion, both block vectorising.
"""

import numpy as np
from numba import njit

U0 = np.uint64(0)
U1 = np.uint64(1)
U2 = np.uint64(2)
U3 = np.uint64(3)
U4 = np.uint64(4)
U16 = np.uint64(16)
U32 = np.uint64(32)
NIBBLE = np.int32(15)
FOUR = np.int32(4)


@njit(cache=True, inline="always")
def store_tile(acc, num_tile, out, t0, n0, num_rows):
    for i in range(num_tile):
        for r in range(num_rows):
            out[t0 + i, n0 + r] = acc[i, r]


@njit(cache=True, inline="always")
def tiles4(x, w, j, out, n0, num_rows, acc):
    """out[:, n0:n0+num_rows] = x @ w[j].T[:num_rows] for the [K, 16] strip w[j]; acc [4, 16].

    Tiles of 4 tokens; the last tile repeats the last row of x (same bits, stored once). One tile
    loop only: a second tile shape in the same loop nest stopped LLVM keeping acc in registers
    when the scratch kernels are compiled in-process (a cached build was fast, a fresh one 3x slower).
    """
    num_tokens = np.uint64(x.shape[0])
    k_dim = np.uint64(x.shape[1])
    last = num_tokens - U1
    t0 = U0
    while t0 < num_tokens:
        t1 = min(t0 + U1, last)
        t2 = min(t0 + U2, last)
        t3 = min(t0 + U2 + U1, last)
        acc[:] = 0
        for k in range(k_dim):
            x0 = x[t0, k]
            x1 = x[t1, k]
            x2 = x[t2, k]
            x3 = x[t3, k]
            for r in range(U16):
                wv = w[j, k, r]
                acc[0, r] += wv * x0
                acc[1, r] += wv * x1
                acc[2, r] += wv * x2
                acc[3, r] += wv * x3
        num_tile = min(U4, num_tokens - t0)
        store_tile(acc, num_tile, out, t0, n0, num_rows)
        t0 += num_tile
