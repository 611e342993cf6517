"""Integer SIMD for Numba kernels: LLVM vectors as Numba values, one op set per ISA path.

Lanes are the 16 output rows of a weight strip (see int_pack). A weight vector is U8x64: 16 rows x
4 consecutive k. An activation vector holds, for each of TT tokens, that token's 4 int8 values at
the same k repeated in all 16 lanes, so a "4-dot" adds to every lane the 4 products of its row with
its token's 4 values. No horizontal sums: each lane's integer sum is exact, whatever instruction
computed it. Values for TT tokens are one vector of TT x 16 lanes (token-major); TT (1..4) is a
compile-time literal, and each op unrolls its work over the tokens as it generates code.

Kernels are written once against these ops and compiled per path (`specialize`):
  avx512    512-bit vpdpbusd (AVX-512 VNNI): one instruction per 4-dot of 16 lanes, and the kernels'
            16-lane float vectors in one zmm register each (simd_paths._wide_registers)
  vnni      two 256-bit vpdpbusd (AVX-VNNI, or AVX-512 VNNI + VL)
  avx2      vpmaddubsw into 16-bit pair sums, widened by vpmaddwd (AVX2)
  portable  plain LLVM vector IR, lowered by LLVM for whatever CPU runs it
Integer sums are identical on every path, and the float ops (fmul, fadd, fsub, never contracted, no
fast-math flags; llvm.fma only in f32_fma and the vector exp) are the same IR on every path, so
every path gives the same bits. (The integer tiles keep their block combine unfused: fused, it
measured ~30% slower at T = 4-16 on the Zen 3.)

Bound: the AVX2 accumulator keeps 16-bit pair sums, so a kernel adds at most
32767 // (2 * max|w| * 127) 4-dots into one `acc` before `acc_i32` (8 for 4-bit weights, 4 for
5-bit, 2 for 6-bit); `dot_s8` (signed 8-bit weights) widens every time.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types

from engine.kernels.simd_ir import (  # noqa: F401  (LANES: part of this module's interface)
    Vec, LANES, _I8, _I16, _I32, _F32, _u8, _i32, _f32, _tokens, _literal, _addr, _splat, _split,
    _call, _index, _int_arg, _per_token, _repeat, _intrinsic, _exp_ir, _prefetch_codegen,
)
from engine.kernels.simd_paths import PATH_OPS, PATHS, specialize, specialize_family, wide_registers  # noqa: F401

# ---------------------------------------------------------------- loads and stores (every path)


@_intrinsic
def wbytes(typingctx, arr, idx):
    """64 weight bytes at arr[idx:] (uint8 or int8 array, flat index): 16 rows x 4 k."""

    def codegen(context, builder, sig, args):
        return builder.load(_addr(context, builder, sig.args[0], args[0], args[1], _u8(1).llvm()), align=1)

    return _u8(1)(arr, idx), codegen


@_intrinsic
def item_bytes(typingctx, arr):
    """arr's element size in bytes as a compile-time constant. (`arr.itemsize` is read from the array at run
    time, so `64 // arr.itemsize` in a block loop compiled to an integer division per block.)"""

    def codegen(context, builder, sig, args):
        return context.get_constant(types.intp, sig.args[0].dtype.bitwidth // 8)

    return types.intp(arr), codegen


@_intrinsic
def prefetch(typingctx, arr, idx):
    """Ask for the cache line holding arr[idx] into every cache level (flat index; never faults, even past the end)."""
    return types.none(arr, idx), _prefetch_codegen(3)


@_intrinsic
def prefetch_l2(typingctx, arr, idx):
    """`prefetch` into the L2 only (prefetcht1): a line asked for far ahead waits there, not in an L1 fill buffer."""
    return types.none(arr, idx), _prefetch_codegen(2)


def _token_loader(elem, vec, name, doc, as_bytes=False):
    """An intrinsic (arr, idx, stride, tt): per token t, one `elem` at idx + t * stride in all 16 lanes
    (as_bytes: an unaligned 4-byte word, handed back as its 64 bytes)."""

    def load(typingctx, arr, idx, stride, tt):
        n = _literal(tt)

        def codegen(context, builder, sig, args):
            i, s = _int_arg(builder, args[1]), _int_arg(builder, args[2])

            def piece(t):
                ptr = _addr(context, builder, sig.args[0], args[0], _index(builder, i, s, t), elem)
                return _splat(builder, builder.load(ptr, align=1 if as_bytes else None), vec(1).llvm())

            v = _per_token(builder, n, piece)
            return builder.bitcast(v, _u8(n).llvm()) if as_bytes else v

        return (_u8 if as_bytes else vec)(n)(arr, idx, stride, tt), codegen

    load.__doc__, load.__name__ = doc, name
    return _intrinsic(load)


xbcast = _token_loader(_I32, _i32, "xbcast", "For each of tt tokens, the 4 int8 at arr[idx + t * stride:][:4] "
                       "repeated in 16 lanes.", as_bytes=True)
tok_f32 = _token_loader(_F32, _f32, "tok_f32", "For each of tt tokens, the float32 arr[idx + t * stride] in all 16 lanes.")
tok_i32 = _token_loader(_I32, _i32, "tok_i32", "For each of tt tokens, the int32 arr[idx + t * stride] in all 16 lanes.")


def _row_loader(src_elem, convert, doc):
    @_intrinsic
    def load(typingctx, arr, idx):
        def codegen(context, builder, sig, args):
            v = builder.load(_addr(context, builder, sig.args[0], args[0], args[1], ir.VectorType(src_elem, LANES)), align=1)
            return convert(builder, v, _f32(1).llvm())

        return _f32(1)(arr, idx), codegen

    load.__doc__ = doc
    return load


row_f16 = _row_loader(ir.HalfType(), lambda b, v, t: b.fpext(v, t), "16 fp16 (uint16 array) as float32, exact")
row_u8 = _row_loader(_I8, lambda b, v, t: b.uitofp(v, t), "16 uint8 as float32")
row_i8 = _row_loader(_I8, lambda b, v, t: b.sitofp(v, t), "16 int8 as float32")


@_intrinsic
def row_i8_i32(typingctx, arr, idx):
    """16 int8 at arr[idx:] as int32 lanes."""

    def codegen(context, builder, sig, args):
        v = builder.load(_addr(context, builder, sig.args[0], args[0], args[1], ir.VectorType(_I8, LANES)), align=1)
        return builder.sext(v, _i32(1).llvm())

    return _i32(1)(arr, idx), codegen


row_lo4 = _row_loader(_I8, lambda b, v, t: b.uitofp(b.and_(v, ir.Constant(v.type, [15] * LANES)), t),
                      "the low nibbles of 16 uint8 as float32")
row_hi4 = _row_loader(_I8, lambda b, v, t: b.uitofp(b.lshr(v, ir.Constant(v.type, [4] * LANES)), t),
                      "the high nibbles of 16 uint8 as float32")


@_intrinsic
def load_rows(typingctx, arr, idx, stride, tt):
    """For each of tt rows, the 16 float32 at arr[idx + t * stride:] (the inverse of store_rows)."""
    n = _literal(tt)

    def codegen(context, builder, sig, args):
        i, s = _int_arg(builder, args[1]), _int_arg(builder, args[2])
        ty = _f32(1).llvm()
        return _per_token(builder, n, lambda t: builder.load(
            _addr(context, builder, sig.args[0], args[0], _index(builder, i, s, t), ty), align=4))

    return _f32(n)(arr, idx, stride, tt), codegen


def _store_pieces(context, builder, sig, args, pieces) -> None:
    """Store pieces[t] (16 float32) to arr[idx + t * stride:], its first `count` lanes (args as store_rows)."""
    i, s, c = _int_arg(builder, args[1]), _int_arg(builder, args[2]), _int_arg(builder, args[4], _I32)
    lane_ids = ir.Constant(ir.VectorType(_I32, LANES), list(range(LANES)))
    mask = builder.icmp_signed("<", lane_ids, _splat(builder, c, ir.VectorType(_I32, LANES)))
    for t, piece in enumerate(pieces):
        ptr = _addr(context, builder, sig.args[0], args[0], _index(builder, i, s, t), _f32(1).llvm())
        _call(builder, "llvm.masked.store.v16f32.p0", ir.VoidType(), [piece, ptr, ir.Constant(_I32, 4), mask])


@_intrinsic
def store_rows(typingctx, arr, idx, stride, v, count):
    """Token t's first `count` lanes of v to arr[idx + t * stride:] (float32 array, flat index)."""
    n = _tokens(v, LANES)

    def codegen(context, builder, sig, args):
        _store_pieces(context, builder, sig, args, _split(builder, args[3], n))
        return context.get_dummy_value()

    return types.none(arr, idx, stride, v, count), codegen


