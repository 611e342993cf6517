"""One decoder layer as one compiled call: norm, products, RoPE, KV write, attention, gated FFN.

A Python loop of ~14 kernel calls per layer cost more than the kernels themselves at T = 1
(argument checks, dispatch, slicing). Here a layer is one Numba function; its four weight
products are bound per weight format (`product`), so a forward is one call per layer.

Weights as the layer passes them to a product:
  int8   w = ((arrays, n, col0), ...): one entry per part (one, or q|k|v of mixed formats)
  exact  w = the PackedWeight's arrays (float_tiles); `rows` is not used
Buffers `rows` of an int8 product are its QuantRows (xq, xd, xm, xs), sliced to T inside.

An architecture's optional parts (QKV bias, QK-norm, post-sublayer norms, RoPE style, FFN
activation; see engine/model/architectures.py) are bound per layer build from its `arch_key`;
a part the architecture lacks is bound to a kernel that does nothing.
"""

from __future__ import annotations

import functools
import importlib

import numba as nb
from numba.core import types
from numba.experimental import structref

from engine.kernels import arch_ops, attention, attention_split, float_tiles, int_linear, ops, unlinked
from engine.kernels.simd import specialize

PARALLEL_MIN_ROWS = ops.PARALLEL_MIN_ROWS
# Values below which one thread quantizes activations faster than two (Xeon, avx512: 8 x 576 serial
# 1.8 us, parallel 3.0; 16 x 576 3.2 / 3.7; 32 x 576 5.8 / 5.0; 16 x 1536 7.2 / 5.8).
QUANTIZE_PARALLEL_MIN = 16384


_QUANTIZE_S, _QUANTIZE_P = int_linear._QUANTIZE


@nb.njit(cache=True, inline="always")
def _quantized(x, rows):
    """x [T, k] -> its QuantRows arrays, sliced to T + 1 rows where they have them (the spare row,
    not written, lets the product run a last 3 or 7 tokens as one padded tile: int_linear._gemm)."""
    num = x.shape[0]
    have = min(num + 1, rows[0].shape[0])
    xq, xd, xm, xs = rows[0][:have], rows[1][:have], rows[2][:have], rows[3][:have]
    if num * x.shape[1] >= QUANTIZE_PARALLEL_MIN:
        _QUANTIZE_P(x, xq, xd, xm, xs)
    else:
        _QUANTIZE_S(x, xq, xd, xm, xs)
    return xq, xd, xm, xs


def _int_product1(x, w, out, rows):
    xq = _quantized(x, rows)
    _k0(w[0][0], xq, out, w[0][2], w[0][1])  # noqa: F821


def _int_product2(x, w, out, rows):
    xq = _quantized(x, rows)
    _k0(w[0][0], xq, out, w[0][2], w[0][1])  # noqa: F821
    _k1(w[1][0], xq, out, w[1][2], w[1][1])  # noqa: F821


def _int_product3(x, w, out, rows):
    xq = _quantized(x, rows)
    _k0(w[0][0], xq, out, w[0][2], w[0][1])  # noqa: F821
    _k1(w[1][0], xq, out, w[1][2], w[1][1])  # noqa: F821
    _k2(w[2][0], xq, out, w[2][2], w[2][1])  # noqa: F821


def _exact(x, w, out, rows):
    _float(x, w, out)  # noqa: F821  (float_tiles' kernel for the weight's format, bound per path)


_INT_PRODUCTS = {1: _int_product1, 2: _int_product2, 3: _int_product3}


def _product(key: tuple, path: str):
    """`product(key, path)` as a layer calls it: by symbol (engine.kernels.unlinked)."""
    return unlinked.call("engine.kernels.layer", "product", args=(key, path))


@functools.cache
def product(key: tuple, path: str):
    """The compiled product for ("int8", fmt, ...) (one format per part) or ("exact", kind)."""
    if key[0] == "exact":
        from engine.kernels.linear import float_format

        bind = {"_float": float_tiles.kernel(float_format(key[1]), path)}
        return specialize(_exact, path, bind, tag=f"exact_{key[1]}", parallel=False)
    kernels = {f"_k{i}": int_linear.kernel(fmt, path) for i, fmt in enumerate(key[1:])}
    return specialize(_INT_PRODUCTS[len(key) - 1], path, kernels, tag="_".join(key[1:]), parallel=False)


@structref.register
class LayerArgsType(types.StructRef):
    def preprocess_fields(self, fields):
        return tuple((name, types.unliteral(t)) for name, t in fields)


class LayerArgs(structref.StructRefProxy):
    """A layer's buffers and weights, unboxed once: passing ~50 arrays to a compiled call cost ~6 us
    of argument unboxing each, 30 times a forward (~0.15 ms, 4% of a decode step); this costs ~1 us."""


structref.define_constructor(LayerArgs, LayerArgsType, ["bufs", "w"])
structref.define_boxing(LayerArgsType, LayerArgs)


@nb.njit(cache=True)
def layer_args(bufs, w):
    """LayerArgs of bufs (activations) and w (weights + this layer's caches and parts); see `_layer`."""
    return LayerArgs(bufs, w)


