"""Per-ISA-path ops (the 4-dot accumulators) and the compilation of kernels for one path.

See simd.py for the paths and why they all give the same bits.
"""

from __future__ import annotations

import types as pytypes

from llvmlite import ir
from numba import njit, types

from engine.kernels.simd_ir import (
    LANES, _I8, _I16, _I32, _i16, _i32, _tokens, _literal, _lanes, _concat, _split, _call,
    _intrinsic,
)

PATHS = ("avx512", "vnni", "avx2", "portable")


# ---------------------------------------------------------------- the 4-dots, per path


def _dot4_generic(builder, w, x, signed_w: bool):
    """[16 x i32]: per lane, the sum of the 4 products w * x (w bytes unsigned or signed; x signed)."""
    wide = ir.VectorType(_I16, 64)
    w16 = builder.sext(w, wide) if signed_w else builder.zext(w, wide)
    prod = builder.sext(builder.mul(w16, builder.sext(x, wide)), ir.VectorType(_I32, 64))  # |255*128| < 2**15
    pairs = builder.add(_lanes(builder, prod, range(0, 64, 2)), _lanes(builder, prod, range(1, 64, 2)))
    return builder.add(_lanes(builder, pairs, range(0, 32, 2)), _lanes(builder, pairs, range(1, 32, 2)))


def _avx2_maddubs(builder, w, x):
    """[32 x i16] saturating pair sums of unsigned w x signed x (two vpmaddubsw)."""
    ty = ir.VectorType(_I16, 16)
    (w0, w1), (x0, x1) = _split(builder, w, 2), _split(builder, x, 2)
    return _concat(builder, [_call(builder, "llvm.x86.avx2.pmadd.ub.sw", ty, [w0, x0]),
                             _call(builder, "llvm.x86.avx2.pmadd.ub.sw", ty, [w1, x1])])


def _avx2_widen(builder, v16):
    """[32 x i16] -> [16 x i32] neighbour sums (two vpmaddwd with ones)."""
    ty, ones = ir.VectorType(_I32, 8), ir.Constant(ir.VectorType(_I16, 16), [1] * 16)
    return _concat(builder, [_call(builder, "llvm.x86.avx2.pmadd.wd", ty, [h, ones]) for h in _split(builder, v16, 2)])


def _wide_registers(builder):
    """Let LLVM keep this function's 512-bit vectors whole (zmm registers).

    LLVM tunes Intel server cores to prefer 256-bit vectors and then cannot select a 512-bit
    intrinsic; the function attribute clang sets for 512-bit intrinsics lifts that, for this
    function only. llvmlite's attribute set accepts known names only, so it is added past its check.
    """
    set.add(builder.function.attributes, '"min-legal-vector-width"="512"')


@_intrinsic
def wide_registers(typingctx):
    """Called first in a float kernel: its 16-lane vectors take one zmm register each where the CPU
    has AVX-512 (half the instructions of two ymm); elsewhere nothing changes. Lane-wise IR, so the
    same bits either way."""

    def codegen(context, builder, sig, args):
        _wide_registers(builder)
        return context.get_dummy_value()

    return types.none(), codegen


def _vnni512(builder, acc, w, x):
    """acc [16 x i32] + 4-dots of unsigned w with signed x: one 512-bit vpdpbusd (AVX-512 VNNI)."""
    _wide_registers(builder)
    ty = _i32(1).llvm()
    return _call(builder, "llvm.x86.avx512.vpdpbusd.512", ty, [acc, builder.bitcast(w, ty), builder.bitcast(x, ty)])


def _vnni256(builder, acc, w, x):
    """acc [16 x i32] + 4-dots of unsigned w with signed x: two 256-bit vpdpbusd (AVX-VNNI or AVX-512 VL)."""
    ty = _i32(1).llvm()
    half = ir.VectorType(_I32, 8)
    pieces = [_call(builder, "llvm.x86.avx512.vpdpbusd.256", half,
                    [a, builder.bitcast(wh, half), builder.bitcast(xh, half)])
              for a, wh, xh in zip(_split(builder, acc, 2), _split(builder, w, 2), _split(builder, x, 2))]
    return builder.bitcast(_concat(builder, pieces), ty)


_VNNI = {"avx512": _vnni512, "vnni": _vnni256}


def _add_u8(path, builder, acc, w, x):
    """One token: acc (path's accumulator piece) + 4-dots of unsigned w with signed x."""
    if path == "avx2":
        return builder.add(acc, _avx2_maddubs(builder, w, x))
    if path in _VNNI:
        return _VNNI[path](builder, acc, w, x)
    return builder.add(acc, _dot4_generic(builder, w, x, signed_w=False))


def _add_s8(path, builder, acc, w, x):
    """One token: acc (i32 piece) + 4-dots of signed w with signed x, exact."""
    if path == "avx2":  # |w| x sign(x, w): products and pair sums stay within 16 bits
        absw = _call(builder, "llvm.abs.v64i8", w.type, [w, ir.Constant(ir.IntType(1), 0)])
        ty = ir.VectorType(_I8, 32)
        signed = _concat(builder, [_call(builder, "llvm.x86.avx2.psign.b", ty, [xh, wh])
                                   for xh, wh in zip(_split(builder, x, 2), _split(builder, w, 2))])
        return builder.add(acc, _avx2_widen(builder, _avx2_maddubs(builder, absw, signed)))
    if path in _VNNI:  # (w + 128) x x; dot_s8_done takes 128 x the activations' sum off once per block
        return _VNNI[path](builder, acc, builder.xor(w, ir.Constant(w.type, [0x80] * 64)), x)
    return builder.add(acc, _dot4_generic(builder, w, x, signed_w=True))