@_intrinsic
def store_first_rows(typingctx, arr, idx, stride, v, count, tokens):
    """store_rows for the first `tokens` (a constant) tokens of v only: a padded tile's last rows are scratch."""
    n, keep = _tokens(v, LANES), _literal(tokens)

    def codegen(context, builder, sig, args):
        _store_pieces(context, builder, sig, args, _split(builder, args[3], n)[:keep])
        return context.get_dummy_value()

    return types.none(arr, idx, stride, v, count, tokens), codegen


# ---------------------------------------------------------------- lane arithmetic (every path)


def _binary(name, build):
    @_intrinsic
    def op(typingctx, a, b):
        out = a if a.count >= b.count else b

        def codegen(context, builder, sig, args):
            x, y = args
            n = out.count
            return build(builder, _repeat(builder, x, n), _repeat(builder, y, n))

        return out(a, b), codegen

    op.__name__ = name
    return op


f32_add = _binary("f32_add", lambda b, x, y: b.fadd(x, y))
f32_sub = _binary("f32_sub", lambda b, x, y: b.fsub(x, y))
f32_mul = _binary("f32_mul", lambda b, x, y: b.fmul(x, y))  # a 16-lane operand is repeated for each token
i32_add = _binary("i32_add", lambda b, x, y: b.add(x, y))
i32_sub = _binary("i32_sub", lambda b, x, y: b.sub(x, y))
i32_mul = _binary("i32_mul", lambda b, x, y: b.mul(x, y))


