"""Integer tiles: 16 weight rows (one strip) x TT tokens; per GGUF format, one block's update.

Plain Python functions, compiled per ISA path by `simd.specialize` (the ops below are bound per
path). `tile` and `pair` walk a strip's blocks and call the format's `*_block` (bound as `_block`)
and `*_ahead` (`_ahead`) by int_linear. Arguments: w = the IntWeight's arrays (int_pack), x =
QuantRows arrays (xq [T, k] int8, xd [T, nb] scale, xm [T, nb] = xd * sum of the block's q, xs
[T, 2 nb] per-16 sums of q), s = the strip, b = the block, t0 = the first token, tt = the literal
token count, f = the running float32 [tt x 16 lanes] sums.

The integer sum of a block (isum) is exact. The float combine, per row, token and block in k order,
with every product and sum rounded to float32 (nothing fused) and a fixed operation order:
  q4_0, q5_0    acc = acc + (d * xd) * float(isum - 8|16 * sum(xq))
  q4_1, q5_1    acc = (acc + (d * xd) * float(isum)) + m * xm
  q8_0          acc = acc + (d * xd) * float(isum)
  iq4_nl        acc = acc + (d * xd) * float(isum)
  lut32(_3)     acc = acc + ((d * sc) * xd) * float(isum)
  q4_k, q5_k    acc = (acc + ((d * sc) * xd) * float(isum)) - (dmin * mn) * xm
  q6_k, q3_k    per half h: acc = acc + ((d * sc_h) * xd) * float(isum_h - 32|4 * sum_h(xq))
  q2_k          per half h: acc = (acc + ((d * sc_h) * xd) * float(isum_h)) - ((dmin * m_h) * xd) * float(sum_h(xq))
  lut16_3       acc = acc + (d * xd) * float(sc_0 * isum_0 + sc_1 * isum_1), per half h (exact integers)
so a row's result depends on nothing but its own activations: not on T, the tile, or the path.

Each block also asks for the weight lines AHEAD blocks further on (software prefetch): at T = 1 the
products wait on memory, and the hardware prefetcher alone kept this VM's two cores at ~14 GB/s.
On the Zen 4 a tile of 4 or more tokens asks L2_AHEAD blocks on, into the L2 only (L2_FROM).
"""

import llvmlite.binding as llvm

from engine.kernels.simd import (  # noqa: F401  (acc_* and dot_s8* are bound per path by specialize)
    bits_at,
    bits_put,
    f32_add,
    f32_from_i32,
    f32_mul,
    f32_sub,
    f32_zero,
    i32_add,
    i32_mul,
    i32_splat,
    i32_sub,
    i32_zero,
    item_bytes,
    prefetch,
    prefetch_l2,
    row_f16,
    row_f32,
    row_hi4,
    row_i8,
    row_i8_i32,
    row_lo4,
    row_u8,
    tok_f32,
    tok_i32,
    wbytes,
    xbcast,
)

