"""A draft head's module (fc, then its decoder layer) over one run of rows as one compiled call (integer numerics).

DecoderLayer.forward's Python chain makes ~12 kernel calls per draft token and allocates between
them; for the one request of a batch-1 draft that glue cost about what the layer's weight products
did. Here the same kernels run in the same order from one Numba function (products bound per
weight format as in engine.kernels.layer), so its rows are the chain's bits exactly.
"""

from __future__ import annotations

import functools

import numba as nb
import numpy as np

from engine.kernels import arch_ops, ops
from engine.kernels import layer as layer_kernels
from engine.kernels.simd import specialize
from proposers.heads.head_attention import store_and_attend

PARALLEL_MIN_ROWS = ops.PARALLEL_MIN_ROWS


@nb.njit(cache=True)
def _quant_rows(n, k):
    """A product's QuantRows arrays for n rows of width k: (xq, xd, xm, xs)."""
    return (np.empty((n, k), np.int8), np.empty((n, k // 32), np.float32), np.empty((n, k // 32), np.float32),
            np.empty((n, k // 16), np.int32))


def _head_layer(x, w, k_store, v_store, p0, lo, window, cos, sin, eps, scale, num_heads):
    """x [n, H] at positions p0..p0+n-1 attending from key lo, within `window` keys -> [n, H] (see
    DecoderLayer.forward)."""
    attn_norm, w_qkv, w_o, ffn_norm, w_gu, w_down, inter = w
    n, hidden = x.shape
    num_kv, hd = k_store.shape[0], k_store.shape[1]
    par = n >= PARALLEL_MIN_ROWS
    h = np.empty((n, hidden), np.float32)  # [n, H]
    if par:
        _rms_p(x, attn_norm, eps, h)  # noqa: F821
    else:
        _rms_s(x, attn_norm, eps, h)  # noqa: F821
    qkv = np.empty((n, (num_heads + 2 * num_kv) * hd), np.float32)  # [n, (nh + 2 nkv) hd]
    _qkv(h, w_qkv, qkv, _quant_rows(n, hidden))  # noqa: F821
    positions = np.arange(p0, p0 + n).astype(np.int32)
    if par:
        _rope_p(qkv, positions, cos, sin, num_heads + num_kv, hd, hd)  # noqa: F821
    else:
        _rope_s(qkv, positions, cos, sin, num_heads + num_kv, hd, hd)  # noqa: F821
    attn = np.empty((n, num_heads * hd), np.float32)  # [n, nh hd]
    store_and_attend(qkv, k_store, v_store, p0, lo, window, num_heads, scale, attn)
    delta = np.empty((n, hidden), np.float32)
    _o(attn, w_o, delta, _quant_rows(n, num_heads * hd))  # noqa: F821
    x = x + delta  # a new array: the caller's x stays as it was
    if par:
        _rms_p(x, ffn_norm, eps, h)  # noqa: F821
    else:
        _rms_s(x, ffn_norm, eps, h)  # noqa: F821
    gate_up = np.empty((n, 2 * inter), np.float32)  # [n, 2 I]
    _gu(h, w_gu, gate_up, _quant_rows(n, hidden))  # noqa: F821
    act = np.empty((n, inter), np.float32)  # [n, I]
    if par:
        _act_p(gate_up, act)  # noqa: F821
    else:
        _act_s(gate_up, act)  # noqa: F821
    _down(act, w_down, delta, _quant_rows(n, inter))  # noqa: F821
    return x + delta


def _fc_then_layer(emb, feat, w_fc, w, k_store, v_store, p0, lo, window, cos, sin, eps, scale, num_heads):
    """An EAGLE / MTP module: x = [emb | feat] @ fc.T [n, H], then the layer over x (see _head_layer)."""
    n, hidden = emb.shape
    both = np.empty((n, 2 * hidden), np.float32)  # [n, 2H]
    both[:, :hidden] = emb
    both[:, hidden:] = feat
    x = np.empty((n, hidden), np.float32)
    _fc(both, w_fc, x, _quant_rows(n, 2 * hidden))  # noqa: F821
    return _layer(x, w, k_store, v_store, p0, lo, window, cos, sin, eps, scale, num_heads)  # noqa: F821


@functools.cache
def head_module(fc: tuple, products: tuple, path: str):
    """_fc_then_layer compiled for an integer fc product key and the layer's four (see head_layer)."""
    bind = {"_fc": layer_kernels.product(fc, path), "_layer": head_layer(products, path)}
    tag = "headfc__" + "_".join(fc) + "__" + "__".join("_".join(k) for k in products)
    return specialize(_fc_then_layer, path, bind, tag=tag, parallel=False)


@functools.cache
def head_layer(products: tuple, path: str):
    """The compiled layer for four integer product keys (qkv, o, gate_up, down; engine.kernels.layer)."""
    bind = {name: layer_kernels.product(key, path) for name, key in zip(("_qkv", "_o", "_gu", "_down"), products)}
    bind.update(_rms_s=ops._RMS_NORM[0], _rms_p=ops._RMS_NORM[1], _rope_s=arch_ops._ROPE_NEOX[0],
                _rope_p=arch_ops._ROPE_NEOX[1], _act_s=ops._SWIGLU[0], _act_p=ops._SWIGLU[1])
    tag = "head__" + "__".join("_".join(k) for k in products)
    return specialize(_head_layer, path, bind, tag=tag, parallel=False)
