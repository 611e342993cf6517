"""LLVM vector plumbing for the SIMD ops: the Vec type Numba carries in registers, and IR helpers."""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model

LANES = 16
_I8, _I16, _I32, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()


class Vec(types.Type):
    """An LLVM vector <count x i8 | i16 | i32 | float>, kept in registers."""

    def __init__(self, kind: str, bits: int, count: int):
        self.kind, self.bits, self.count = kind, bits, count
        super().__init__(name=f"Vec({kind}{bits}x{count})")

    def llvm(self) -> ir.VectorType:
        return ir.VectorType(_F32 if self.kind == "f" else ir.IntType(self.bits), self.count)


@register_model(Vec)
class _VecModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, fe_type.llvm())


def _u8(tt):
    return Vec("i", 8, 64 * tt)


def _i16(tt):
    return Vec("i", 16, 32 * tt)


def _i32(tt):
    return Vec("i", 32, LANES * tt)


def _f32(tt):
    return Vec("f", 32, LANES * tt)


def _tokens(v: Vec, per_token: int) -> int:
    return v.count // per_token


def _literal(tt) -> int:
    if not isinstance(tt, types.IntegerLiteral) or not 1 <= tt.literal_value <= 8:
        raise TypeError(f"the token count must be a literal 1..8, got {tt}")
    return tt.literal_value


# ---------------------------------------------------------------- IR helpers


def _addr(context, builder, aryty, ary, idx, ptr_ty):
    """Pointer to element `idx` (flat, in elements) of a C-contiguous array, cast to ptr_ty."""
    data = context.make_array(aryty)(context, builder, ary).data
    return builder.bitcast(builder.gep(data, [idx]), ptr_ty.as_pointer())


def _splat(builder, scalar, vec_ty: ir.VectorType):
    one = builder.insert_element(ir.Constant(vec_ty, ir.Undefined), scalar, ir.Constant(_I32, 0))
    mask = ir.Constant(ir.VectorType(_I32, vec_ty.count), [0] * vec_ty.count)
    return builder.shuffle_vector(one, ir.Constant(vec_ty, ir.Undefined), mask)


def _lanes(builder, v, indices):
    indices = list(indices)
    return builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, len(indices)), indices))


def _concat2(builder, a, b):
    """a then b as one vector (any two lengths)."""
    n, m = a.type.count, b.type.count
    width = max(n, m)
    a2, b2 = (_lanes(builder, v, list(range(v.type.count)) + [0] * (width - v.type.count)) if v.type.count < width else v
              for v in (a, b))
    mask = list(range(n)) + list(range(width, width + m))
    return builder.shuffle_vector(a2, b2, ir.Constant(ir.VectorType(_I32, n + m), mask))


def _concat(builder, parts):
    while len(parts) > 1:
        merged = [_concat2(builder, a, b) for a, b in zip(parts[0::2], parts[1::2])]
        parts = merged + ([parts[-1]] if len(parts) % 2 else [])
    return parts[0]


def _split(builder, v, num):
    n = v.type.count // num
    return [_lanes(builder, v, range(i * n, (i + 1) * n)) for i in range(num)]


def _call(builder, name: str, ret, args):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, args)


def _index(builder, idx, stride, tt):
    """idx + tt * stride as an i64 value."""
    i64 = ir.IntType(64)
    return builder.add(idx, builder.mul(stride, ir.Constant(i64, tt))) if tt else idx


def _int_arg(builder, v, ty=ir.IntType(64)):
    return builder.sext(v, ty) if v.type.width < ty.width else builder.trunc(v, ty) if v.type.width > ty.width else v


def _per_token(builder, n, fn):
    """Concatenate fn(tt) for tt in 0..n-1 (each a 16-lane piece)."""
    return _concat(builder, [fn(tt) for tt in range(n)])


def _repeat(builder, v, count: int):
    """A 16-lane vector repeated to `count` lanes (a row operand against TT tokens)."""
    return v if v.type.count == count else _lanes(builder, v, [i % v.type.count for i in range(count)])


def _intrinsic(fn):
    return intrinsic(prefer_literal=True)(fn)


_EXP_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)


def _exp_ir(builder, x):
    """e**x per lane of a float vector, for x <= 0 (see simd.f32_exp). The range reduction and the polynomial
    are fused multiply-adds (llvm.fma: one rounding each, so the same bits on every path and CPU): 18
    vector operations, not 26. SwiGLU over 8 x 1,536 values on the Zen 4, one thread: 5.46 -> 4.15 us."""
    ty = x.type
    c = lambda v: _splat(builder, ir.Constant(_F32, v), ty)  # noqa: E731
    fma = lambda a, b, d: _call(builder, f"llvm.fma.v{ty.count}f32", ty, [a, b, d])  # noqa: E731
    x = builder.select(builder.fcmp_ordered("<", x, c(-87.0)), c(-87.0), x)
    n = _call(builder, f"llvm.roundeven.v{ty.count}f32", ty, [builder.fmul(x, c(1.4426950408889634))])
    r = fma(n, c(2.12194440e-4), fma(n, c(-0.693359375), x))  # x - n ln 2, ln 2 in two parts
    p = c(_EXP_POLY[0])
    for coef in _EXP_POLY[1:]:
        p = fma(p, r, c(coef))
    p = builder.fadd(fma(p, builder.fmul(r, r), r), c(1.0))
    ity = ir.VectorType(_I32, ty.count)
    bits = builder.shl(builder.add(builder.fptosi(n, ity), _splat(builder, ir.Constant(_I32, 127), ity)),
                       _splat(builder, ir.Constant(_I32, 23), ity))
    return builder.fmul(p, builder.bitcast(bits, ty))


def _prefetch_codegen(locality: int):
    """Codegen of a prefetch intrinsic (arr, flat idx): llvm.prefetch, read, at `locality` (3: every level, 2: L2)."""

    def codegen(context, builder, sig, args):
        ptr = _addr(context, builder, sig.args[0], args[0], args[1], _I8)
        _call(builder, "llvm.prefetch.p0", ir.VoidType(), [ptr] + [ir.Constant(_I32, v) for v in (0, locality, 1)])
        return context.get_dummy_value()

    return codegen