# blocks: prefetch the weights this far ahead in the strip-major stream (8 KB of Q4_1 quants). SmolLM2's
# 120 layer matrices in turn, one process, best of 15 (Zen 5, 2 threads): 32 against 16 took T = 1 / 4 / 6 / 8
# 1.25-1.33 / 1.29-1.31 / 1.49-1.51 / 1.77 ms against 1.29-1.35 / 1.41-1.55 / 1.55-1.56 / 1.78-1.80 (24 and 48
# no better); on the Xeon 64 and 96 gave one-token tiles nothing (journal). On the AMD Zen 4 (LLVM `znver4`) 12
# (3 KB): every product of SmolLM2 in compiled loops, one process, ten rounds alternated, 12 against 32, weights on
# huge pages (huge_pages): T = 1 2.52 / 2.17 against 2.58 / 2.30 ms, T = 4 2.70 / 2.87 against 2.88 / 3.07, T = 8
# 4.21 / 4.73 against 4.32 / 4.80 (8 and 16 within 2% of 12); on 4 KB pages T = 1 / 4 / 8 3.32 / 3.48 / 4.79
# against 3.54 / 3.60 / 4.90 (journal, forty-second session). To measure it on another CPU:
# `python -m benchmarks.prefetch_distance`.
AHEAD = 12 if llvm.get_host_cpu_name() == "znver4" else 32
# Tiles of L2_FROM or more tokens ask for lines L2_AHEAD blocks on into the L2 only (simd.prefetch_l2): a tile that
# computes long per block keeps more lines in flight there than in the L1's fill buffers. Zen 4, every product of
# SmolLM2 in compiled loops, one process, ten rounds alternated (benchmarks.prefetch_distance, journal), every tile
# at 12 into the L1 against 24 into the L2: T = 1 3.33 / 2.69 against 3.31 / 2.89 ms, T = 2 3.31 / 2.62 against
# 3.16 / 2.77, T = 4 3.63 / 2.82 against 3.23 / 2.82, T = 8 4.60 / 4.35 against 4.46 / 4.06 (the LM head alone,
# 30 MB of Q8_0 at T = 8, from cold caches: 1.33-1.42 against 1.07-1.09 ms); at T = 1 and 2 the L1 won in faster
# hours. So the L2 from 4 tokens (the setting 12/24@4 against 12, two runs: T = 4 2.90 / 3.21 against 3.05 / 3.08 ms,
# T = 8 4.57 / 4.22 against 4.79 / 4.46; T = 1, 2 the same code). Other CPUs: not measured (9: never).
L2_FROM = 4 if llvm.get_host_cpu_name() == "znver4" else 9
L2_AHEAD = 24
# The format's traits, rebound per format when int_linear compiles a kernel (Numba freezes globals
# as constants, so each format's tile keeps only its own branches and registers):
HIGH_BIT = False  # q5_0 / q5_1 / q5_k: qh holds each weight's fifth bit (q3_k: its third)
OFFSET = False  # q4_0 / q5_0: w = d * (q - 8 | 16), no minimum
LUT_SCALES = 0  # table formats: 0 = d per block (iq4_nl), 32 / 16 = d per super-block and sc per 32 / 16 weights
LUT_BITS = 4  # table formats: 4-bit indices, or 3 (tables of up to 8 values: the IQ2, IQ1 and TQ types)
K16_OFFSET = 32  # q6_k 32, q3_k 4: w = (d * sc) * (q - K16_OFFSET)


