"""Float weight products on strips as explicit vectors: the exact path's y = x @ W.T.

Weights: float32, fp16 or bf16 strips (F32 / F16 / BF16 tensors; a uint16 strip holds fp16 bits, an
int16 strip bf16 bits, widened exactly by `simd.row_f32`), or Q8_0 / Q4_1 quants with their float32
block scales, decoded per k to exactly gguf-py's float32 values (`d * q`; `d * q + m`, each rounded).
Each output is one sequential float32 sum over k = 0..K-1 of `w * x`, each product and each addition
rounded on its own (fmul then fadd, never fused). So any tile, tail or batch gives a row the bits it has
alone, and F16 / BF16 weights give the bits of their float32 values at half the bytes.

An item is one strip (16 output rows); its tokens run in tiles of `TILE` (8 on paths with 32 vector
registers, else 4), one pass over k each, then the rest in one pass (5 = 4 + 1, 6 = 4 + 2 and 3 = 2 + 1
as a pair of tiles; 7 as 4 + 2, then 1). From DECODE_MIN_TOKENS tokens (a prefill) a quant strip is decoded
once into float32 scratch and the passes run over that (SmolLM2 exact prefill of 500 tokens, Zen 5: 961 -> 1,332
tok/s; the plain tiles decode it once per 8 tokens). Every pass asks for each weight stream's lines AHEAD_BYTES
further on (`_ahead`, per format): without it the hardware prefetcher stalls at each strip start, and a
second pass over a strip (T = 5..8 as two tiles of 4) left the memory idle. Zen 5, one [49152, 768]
fp16 matrix (75 MB), 2 threads: T = 4 1.45 -> 1.03-1.06 ms and T = 8 (one tile of 8) 5.3 -> 1.7 ms with
the prefetch; the loops this replaced (linear_jit) took 1.45-1.76 and 4.07-4.13 ms.

Layouts (S = ceil(N / 16) strips, k-major, rows past N zero; x [T, K], out [T, N]):
  float  (w [S, K, 16],)
  q8_0   (qs [S, K, 16] int8, d [S, K/32, 16] float32)
  q4_1   (qs [S, K/2, 16] uint8: low nibble = even k, high = odd k; d, m [S, K/32, 16] float32)
"""

from __future__ import annotations

import functools

import numba as nb
import numpy as np

from engine.kernels.simd import (
    f32_add,
    f32_mul,
    f32_zero,
    item_bytes,
    prefetch,
    row_f32,
    row_hi4,
    row_lo4,
    specialize,
    specialize_family,
    store_rows,
    tok_f32,
    wide_registers,
)

TILE = {"avx512": 8}  # tokens per tile on paths with 32 vector registers (else 4)
DECODE_MIN_TOKENS = 16  # from here a quant strip is decoded once into float32 scratch, not once per tile
AHEAD_BYTES = 32768  # prefetch distance in the weight stream (4-32 KB measured within 5% at T = 4 and 8)
FORMATS = ("float", "q8_0", "q4_1")


# ---------------------------------------------------------------- per format: rows k = 2kk, 2kk + 1 of strip s
# (plain functions: `kernel` compiles them inline into the tiles, as `_rows2`, `_ahead` and `_last`)