def _attention_block(num, first, args, meta):
    """A layer up to its FFN over the first `num` rows; args: its LayerArgs, meta: the step's token metadata
    (see CpuRunner.forward). Leaves the residual stream in x and the FFN's normed input in h. Small ops run
    serially below PARALLEL_MIN_ROWS rows (waking the threads costs more than the work)."""
    x, delta, h, qkv, attn, rows_h, rows_q = args.bufs[0], args.bufs[1], args.bufs[2], args.bufs[3], args.bufs[4], \
        args.bufs[7], args.bufs[8]
    attn_norm, w_qkv, w_o, ffn_norm, k_cache, v_cache = args.w[0], args.w[1], args.w[2], args.w[3], args.w[6], args.w[7]
    qkv_bias, q_norm, k_norm, post_attn_norm, post_ffw_norm, cos, sin, window = args.w[8]
    positions, slots, cu_q, tables, eps, scale, num_heads, num_kv, head_dim, rope_dim, threads = meta
    par = num >= PARALLEL_MIN_ROWS
    xs, ds, hs, q, pos, out = x[:num], delta[:num], h[:num], qkv[:num], positions[:num], attn[:num]
    if first and par:
        _rms_p(xs, attn_norm, eps, hs)  # noqa: F821
    elif first:
        _rms_s(xs, attn_norm, eps, hs)  # noqa: F821
    elif par:
        _add_rms_p(xs, ds, attn_norm, eps, hs)  # noqa: F821
    else:
        _add_rms_s(xs, ds, attn_norm, eps, hs)  # noqa: F821
    _qkv(hs, w_qkv, q, rows_h)  # noqa: F821
    _bias(q, qkv_bias, par)  # noqa: F821
    _head_norms(q, q_norm, k_norm, eps, num_heads, num_kv, head_dim, par)  # noqa: F821
    if par:
        _rope_p(q, pos, cos, sin, num_heads + num_kv, head_dim, rope_dim)  # noqa: F821
    else:
        _rope_s(q, pos, cos, sin, num_heads + num_kv, head_dim, rope_dim)  # noqa: F821
    if num >= 64:
        _write_p(q, k_cache, v_cache, slots[:num], num_heads * head_dim, num_kv * head_dim)  # noqa: F821
    else:
        _write_s(q, k_cache, v_cache, slots[:num], num_heads * head_dim, num_kv * head_dim)  # noqa: F821
    if _splits(num, cu_q, pos.max() + 1, num_heads, num_kv):  # noqa: F821  (a long decode batch)
        _attend_split(q, k_cache, v_cache, cu_q, pos, tables, num_heads, scale, window, out, threads)  # noqa: F821
    elif threads > 1:  # the matmuls keep the pool awake: both threads pay even at a few keys
        _attend_p(q, k_cache, v_cache, cu_q, pos, tables, num_heads, scale, window, out, threads)  # noqa: F821
    else:
        _attend_s(q, k_cache, v_cache, cu_q, pos, tables, num_heads, scale, window, out, threads)  # noqa: F821
    _o(out, w_o, ds, rows_q)  # noqa: F821
    _post_norm(ds, post_attn_norm, eps, par)  # noqa: F821
    if par:
        _add_rms_p(xs, ds, ffn_norm, eps, hs)  # noqa: F821
    else:
        _add_rms_s(xs, ds, ffn_norm, eps, hs)  # noqa: F821


def _layer(num, first, args, meta):
    """Layer forward over the first `num` rows: the attention block, then the gated FFN into delta."""
    _attn_block(num, first, args, meta)  # noqa: F821
    delta, h, gate_up, act, rows_h, rows_i = args.bufs[1], args.bufs[2], args.bufs[5], args.bufs[6], args.bufs[7], \
        args.bufs[9]
    par, ds = num >= PARALLEL_MIN_ROWS, delta[:num]
    _gu(h[:num], args.w[4], gate_up[:num], rows_h)  # noqa: F821
    if par:
        _act_p(gate_up[:num], act[:num])  # noqa: F821
    else:
        _act_s(gate_up[:num], act[:num])  # noqa: F821
    _down(act[:num], args.w[5], ds, rows_i)  # noqa: F821
    _post_norm(ds, args.w[8][4], meta[4], par)  # noqa: F821


# (module, attribute) of each part's (serial, parallel) pair; the parallel ones are called by symbol
_ROPES = {"adjacent": ("engine.kernels.ops", "_ROPE"), "neox": ("engine.kernels.arch_ops", "_ROPE_NEOX")}
_ACTIVATIONS = {"silu": ("engine.kernels.ops", "_SWIGLU"), "gelu_tanh": ("engine.kernels.arch_ops", "_GEGLU")}


def _pair(where: tuple) -> tuple:
    """(serial kernel, parallel kernel called by symbol) of the `_twice` pair at (module, attribute)."""
    module, name = where
    return getattr(importlib.import_module(module), name)[0], unlinked.call(module, name, item=1)