def _ask_ahead(a, block, per_block, tt):
    """Prefetch the lines of array `a` (per_block elements per block) for the block AHEAD blocks past `block`, or,
    in a tile of L2_FROM or more tokens (tt literal: the branch is settled when it compiles), L2_AHEAD blocks past
    it, into the L2 only."""
    into_l2 = tt >= L2_FROM
    first = (block + (L2_AHEAD if into_l2 else AHEAD)) * per_block
    for line in range((per_block * item_bytes(a) + 63) // 64):  # constants: the loop unrolls, no division
        if into_l2:
            prefetch_l2(a, first + line * (64 // item_bytes(a)))
        else:
            prefetch(a, first + line * (64 // item_bytes(a)))


def _nibble_sum(qs, qh, xq, wi, hi, xi, k, tt):
    """isum of one block's low (hi=0) or high (hi=1) 16 weights of 5 bits (4 accumulations per flush)."""
    a = acc_zero(tt)  # noqa: F821
    for g in range(4):
        v = bits_put(bits_at(wbytes(qs, wi + 64 * g), 4 * hi, 15), bits_at(wbytes(qh, wi // 4), 4 * hi + g, 1), 4)
        a = acc_add(a, v, xbcast(xq, xi + 16 * hi + 4 * g, k, tt))  # noqa: F821
    return acc_i32(a)  # noqa: F821


def _block_isum(qs, qh, xq, wi, xi, k, tt):
    """Exact isum of a block of 4-bit (qh of 1 byte: one pass, 8 accumulations) or 5-bit weights."""
    if HIGH_BIT:
        return i32_add(_nibble_sum(qs, qh, xq, wi, 0, xi, k, tt), _nibble_sum(qs, qh, xq, wi, 1, xi, k, tt))
    a = acc_zero(tt)  # noqa: F821
    for g in range(4):
        v = wbytes(qs, wi + 64 * g)
        a = acc_add(a, bits_at(v, 0, 15), xbcast(xq, xi + 4 * g, k, tt))  # noqa: F821
        a = acc_add(a, bits_at(v, 4, 15), xbcast(xq, xi + 16 + 4 * g, k, tt))  # noqa: F821
    return acc_i32(a)  # noqa: F821


def tile(w, x, s, t0, tt):
    """Strip s x tokens t0 .. t0 + tt - 1 (tt literal): float32 [tt x 16 lanes]."""
    nb = x[0].shape[1] // 32
    f = f32_zero(tt)
    for b in range(nb):
        f = _block(w, x, s, b, t0, tt, f)  # noqa: F821
        # The prefetch after the block: before it, LLVM's scheduler ordered a tile of 8 token by token (8
        # dependent vpdpbusd in a row) instead of 4-dot group by group, 6-11% slower at T = 8 (Xeon, journal).
        _ahead(w, s * nb + b, tt)  # noqa: F821  (the format's, bound by int_linear)
    return f


def pair(w, x, s, t0, ta, tb):
    """tile() of tokens t0.. (ta) and t0 + ta.. (tb) in one pass over the strip's blocks: the weights are
    loaded and unpacked once for both (LLVM merges the repeated loads), and each token's sums and combine
    are its own, so every row gets tile()'s bits. Returns (float32 [ta x 16], float32 [tb x 16])."""
    nb = x[0].shape[1] // 32
    fa = f32_zero(ta)
    fb = f32_zero(tb)
    for b in range(nb):
        _ahead(w, s * nb + b, ta)  # noqa: F821  (ta: 4, the larger tile)
        fa = _block(w, x, s, b, t0, ta, fa)  # noqa: F821
        fb = _block(w, x, s, b, t0 + ta, tb, fb)  # noqa: F821
    return fa, fb


def legacy_ahead(w, sb, tt):
    """Ask for the lines of a strip-block ahead of sb = s * nb + b (`_ask_ahead`)."""
    qs, qh, d, m = w
    _ask_ahead(qs, sb, 256, tt)
    _ask_ahead(qh, sb, 64 if HIGH_BIT else 0, tt)
    _ask_ahead(d, sb, 16, tt)
    _ask_ahead(m, sb, 0 if OFFSET else 16, tt)


def legacy_block(w, x, s, b, t0, tt, f):
    """q4_0 / q5_0 (w = (qs, qh, d, offset), OFFSET) and q4_1 / q5_1 (w = (qs, qh, d, m)); qh has 1 byte without HIGH_BIT."""
    qs, qh, d, m = w
    xq, xd, xm, xs = x
    k = xq.shape[1]
    nb = k // 32
    isum = _block_isum(qs, qh, xq, (s * nb + b) * 256, t0 * k + b * 32, k, tt)
    li, xi = (s * nb + b) * 16, t0 * nb + b
    if OFFSET:
        sums = i32_add(tok_i32(xs, 2 * xi, 2 * nb, tt), tok_i32(xs, 2 * xi + 1, 2 * nb, tt))
        isum = i32_sub(isum, i32_mul(sums, i32_splat(m[0], tt)))
    f = f32_add(f, f32_mul(f32_mul(row_f16(d, li), tok_f32(xd, xi, nb, tt)), f32_from_i32(isum)))
    if not OFFSET:
        f = f32_add(f, f32_mul(row_f16(m, li), tok_f32(xm, xi, nb, tt)))
    return f


def q8_0_ahead(w, sb, tt):
    """Ask for the lines of a strip-block ahead of sb = s * nb + b (`_ask_ahead`)."""
    qs, d = w
    _ask_ahead(qs, sb, 512, tt)
    _ask_ahead(d, sb, 16, tt)


def q8_0_block(w, x, s, b, t0, tt, f):
    """q8_0: w = (qs int8, d)."""
    qs, d = w
    xq, xd, xm, xs = x
    k = xq.shape[1]
    nb = k // 32
    isum = i32_zero(tt)
    for g in range(8):
        isum = dot_s8(isum, wbytes(qs, (s * nb + b) * 512 + 64 * g), xbcast(xq, t0 * k + b * 32 + 4 * g, k, tt))  # noqa: F821
    xi = t0 * nb + b
    isum = dot_s8_done(isum, i32_add(tok_i32(xs, 2 * xi, 2 * nb, tt), tok_i32(xs, 2 * xi + 1, 2 * nb, tt)))  # noqa: F821
    return f32_add(f, f32_mul(f32_mul(row_f16(d, (s * nb + b) * 16), tok_f32(xd, xi, nb, tt)), f32_from_i32(isum)))


def lut_ahead(w, sb, tt):
    """Ask for the lines of a strip-block ahead of sb = s * nb + b (`_ask_ahead`); a d per super-block is not asked."""
    lo, hi, d, sc, _ = w
    _ask_ahead(lo, sb, 256 if LUT_BITS == 4 else 128, tt)
    _ask_ahead(hi, sb, 0 if LUT_BITS == 4 else 64, tt)
    _ask_ahead(d, sb, 16 if LUT_SCALES == 0 else 0, tt)
    _ask_ahead(sc, sb, 0 if LUT_SCALES == 0 else 16 * 32 // LUT_SCALES, tt)


def _lut_dots(isum, lo, hi, lut, xq, wi, half, xi, k, tt):
    """isum + the dot_s8 sums of a block's low (half=0) or high (half=1) 16 weights, their table indices looked up
    in lut: 4-bit indices (nibbles) or, with LUT_BITS 3, 2 bits (crumbs) and a third bit in hi."""
    crumbs = wbytes(lo, wi // 2 + 64 * half)  # (unused with 4-bit indices: the load is dropped)
    for g in range(4):
        if LUT_BITS == 4:
            v = bits_at(wbytes(lo, wi + 64 * g), 4 * half, 15)
        else:
            v = bits_put(bits_at(crumbs, 2 * g, 3), bits_at(wbytes(hi, wi // 4), 4 * half + g, 1), 2)
        isum = dot_s8(isum, lut_values(lut, v), xbcast(xq, xi + 16 * half + 4 * g, k, tt))  # noqa: F821
    return isum


def lut_block(w, x, s, b, t0, tt, f):
    """Table formats: w = (lo, hi: table indices, as q4_0's nibbles (hi unused) or, with LUT_BITS 3, as q3_k's
    crumbs and third bits; d; sc int8; table: 16 int8 values, 4 times). LUT_SCALES 0 (iq4_nl): d fp16 per block,
    no sc; 32 or 16: d float32 per super-block and sc per 32 or per 16 weights (w = (d * sc) * table[q])."""
    lo, hi, d, sc, table = w
    xq, xs = x[0], x[3]
    k, nb, si, bi, dx = _per_16_at(x, s, b, t0, tt)
    wi, xi, lut = (s * nb + b) * 256, t0 * k + b * 32, wbytes(table, 0)
    if LUT_SCALES == 16:  # the halves' sums times their scales, added as integers: < 2 x 16 x 127 x 43 x 31 < 2**24
        isum = i32_zero(tt)
        for h in range(2):
            half = _lut_dots(i32_zero(tt), lo, hi, lut, xq, wi, h, xi, k, tt)
            half = dot_s8_done(half, tok_i32(xs, 2 * bi + h, 2 * nb, tt))  # noqa: F821
            isum = i32_add(isum, i32_mul(half, row_i8_i32(sc, (s * 2 * nb + 2 * b + h) * 16)))
        return f32_add(f, f32_mul(f32_mul(row_f32(d, si), dx), f32_from_i32(isum)))
    isum = _lut_dots(_lut_dots(i32_zero(tt), lo, hi, lut, xq, wi, 0, xi, k, tt), lo, hi, lut, xq, wi, 1, xi, k, tt)
    isum = dot_s8_done(isum, i32_add(tok_i32(xs, 2 * bi, 2 * nb, tt), tok_i32(xs, 2 * bi + 1, 2 * nb, tt)))  # noqa: F821
    if LUT_SCALES == 32:
        scale = f32_mul(row_f32(d, si), row_i8(sc, (s * nb + b) * 16))  # exact: 11 x 6 significant bits
    else:
        scale = row_f16(d, (s * nb + b) * 16)
    return f32_add(f, f32_mul(f32_mul(scale, dx), f32_from_i32(isum)))


def kquant_ahead(w, sb, tt):
    """Ask for the lines of a strip-block ahead of sb = s * nb + b (`_ask_ahead`)."""
    qs, qh, _, _, sc, mn = w
    _ask_ahead(qs, sb, 256, tt)
    _ask_ahead(qh, sb, 64 if HIGH_BIT else 0, tt)
    _ask_ahead(sc, sb, 16, tt)
    _ask_ahead(mn, sb, 16, tt)


def kquant_block(w, x, s, b, t0, tt, f):
    """q4_k / q5_k: w = (qs, qh, d, dmin, sc, mn); qh has 1 byte for q4_k."""
    qs, qh, d, dmin, sc, mn = w
    xq, xd, xm, xs = x
    k = xq.shape[1]
    nb = k // 32
    isum = _block_isum(qs, qh, xq, (s * nb + b) * 256, t0 * k + b * 32, k, tt)
    li, si, xi = (s * nb + b) * 16, (s * (nb // 8) + b // 8) * 16, t0 * nb + b
    scale = f32_mul(row_f16(d, si), row_u8(sc, li))  # exact: 11 x 6 significant bits
    low = f32_mul(row_f16(dmin, si), row_u8(mn, li))
    f = f32_add(f, f32_mul(f32_mul(scale, tok_f32(xd, xi, nb, tt)), f32_from_i32(isum)))
    return f32_sub(f, f32_mul(low, tok_f32(xm, xi, nb, tt)))


def _q6_half(qs, qh2, xq, wi, hi, xi, k, tt):
    """isum of one block half of 6-bit weights (2 accumulations per 16-bit flush)."""
    isum = i32_zero(tt)
    for pair in range(2):
        a = acc_zero(tt)  # noqa: F821
        for g in range(2 * pair, 2 * pair + 2):
            v = bits_put(bits_at(wbytes(qs, wi + 64 * g), 4 * hi, 15), bits_at(wbytes(qh2, wi // 2 + 64 * hi), 2 * g, 3), 4)
            a = acc_add(a, v, xbcast(xq, xi + 16 * hi + 4 * g, k, tt))  # noqa: F821
        isum = i32_add(isum, acc_i32(a))  # noqa: F821
    return isum


def _crumb_half(qc, qh, xq, wi, hi, xi, k, tt):
    """isum of one block half of 2-bit weights, or 3-bit with HIGH_BIT (q3_k: the third bit in qh), in one
    16-bit flush (4 accumulations of at most 2 x 7 x 128)."""
    crumbs = wbytes(qc, wi // 2 + 64 * hi)
    a = acc_zero(tt)  # noqa: F821
    for g in range(4):
        v = bits_at(crumbs, 2 * g, 3)
        if HIGH_BIT:
            v = bits_put(v, bits_at(wbytes(qh, wi // 4), 4 * hi + g, 1), 2)
        a = acc_add(a, v, xbcast(xq, xi + 16 * hi + 4 * g, k, tt))  # noqa: F821
    return acc_i32(a)  # noqa: F821


def _per_16_at(x, s, b, t0, tt):
    """For the formats with a scale per 16 weights or a d per super-block: (k, blocks a row, the super-block's
    lane row si, the tokens' block xi, their activation scales dx)."""
    nb = x[0].shape[1] // 32
    xi = t0 * nb + b
    return x[0].shape[1], nb, (s * (nb // 8) + b // 8) * 16, xi, tok_f32(x[1], xi, nb, tt)


def k16_ahead(w, sb, tt):
    """Ask for the lines of a strip-block ahead of sb = s * nb + b (`_ask_ahead`)."""
    lo, hi, _, sc = w
    _ask_ahead(lo, sb, 256 if K16_OFFSET == 32 else 128, tt)
    _ask_ahead(hi, sb, 128 if K16_OFFSET == 32 else 64, tt)
    _ask_ahead(sc, sb, 32, tt)


def k16_block(w, x, s, b, t0, tt, f):
    """q6_k (w = (qs, qh2, d, sc)) and q3_k (w = (crumbs, qh, d, sc)): w = (d * sc) * (q - K16_OFFSET), an
    int8 scale sc per 16 weights, d per super-block."""
    lo, hi, d, sc = w
    xq, xs = x[0], x[3]
    k, nb, si, xi, dx = _per_16_at(x, s, b, t0, tt)
    for h in range(2):
        if K16_OFFSET == 32:
            isum = _q6_half(lo, hi, xq, (s * nb + b) * 256, h, t0 * k + b * 32, k, tt)
        else:
            isum = _crumb_half(lo, hi, xq, (s * nb + b) * 256, h, t0 * k + b * 32, k, tt)
        isum = i32_sub(isum, i32_mul(tok_i32(xs, 2 * xi + h, 2 * nb, tt), i32_splat(K16_OFFSET, tt)))
        scale = f32_mul(row_f16(d, si), row_i8(sc, (s * 2 * nb + 2 * b + h) * 16))  # exact: 11 x 6 significant bits
        f = f32_add(f, f32_mul(f32_mul(scale, dx), f32_from_i32(isum)))
    return f


def q2_k_ahead(w, sb, tt):
    """Ask for the lines of a strip-block ahead of sb = s * nb + b (`_ask_ahead`)."""
    qc, _, _, scm = w
    _ask_ahead(qc, sb, 128, tt)
    _ask_ahead(scm, sb, 32, tt)


def q2_k_block(w, x, s, b, t0, tt, f):
    """q2_k: w = (crumbs, d, dmin, sc | m << 4 per 16); per half: w = (d * sc) * q - dmin * m."""
    qc, d, dmin, scm = w
    xq, xs = x[0], x[3]
    k, nb, si, xi, dx = _per_16_at(x, s, b, t0, tt)
    for h in range(2):
        isum = _crumb_half(qc, qc, xq, (s * nb + b) * 256, h, t0 * k + b * 32, k, tt)
        li = (s * 2 * nb + 2 * b + h) * 16
        scale = f32_mul(row_f16(d, si), row_lo4(scm, li))  # exact: 11 x 4 significant bits
        low = f32_mul(row_f16(dmin, si), row_hi4(scm, li))
        f = f32_add(f, f32_mul(f32_mul(scale, dx), f32_from_i32(isum)))
        f = f32_sub(f, f32_mul(f32_mul(low, dx), f32_from_i32(tok_i32(xs, 2 * xi + h, 2 * nb, tt))))
    return f
