"""Vector pieces of the int8 activation quantization (int_linear._quantize_rows), 16 values at a time.

Both give exactly what the scalar loop gives: a maximum of absolute values is the same in any
order, and each value is rounded on its own (float32 product, round half to even, as np.rint).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types

from engine.kernels.simd import _reduce
from engine.kernels.simd_ir import LANES, _F32, _I8, _I32, _addr, _call, _int_arg, _intrinsic, _splat

_VF32 = ir.VectorType(_F32, LANES)
_VI32 = ir.VectorType(_I32, LANES)


@_intrinsic
def abs_max16(typingctx, arr, idx):
    """max |arr[idx + j]| for j < 16 (float32 array, flat index)."""

    def codegen(context, builder, sig, args):
        v = builder.load(_addr(context, builder, sig.args[0], args[0], _int_arg(builder, args[1]), _VF32), align=4)
        a = _call(builder, "llvm.fabs.v16f32", _VF32, [v])
        return _reduce(builder, a, lambda b, x, y: b.select(b.fcmp_ordered(">", x, y), x, y))

    return types.float32(arr, idx), codegen


@_intrinsic
def round_store16(typingctx, src, idx, inv, dst):
    """dst[idx + j] = int8(rint(src[idx + j] * inv)) for j < 16; returns the sum of the 16 values (int32)."""

    def codegen(context, builder, sig, args):
        i = _int_arg(builder, args[1])
        v = builder.load(_addr(context, builder, sig.args[0], args[0], i, _VF32), align=4)
        scaled = builder.fmul(v, _splat(builder, args[2], _VF32))
        q = builder.fptosi(_call(builder, "llvm.roundeven.v16f32", _VF32, [scaled]), _VI32)
        builder.store(builder.trunc(q, ir.VectorType(_I8, LANES)),
                      _addr(context, builder, sig.args[3], args[3], i, ir.VectorType(_I8, LANES)), align=1)
        return _reduce(builder, q, lambda b, x, y: b.add(x, y))

    return types.int32(src, idx, inv, dst), codegen