def arch_key(arch) -> tuple:
    """The layer-build key of an Architecture: (rope, qkv_bias, qk_norm, post_norms, activation, residual_scale)."""
    return (arch.rope, arch.qkv_bias, arch.qk_norm, arch.post_norms, arch.activation, arch.residual_scale)


def _arch_parts(key: tuple) -> dict:
    rope, qkv_bias, qk_norm, post_norms, activation, residual_scale = key
    post = arch_ops.post_norm if post_norms else arch_ops.scale_output if residual_scale else arch_ops.skip_post_norm
    (rope_s, rope_p), (act_s, act_p) = _pair(_ROPES[rope]), _pair(_ACTIVATIONS[activation])
    return dict(_rope_s=rope_s, _rope_p=rope_p, _act_s=act_s, _act_p=act_p,
                _bias=arch_ops.add_bias if qkv_bias else arch_ops.skip_bias,
                _head_norms=arch_ops.head_norms if qk_norm else arch_ops.skip_head_norms,
                _post_norm=post)


_KV_WRITERS = {"float32": "_WRITE_KV", "float16": "_WRITE_KV_F16", "int8": "_WRITE_KV_Q8"}  # engine.kernels.attention's


def _tag(products: tuple, kv_dtype: str, vector_attention: bool, arch: tuple) -> str:
    return ("__".join("_".join(k) for k in products) + "_" + kv_dtype + ("_vec" if vector_attention else "")
            + "__" + "_".join(str(v) for v in arch))


@functools.cache
def attention_block(products: tuple, kv_dtype: str, vector_attention: bool, path: str, arch: tuple):
    """The `_attention_block` for the (qkv, o) product keys, the cache's element type (float32, float16, or
    int8 with (values, scales) pairs as the layer's caches) and an `arch_key`, inlined into its layer.

    Numba links every callee's LLVM module into its caller's and optimizes and compiles the whole again,
    so the products, the attention kernels and the parallel small kernels are called by symbol
    (engine.kernels.unlinked): LLVM's time in a layer's cold build fell from 36.8 to 3.5 s, the build
    from 31-34 to 7.5-7.9 s with the machine shared (Zen 3, journal). The serial small kernels stay
    linked (LLVM may inline them; they are cheap to build again)."""
    attend = "_ATTENTION_VEC" if vector_attention else "_ATTENTION"
    bind = {name: _product(key, path) for name, key in zip(("_qkv", "_o"), products)}
    bind.update(_write_s=getattr(attention, _KV_WRITERS[kv_dtype])[0],
                _write_p=unlinked.call("engine.kernels.attention", _KV_WRITERS[kv_dtype], item=1),
                _attend_s=unlinked.call("engine.kernels.attention", attend, item=0),
                _attend_p=unlinked.call("engine.kernels.attention", attend, item=1),
                _attend_split=unlinked.call("engine.kernels.attention_split", "decode_attention"),
                _splits=attention_split.splits if vector_attention else attention_split.never,
                _rms_s=ops._RMS_NORM[0], _rms_p=unlinked.call("engine.kernels.ops", "_RMS_NORM", item=1),
                _add_rms_s=ops._ADD_RMS_NORM[0],
                _add_rms_p=unlinked.call("engine.kernels.ops", "_ADD_RMS_NORM", item=1),
                **_arch_parts(arch))
    tag = "attn_" + _tag(products, kv_dtype, vector_attention, arch)
    return specialize(_attention_block, path, bind, tag=tag, parallel=False, inline=True)


@functools.cache
def layer(products: tuple, kv_dtype: str, vector_attention: bool, path: str, arch: tuple):
    """The compiled layer for four product keys (qkv, o, gate_up, down), or five for a mixture-of-experts
    layer (qkv, o, an expert's gate_up, an expert's down, the router: engine/kernels/moe.py) and seven for one
    with a shared expert (its gate_up and down after those), with the attention block of `attention_block`."""
    from engine.kernels import moe

    names = ("_gu", "_down", "_router", "_gu_sh", "_down_sh")
    bind = {name: _product(key, path) for name, key in zip(names, products[2:] + products[2:4])}  # moe: w[10]
    bind.update(_attn_block=attention_block(products[:2], kv_dtype, vector_attention, path, arch), **_arch_parts(arch))
    body = moe._layer_moe if len(products) >= 5 else _layer
    return specialize(body, path, bind, tag=_tag(products, kv_dtype, vector_attention, arch), parallel=False)


def product_key(w) -> tuple:
    """A packed weight's product key (see `product`)."""
    from engine.kernels.linear import PackedWeight, WeightParts

    if isinstance(w, PackedWeight):
        return ("exact", w.kind)
    parts = w.parts if isinstance(w, WeightParts) else (w,)
    return ("int8",) + tuple(p.fmt for p in parts)


def product_args(w):
    """A packed weight as its product takes it (see the module docstring)."""
    from engine.kernels.linear import PackedWeight, WeightParts

    if isinstance(w, PackedWeight):
        return w.arrays
    if isinstance(w, WeightParts):
        return tuple((p.arrays, p.n, off) for p, off in zip(w.parts, w.offsets))
    return ((w.arrays, w.n, 0),)

