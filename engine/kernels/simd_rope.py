"""RoPE on adjacent pairs, 16 values (8 pairs) at a time (ops._rope_adjacent).

A pair (a, b) at angle (c, s) becomes (a * c - b * s, a * s + b * c). Per lane the vector code
computes v * c - swap(v) * s on even lanes and v * c + swap(v) * s on odd ones (swap exchanges the
two values of each pair). Each product and sum is rounded on its own, never fused, and
x - y * s = x + (-(y * s)) and a sum is the same in either order, so both give the scalar loop's bits.
"""

from __future__ import annotations

from llvmlite import ir

from engine.kernels.simd_ir import LANES, _F32, _I32, _addr, _f32, _int_arg, _intrinsic

_VF32 = ir.VectorType(_F32, LANES)
_HALF = ir.VectorType(_F32, LANES // 2)


def _mask(indices):
    indices = list(indices)
    return ir.Constant(ir.VectorType(_I32, len(indices)), indices)


@_intrinsic
def rotate_pairs16(typingctx, row, idx, cos_row, sin_row, cidx):
    """row[idx:idx+16] (8 adjacent pairs) rotated by the angles cos_row/sin_row[cidx:cidx+8] (flat indices,
    float32 arrays); a 16-lane vector for store_rows."""

    def codegen(context, builder, sig, args):
        def load(k, at, vec_ty):  # args[k][args[at]:] as vec_ty
            return builder.load(_addr(context, builder, sig.args[k], args[k], _int_arg(builder, args[at]), vec_ty), align=4)

        v, c8, s8 = load(0, 1, _VF32), load(2, 4, _HALF), load(3, 4, _HALF)
        twice = _mask(i // 2 for i in range(LANES))  # each pair's angle in both of its lanes
        c, s = builder.shuffle_vector(c8, c8, twice), builder.shuffle_vector(s8, s8, twice)
        swapped = builder.shuffle_vector(v, v, _mask(i ^ 1 for i in range(LANES)))
        vc, ws = builder.fmul(v, c), builder.fmul(swapped, s)
        return builder.shuffle_vector(builder.fsub(vc, ws), builder.fadd(vc, ws),
                                      _mask(i if i % 2 == 0 else LANES + i for i in range(LANES)))

    return _f32(1)(row, idx, cos_row, sin_row, cidx), codegen