def _lut_lookup(path, builder, table, v):
    """[64 x i8] indices (0..15) -> table's values: `table` is [64 x i8], its 16 values repeated in each
    16-byte lane; vpshufb per lane on the x86 paths, one element at a time on the portable one (the same
    values either way)."""
    if path == "portable":
        out = ir.Constant(v.type, ir.Undefined)
        for i in range(v.type.count):
            at = ir.Constant(_I32, i)
            out = builder.insert_element(out, builder.extract_element(table, builder.extract_element(v, at)), at)
        return out
    if path == "avx512":
        _wide_registers(builder)
        return _call(builder, "llvm.x86.avx512.pshuf.b.512", v.type, [table, v])
    half = ir.VectorType(_I8, 32)
    return _concat(builder, [_call(builder, "llvm.x86.avx2.pshuf.b", half, [t, h])
                             for t, h in zip(_split(builder, table, 2), _split(builder, v, 2))])


def _per_token_dot(add_one, path: str, per_token: int, doc: str):
    """An intrinsic (acc, w, x) that applies add_one(path, builder, acc_t, w, x_t) to each token t."""

    def dot(typingctx, acc, w, x):
        n = _tokens(acc, per_token)

        def codegen(context, builder, sig, args):
            accs, xs = _split(builder, args[0], n), _split(builder, args[2], n)
            return _concat(builder, [add_one(path, builder, a, args[1], xt) for a, xt in zip(accs, xs)])

        return acc(acc, w, x), codegen

    dot.__doc__, dot.__name__ = doc, f"{add_one.__name__.strip('_')}_{path}"
    return _intrinsic(dot)


def _make_path_ops(path: str) -> dict:
    """acc_zero / acc_add / acc_i32 (unsigned weight bytes) and dot_s8 (signed) for one path."""
    acc_of = _i16 if path == "avx2" else _i32
    per_token = 32 if path == "avx2" else LANES

    @_intrinsic
    def acc_zero(typingctx, tt):
        n = _literal(tt)
        return acc_of(n)(tt), lambda context, builder, sig, args: ir.Constant(acc_of(n).llvm(), [0] * per_token * n)

    acc_add = _per_token_dot(_add_u8, path, per_token,
                             "acc + 4-dots of unsigned weight bytes w (U8x64) with each token's activations x.")

    @_intrinsic
    def acc_i32(typingctx, acc):
        n = _tokens(acc, per_token)

        def codegen(context, builder, sig, args):
            if path != "avx2":
                return args[0]
            return _concat(builder, [_avx2_widen(builder, a) for a in _split(builder, args[0], n)])

        return _i32(n)(acc), codegen

    dot_s8 = _per_token_dot(_add_s8, path, LANES, "acc (i32) + 4-dots of signed weight bytes w with each token's "
                            "activations x (exact once a block's sums pass dot_s8_done).")

    @_intrinsic
    def dot_s8_done(typingctx, acc, xsum):
        """A block's dot_s8 sums made exact: on the VNNI paths, minus 128 x xsum (each token's activation
        sum over the block, i32 per lane) for the weights' bias; elsewhere unchanged."""

        def codegen(context, builder, sig, args):
            if path not in _VNNI:
                return args[0]
            return builder.sub(args[0], builder.shl(args[1], ir.Constant(args[1].type, [7] * args[1].type.count)))

        return acc(acc, xsum), codegen

    @_intrinsic
    def lut_values(typingctx, table, v):
        """table[i] (signed, for dot_s8) for each byte i of v (U8x64, each 0..15); table: U8x64, a format's 16
        values in each 16-byte lane (int_lut)."""
        return v(table, v), lambda context, builder, sig, args: _lut_lookup(path, builder, args[0], args[1])

    return {"acc_zero": acc_zero, "acc_add": acc_add, "acc_i32": acc_i32, "dot_s8": dot_s8, "dot_s8_done": dot_s8_done,
            "lut_values": lut_values}


PATH_OPS = {path: _make_path_ops(path) for path in PATHS}


def _clone(fn, env: dict, suffix: str):
    clone = pytypes.FunctionType(fn.__code__, env, fn.__name__ + suffix, fn.__defaults__, fn.__closure__)
    clone.__qualname__ = fn.__qualname__ + suffix
    clone.__doc__ = fn.__doc__
    return clone


def specialize_family(functions: dict, path: str, constants: dict | None = None, tag: str = "") -> dict:
    """{name: fn} -> {name: inline-compiled clone for `path`}; the clones call each other by name.

    Every function must come from one module (they share its globals, plus the path's ops and
    `constants`, compile-time values such as a format's traits; `tag` names that variant).
    """
    if path not in PATH_OPS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    env = dict(next(iter(functions.values())).__globals__)
    env.update(PATH_OPS[path])
    env.update(constants or {})
    suffix = f"_{tag}_{path}" if tag else f"_{path}"
    for name, fn in functions.items():
        env[name] = njit(inline="always", cache=True)(_clone(fn, env, suffix))
    return {name: env[name] for name in functions}


def specialize(fn, path: str, bind: dict, tag: str, parallel: bool = True, inline: bool = False):
    """Compile driver `fn` for one path, with `bind` {global name: compiled helper} in its globals.

    The clone is named after `tag` and the path, so Numba's on-disk cache keeps them apart. `inline`:
    serial glue that its callers take in at Numba's IR level instead of calling; it then builds no
    library of its own (see engine/kernels/layer.py's `attention_block` for why that matters).
    """
    env = dict(fn.__globals__)
    env.update(PATH_OPS[path])
    env.update(bind)
    suffix = f"_{tag}_{path}" + ("" if parallel else "_serial")
    options = {"inline": "always"} if inline else {"parallel": parallel}
    return njit(cache=True, **options)(_clone(fn, env, suffix))