@_intrinsic
def f32_fma(typingctx, a, b, c):
    """a * b + c per lane, rounded once (llvm.fma: the same bits on every CPU; a 16-lane a or b is
    repeated for each token)."""
    out = max((a, b, c), key=lambda v: v.count)

    def codegen(context, builder, sig, args):
        n = out.count
        x, y, z = (_repeat(builder, v, n) for v in args)
        return _call(builder, f"llvm.fma.v{n}f32", out.llvm(), [x, y, z])

    return out(a, b, c), codegen


@_intrinsic
def f32_zero(typingctx, tt):
    n = _literal(tt)
    return _f32(n)(tt), lambda context, builder, sig, args: ir.Constant(_f32(n).llvm(), [0.0] * LANES * n)


@_intrinsic
def i32_zero(typingctx, tt):
    n = _literal(tt)
    return _i32(n)(tt), lambda context, builder, sig, args: ir.Constant(_i32(n).llvm(), [0] * LANES * n)


@_intrinsic
def f32_from_i32(typingctx, v):
    out = _f32(_tokens(v, LANES))
    return out(v), lambda context, builder, sig, args: builder.sitofp(args[0], out.llvm())  # exact below 2**24


@_intrinsic
def i32_splat(typingctx, s, tt):
    """The integer s in every lane of tt tokens."""
    n = _literal(tt)

    def codegen(context, builder, sig, args):
        return _splat(builder, _int_arg(builder, args[0], _I32), _i32(n).llvm())

    return _i32(n)(s, tt), codegen


def _byte_op(name, build):
    @_intrinsic
    def op(typingctx, v, a, b):
        def codegen(context, builder, sig, args):
            ty = _u8(1).llvm()
            sa, sb = (_splat(builder, builder.trunc(x, _I8) if x.type.width > 8 else x, ty) for x in args[1:])
            return build(builder, args[0], sa, sb)

        return _u8(1)(v, a, b), codegen

    op.__name__ = name
    return op


bits_at = _byte_op("bits_at", lambda b, v, shift, mask: b.and_(b.lshr(v, shift), mask))  # (v >> s) & m per byte


@_intrinsic
def bits_put(typingctx, v, hi, shift):
    """v | (hi << shift) per byte (hi: another U8x64)."""

    def codegen(context, builder, sig, args):
        s = args[2]
        s = _splat(builder, builder.trunc(s, _I8) if s.type.width > 8 else s, _u8(1).llvm())
        return builder.or_(args[0], builder.shl(args[1], s))

    return _u8(1)(v, hi, shift), codegen


