"""Vector int8 activation quantization (int_linear._quantize_rows): a few blocks of 32 per call.

Per block of 32 values: scale = max|x| / 127 (float32), inverse = 1 / scale (0 for an all-zero block),
q = int8(round-half-even(x * inverse)) (each product rounded on its own, as np.rint), the two sums of
16 q values, and xm = scale * float(their sum). These are the scalar definition's values exactly: a
maximum is the same in any order, and the sums are exact integers.

The blocks of one call share their folds: the maxima (or sums) of several 16-lane vectors are folded
side by side, halves of two vectors in one vector, so n blocks cost about one fold, not n. Measured on
the Xeon (avx512, one thread, in a compiled loop): 8 rows of 576 values 2.1 -> 1.3 us, of 1536 6.7 -> 3.3 us
(with int_linear's flat indices in place of row views). Calls of 8 blocks instead of 4, on the Zen 4: 1.13 -> 0.87
and 2.93 -> 2.2 us; compiled for the Zen 3 (AVX2 only, by NUMBA_CPU_NAME and NUMBA_CPU_FEATURES) and run on the
Zen 4, 1.26 -> 1.14-1.19 and 3.42 -> 2.79 us.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types

from engine.kernels.simd import _pick_larger
from engine.kernels.simd_ir import (
    _F32,
    _I8,
    _I32,
    LANES,
    _addr,
    _call,
    _int_arg,
    _intrinsic,
    _lanes,
    _splat,
)

_VF32 = ir.VectorType(_F32, LANES)
_VI32 = ir.VectorType(_I32, LANES)
_VI8 = ir.VectorType(_I8, LANES)


def _halves(sources: int, offset: int = 0):
    """Lane indices of the first and of the second half of each source's segment of a 16-lane vector."""
    seg = LANES // sources
    first = [offset + s * seg + j for s in range(sources) for j in range(seg // 2)]
    return first, [i + seg // 2 for i in first]


def fold_side_by_side(builder, vectors, combine):
    """n (a power of two <= 16) vectors of 16 lanes -> a vector of n lanes, lane i the fold of vector i."""
    level, sources = list(vectors), 1
    while len(level) > 1:  # pair vectors: each source's segment halves, the halves combined
        first_a, second_a = _halves(sources)
        first_b, second_b = _halves(sources, LANES)
        mask = lambda idx: ir.Constant(ir.VectorType(_I32, LANES), idx)  # noqa: E731
        level = [combine(builder, builder.shuffle_vector(a, b, mask(first_a + first_b)),
                         builder.shuffle_vector(a, b, mask(second_a + second_b)))
                 for a, b in zip(level[0::2], level[1::2])]
        sources *= 2
    v = level[0]
    while v.type.count > sources:  # fold within each source's segment
        seg = v.type.count // sources
        first = [s * seg + j for s in range(sources) for j in range(seg // 2)]
        v = combine(builder, _lanes(builder, v, first), _lanes(builder, v, [i + seg // 2 for i in first]))
    return v


@_intrinsic
def quantize_blocks(typingctx, src, idx, xq, xd, xm, xs, block, count):
    """Quantize `count` (literal 1, 2 or 4) blocks of 32 from src at flat index idx (float32) into block
    `block` (flat, in blocks, of C-contiguous arrays): xq[32 block + j] the int8 values, and for each
    block i: xd[block + i] its scale, xs[2 (block + i) + h] its sums of 16, xm[block + i] = scale * float(sum)."""
    n = count.literal_value if isinstance(count, types.IntegerLiteral) else None
    if n not in (1, 2, 4, 8):
        raise TypeError(f"quantize_blocks: count must be a literal 1, 2, 4 or 8, got {count}")

    def codegen(context, builder, sig, args):
        i = _int_arg(builder, args[1])
        blk = _int_arg(builder, args[6])
        i64 = ir.IntType(64)
        c64 = lambda v: ir.Constant(i64, v)  # noqa: E731
        vals = [builder.load(_addr(context, builder, sig.args[0], args[0], builder.add(i, c64(16 * h)), _VF32), align=4)
                for h in range(2 * n)]
        iq = builder.mul(blk, c64(32))
        absv = [_call(builder, "llvm.fabs.v16f32", _VF32, [v]) for v in vals]
        peaks = [_pick_larger(builder, absv[2 * b], absv[2 * b + 1]) for b in range(n)]
        amax = fold_side_by_side(builder, peaks, _pick_larger)  # [n]
        vn = ir.VectorType(_F32, n)
        scale = builder.fdiv(amax, _splat(builder, ir.Constant(_F32, 127.0), vn))
        zero = ir.Constant(vn, [0.0] * n)
        inv = builder.select(builder.fcmp_ordered(">", scale, zero),
                             builder.fdiv(_splat(builder, ir.Constant(_F32, 1.0), vn), scale), zero)
        qs = []
        for h in range(2 * n):
            lane_inv = _lanes(builder, inv, [h // 2] * LANES)
            r = _call(builder, "llvm.roundeven.v16f32", _VF32, [builder.fmul(vals[h], lane_inv)])
            q = builder.fptosi(r, _VI32)
            builder.store(builder.trunc(q, _VI8), _addr(context, builder, sig.args[2], args[2], builder.add(iq, c64(16 * h)), _VI8),
                          align=1)
            qs.append(q)
        sums = fold_side_by_side(builder, qs, lambda b, x, y: b.add(x, y))  # [2n]: each block's two sums of 16
        vi2 = ir.VectorType(_I32, 2 * n)
        builder.store(sums, _addr(context, builder, sig.args[5], args[5], builder.add(blk, blk), vi2), align=4)
        total = builder.add(_lanes(builder, sums, range(0, 2 * n, 2)), _lanes(builder, sums, range(1, 2 * n, 2)))  # [n]
        builder.store(scale, _addr(context, builder, sig.args[3], args[3], blk, vn), align=4)
        builder.store(builder.fmul(scale, builder.sitofp(total, vn)), _addr(context, builder, sig.args[4], args[4], blk, vn), align=4)
        return context.get_dummy_value()

    return types.none(src, idx, xq, xd, xm, xs, block, count), codegen