def _ask(a, at, ahead_bytes):
    prefetch(a, at + ahead_bytes // item_bytes(a))


def float_rows2(w, s, kk, k_dim):
    at = (s * k_dim + 2 * kk) * 16
    return row_f32(w[0], at), row_f32(w[0], at + 16)


def float_ahead(w, s, kk, k_dim):
    at = (s * k_dim + 2 * kk) * 16
    _ask(w[0], at, AHEAD_BYTES)
    _ask(w[0], at + 16, AHEAD_BYTES)  # a float32 row of 16 is a whole line


def float_last(w, s, k_dim):
    """Row K - 1 of strip s, for an odd K."""
    return row_f32(w[0], (s * k_dim + k_dim - 1) * 16)


def q8_0_rows2(w, s, kk, k_dim):
    qs, d = w
    at = (s * k_dim + 2 * kk) * 16
    db = row_f32(d, (s * (k_dim // 32) + kk // 16) * 16)
    return f32_mul(db, row_f32(qs, at)), f32_mul(db, row_f32(qs, at + 16))


def q8_0_ahead(w, s, kk, k_dim):
    qs, d = w
    _ask(qs, (s * k_dim + 2 * kk) * 16, AHEAD_BYTES)
    _ask(d, (s * (k_dim // 32) + kk // 16) * 16, AHEAD_BYTES // 8)  # d: 4 bytes a row per 32 of qs'


def q4_1_rows2(w, s, kk, k_dim):
    qs, d, m = w
    at = (s * (k_dim // 2) + kk) * 16
    scale_at = (s * (k_dim // 32) + kk // 16) * 16
    db, mb = row_f32(d, scale_at), row_f32(m, scale_at)
    return f32_add(f32_mul(db, row_lo4(qs, at)), mb), f32_add(f32_mul(db, row_hi4(qs, at)), mb)


def q4_1_ahead(w, s, kk, k_dim):
    qs, d, m = w
    scale_at = (s * (k_dim // 32) + kk // 16) * 16
    _ask(qs, (s * (k_dim // 2) + kk) * 16, AHEAD_BYTES)
    _ask(d, scale_at, AHEAD_BYTES // 4)  # d and m: 4 bytes a row per 16 of qs'
    _ask(m, scale_at, AHEAD_BYTES // 4)


def no_last(w, s, k_dim):
    """Quant formats have K a multiple of 32: never called."""
    return f32_zero(1)


# ---------------------------------------------------------------- tiles and the driver (every format)


def tile(w, x, s, t0, tt):
    """[tt x 16] sums for tokens t0 .. t0+tt-1 of x against strip s of w."""
    k_dim = x.shape[1]
    acc = f32_zero(tt)
    xi = t0 * k_dim
    for kk in range(k_dim // 2):
        _ahead(w, s, kk, k_dim)  # noqa: F821  (bound per format)
        w0, w1 = _rows2(w, s, kk, k_dim)  # noqa: F821
        acc = f32_add(acc, f32_mul(w0, tok_f32(x, xi + 2 * kk, k_dim, tt)))  # [tt x 16]
        acc = f32_add(acc, f32_mul(w1, tok_f32(x, xi + 2 * kk + 1, k_dim, tt)))
    if k_dim % 2:
        acc = f32_add(acc, f32_mul(_last(w, s, k_dim), tok_f32(x, xi + k_dim - 1, k_dim, tt)))  # noqa: F821
    return acc


def pair(w, x, s, t0, ta, tb):
    """tile for ta tokens from t0 and tb tokens after them, in one pass: ([ta x 16], [tb x 16])."""
    k_dim = x.shape[1]
    acc_a = f32_zero(ta)
    acc_b = f32_zero(tb)
    xa = t0 * k_dim
    xb = xa + ta * k_dim
    for kk in range(k_dim // 2):
        _ahead(w, s, kk, k_dim)  # noqa: F821  (bound per format)
        w0, w1 = _rows2(w, s, kk, k_dim)  # noqa: F821
        k = 2 * kk
        acc_a = f32_add(acc_a, f32_mul(w0, tok_f32(x, xa + k, k_dim, ta)))
        acc_b = f32_add(acc_b, f32_mul(w0, tok_f32(x, xb + k, k_dim, tb)))
        acc_a = f32_add(acc_a, f32_mul(w1, tok_f32(x, xa + k + 1, k_dim, ta)))
        acc_b = f32_add(acc_b, f32_mul(w1, tok_f32(x, xb + k + 1, k_dim, tb)))
    if k_dim % 2:
        wl = _last(w, s, k_dim)  # noqa: F821
        acc_a = f32_add(acc_a, f32_mul(wl, tok_f32(x, xa + k_dim - 1, k_dim, ta)))
        acc_b = f32_add(acc_b, f32_mul(wl, tok_f32(x, xb + k_dim - 1, k_dim, tb)))
    return acc_a, acc_b


@nb.njit(cache=True, inline="always")
def _store_pair(out, s, t0, ta, accs, rows):
    n = out.shape[1]
    store_rows(out, t0 * n + 16 * s, n, accs[0], rows)
    store_rows(out, (t0 + ta) * n + 16 * s, n, accs[1], rows)


def passes(w, x, out, s, ws, rows):
    """Every token of x against strip ws of w into strip s of out (its first `rows` rows): tiles of TILE, then
    the rest in one pass."""
    num_tokens = x.shape[0]
    n = out.shape[1]
    t0 = 0
    while num_tokens - t0 >= TILE:  # noqa: F821  (bound per path)
        if TILE == 8:  # noqa: F821  (a constant: other paths compile no tile of 8)
            store_rows(out, t0 * n + 16 * s, n, tile(w, x, ws, t0, 8), rows)
        else:
            store_rows(out, t0 * n + 16 * s, n, tile(w, x, ws, t0, 4), rows)
        t0 += TILE  # noqa: F821
    rest = num_tokens - t0  # 0 .. TILE - 1, in one pass where two tiles fit the registers
    if rest >= 6:
        _store_pair(out, s, t0, 4, pair(w, x, ws, t0, 4, 2), rows)
        t0 += 6
    elif rest == 5:
        _store_pair(out, s, t0, 4, pair(w, x, ws, t0, 4, 1), rows)
        t0 += 5
    elif rest == 4:
        store_rows(out, t0 * n + 16 * s, n, tile(w, x, ws, t0, 4), rows)
        t0 += 4
    elif rest == 3:
        _store_pair(out, s, t0, 2, pair(w, x, ws, t0, 2, 1), rows)
        t0 += 3
    elif rest == 2:
        store_rows(out, t0 * n + 16 * s, n, tile(w, x, ws, t0, 2), rows)
        t0 += 2
    if num_tokens - t0 == 1:  # a rest of 1, or of 7 after its 4 + 2
        store_rows(out, t0 * n + 16 * s, n, tile(w, x, ws, t0, 1), rows)


def decode(w, s, k_dim, strip):
    """Strip s of quant weights w as float32 into strip [1, K, 16] (the values `_rows2` gives)."""
    for kk in range(k_dim // 2):
        w0, w1 = _rows2(w, s, kk, k_dim)  # noqa: F821
        store_rows(strip, 32 * kk, 0, w0, 16)
        store_rows(strip, 32 * kk + 16, 0, w1, 16)


def no_ahead(w, s, kk, k_dim):
    """A decoded strip is in cache already."""


def _float_linear(x, w, out):
    """out [T, N] = x [T, K] @ W.T for the strips' arrays w; `_passes`, `_decode`, `_passes_decoded` and
    DECODE_ONCE are bound per format and path."""
    num_tokens, k_dim = x.shape
    n = out.shape[1]
    for s in nb.prange((n + 15) // 16):
        wide_registers()
        rows = min(16, n - 16 * s)
        if DECODE_ONCE and num_tokens >= DECODE_MIN_TOKENS:  # noqa: F821  (DECODE_ONCE: a constant)
            strip = np.empty((1, k_dim, 16), np.float32)
            _decode(w, s, k_dim, strip)  # noqa: F821
            _passes_decoded((strip,), x, out, s, 0, rows)  # noqa: F821
        else:
            _passes(w, x, out, s, s, rows)  # noqa: F821


@functools.cache
def kernel(fmt: str, path: str):
    """The compiled product (x, arrays, out) for one format of FORMATS on one ISA path (float: one
    specialization per strip element type)."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {', '.join(FORMATS)}, got {fmt!r}")
    shared = {"_ask": _ask, "tile": tile, "pair": pair, "passes": passes, "decode": decode}
    direct = specialize_family(dict(shared, _rows2=globals()[f"{fmt}_rows2"], _ahead=globals()[f"{fmt}_ahead"],
                                    _last=float_last if fmt == "float" else no_last),
                               path, {"TILE": TILE.get(path, 4)}, tag=f"float_{fmt}")
    decoded = specialize_family(dict(shared, _rows2=float_rows2, _ahead=no_ahead, _last=float_last),
                                path, {"TILE": TILE.get(path, 4)}, tag=f"float_{fmt}_decoded")
    bind = {"_passes": direct["passes"], "_decode": direct["decode"], "_passes_decoded": decoded["passes"],
            "DECODE_ONCE": fmt != "float"}
    return specialize(_float_linear, path, bind, tag=f"float_{fmt}")