@_intrinsic
def row_f32(typingctx, arr, idx):
    """16 values at arr[idx:] as float32, exact: a float32 array as is, a uint16 array as fp16 bits, an int16
    array as bf16 bits, an int8 array as integers."""
    kind = {types.uint16: "half", types.int16: "bf16", types.int8: "int8"}.get(arr.dtype, "float")

    def codegen(context, builder, sig, args):
        src = ir.VectorType({"half": ir.HalfType(), "bf16": _I16, "int8": _I8, "float": _F32}[kind], LANES)
        v = builder.load(_addr(context, builder, sig.args[0], args[0], args[1], src), align=1)
        if kind == "float":
            return v
        if kind == "bf16":  # bf16 bits are the high half of a float32's
            wide = builder.shl(builder.zext(v, _i32(1).llvm()), ir.Constant(_i32(1).llvm(), [16] * LANES))
            return builder.bitcast(wide, _f32(1).llvm())
        return builder.fpext(v, _f32(1).llvm()) if kind == "half" else builder.sitofp(v, _f32(1).llvm())

    return _f32(1)(arr, idx), codegen


@_intrinsic
def f16_bits(typingctx, x):
    """float32 -> its nearest fp16 (ties to even), as uint16 bits."""

    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), _I16)

    return types.uint16(types.float32), codegen


@_intrinsic
def f32_splat(typingctx, s, tt):
    """The float32 s in all 16 lanes of tt rows."""
    n = _literal(tt)

    def codegen(context, builder, sig, args):
        return _splat(builder, args[0], _f32(n).llvm())

    return _f32(n)(types.float32, tt), codegen


def _keep_lanes(cmp: str):
    """Codegen of `v` with the lanes whose index (of each 16) fails `index cmp bound` set to `fill`."""

    def codegen(context, builder, sig, args):
        n = sig.args[0].count
        ids = ir.Constant(ir.VectorType(_I32, n), [i % LANES for i in range(n)])
        bound = _splat(builder, _int_arg(builder, args[1], _I32), ir.VectorType(_I32, n))
        return builder.select(builder.icmp_signed(cmp, ids, bound), args[0], _splat(builder, args[2], sig.args[0].llvm()))

    return codegen


@_intrinsic
def f32_keep(typingctx, v, count, fill):
    """v with lanes >= count (of each 16) set to the float32 `fill`."""
    return v(v, count, types.float32), _keep_lanes("<")


@_intrinsic
def f32_keep_from(typingctx, v, start, fill):
    """v with lanes < start (of each 16) set to the float32 `fill` (start <= 0 keeps every lane)."""
    return v(v, start, types.float32), _keep_lanes(">=")


def _reduce(builder, v, combine):
    """Fold a 16-lane vector to a scalar by halves: (0..7 with 8..15), then 0..3 with 4..7, ... (fixed order)."""
    while v.type.count > 1:
        a, b = _split(builder, v, 2)
        v = combine(builder, a, b)
    return builder.extract_element(v, ir.Constant(_I32, 0))


@_intrinsic
def f32_hsum(typingctx, v):
    """Sum of a 16-lane vector, in a fixed tree order."""
    return types.float32(v), lambda context, builder, sig, args: _reduce(builder, args[0], lambda b, x, y: b.fadd(x, y))


def _pick_larger(b, x, y):
    return b.select(b.fcmp_ordered(">", x, y), x, y)


@_intrinsic
def f32_hmax(typingctx, v):
    """Largest lane of a 16-lane vector (exact in any order)."""
    return types.float32(v), lambda context, builder, sig, args: _reduce(builder, args[0], _pick_larger)


@_intrinsic
def f32_max(typingctx, a, b):
    """The larger of a and b per lane (a maximum is exact in any order, so lanes can be folded later)."""
    return a(a, b), lambda context, builder, sig, args: _pick_larger(builder, args[0], args[1])


@_intrinsic
def f32_exp(typingctx, v):
    """e**v per lane for v <= 0 (softmax), within 1 ulp (tests/test_activations.py): 2**n * p(r) with
    n = round(v / ln 2) and a degree-7 polynomial in r = v - n ln 2 (ln 2 split in two); fused multiply-adds
    (llvm.fma, one rounding each on any CPU), so every path gives the same bits."""
    return v(v), lambda context, builder, sig, args: _exp_ir(builder, args[0])


@_intrinsic
def f32_sigmoid(typingctx, v):
    """1 / (1 + e**-v) per lane, any v: with e = f32_exp(-|v|), 1 / (1 + e) for v >= 0, else e / (1 + e)."""

    def codegen(context, builder, sig, args):
        x = args[0]
        one = _splat(builder, ir.Constant(_F32, 1.0), x.type)
        negative = builder.fcmp_ordered("<", x, ir.Constant(x.type, [0.0] * v.count))
        e = _exp_ir(builder, builder.select(negative, x, builder.fneg(x)))
        return builder.fdiv(builder.select(negative, e, one), builder.fadd(one, e))

    return v(v), codegen
