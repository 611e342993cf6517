"""Per-row kernels of the architectures' optional parts (engine/model/architectures.py).

Like ops.py: each row is computed by the same sequential float32 code whatever the batch, each
kernel is built serial and parallel (`_twice`), and `par` picks one without changing a bit.
A layer binds either the real kernel or `skip` for each part (engine/kernels/layer.py).
"""

from __future__ import annotations

import numba as nb
import numpy as np

from engine.kernels.ops import _pick, _twice, sum_squares
from engine.kernels.simd import f32_add, f32_mul, f32_sigmoid, f32_splat, row_f32, store_rows

_TWO_SQRT_2_OVER_PI = np.float32(2 * 0.7978845608028654)
_GELU_CUBIC = np.float32(0.044715)


def _rope_neox(qkv, positions, cos, sin, num_rot_heads, head_dim, rope_dim):
    """Rotate pairs (i, i + rope_dim/2) of the first `num_rot_heads` heads of each row (q then k).

    qkv: [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]; cos/sin: [max_pos, rope_dim // 2].
    """
    half = rope_dim // 2
    for t in nb.prange(qkv.shape[0]):
        p = positions[t]
        for h in range(num_rot_heads):
            base = h * head_dim
            for i in range(half):
                c = cos[p, i]
                s = sin[p, i]
                a = qkv[t, base + i]
                b = qkv[t, base + half + i]
                qkv[t, base + i] = a * c - b * s
                qkv[t, base + half + i] = b * c + a * s


def _geglu(gate_up, out):
    """out = gelu_tanh(gate) * up, as gate * sigmoid(2u) * up with u = sqrt(2 / pi) (gate + 0.044715 gate^3)
    (0.5 (1 + tanh u) is sigmoid(2u)): 16 lanes at a time (simd.f32_sigmoid), a tail of inter % 16 in scalar
    code. gate_up: [num_tokens, 2 * inter] (gate | up); out: [num_tokens, inter]."""
    inter = out.shape[1]
    body = inter - inter % 16
    for t in nb.prange(out.shape[0]):
        row, dst = gate_up[t], out[t]
        for i in range(0, body, 16):
            g = row_f32(row, i)
            cubic = f32_mul(f32_splat(_GELU_CUBIC, 1), f32_mul(g, f32_mul(g, g)))
            u2 = f32_mul(f32_splat(_TWO_SQRT_2_OVER_PI, 1), f32_add(g, cubic))
            store_rows(dst, i, 0, f32_mul(f32_mul(g, f32_sigmoid(u2)), row_f32(row, inter + i)), 16)
        for i in range(body, inter):
            g = row[i]
            u2 = _TWO_SQRT_2_OVER_PI * (g + _GELU_CUBIC * (g * (g * g)))
            dst[i] = g / (np.float32(1.0) + np.exp(-u2)) * row[inter + i]


def _add_bias(qkv, bias):
    # qkv: [num_tokens, n]; bias: [n]
    for t in nb.prange(qkv.shape[0]):
        for i in range(qkv.shape[1]):
            qkv[t, i] += bias[i]


def _head_norms(qkv, q_weight, k_weight, eps, num_heads, num_kv_heads, head_dim):
    """RMSNorm over each q head (weight q_weight [head_dim]) and each k head (k_weight) of every row."""
    for t in nb.prange(qkv.shape[0]):
        for h in range(num_heads + num_kv_heads):
            base = h * head_dim
            acc = sum_squares(qkv[t, base : base + head_dim], head_dim)  # the order of every RMSNorm (ops)
            inv = np.float32(1.0) / np.sqrt(acc / np.float32(head_dim) + eps)
            for i in range(head_dim):
                w = q_weight[i] if h < num_heads else k_weight[i]
                qkv[t, base + i] = qkv[t, base + i] * inv * w


def _norm_inplace(x, weight, eps):
    """x = rms_norm(x) * weight, row by row. x: [num_tokens, hidden]."""
    for t in nb.prange(x.shape[0]):
        acc = sum_squares(x[t], x.shape[1])
        inv = np.float32(1.0) / np.sqrt(acc / np.float32(x.shape[1]) + eps)
        for i in range(x.shape[1]):
            x[t, i] = x[t, i] * inv * weight[i]


_ROPE_NEOX = _twice(_rope_neox)
_GEGLU = _twice(_geglu)
# Plain globals, not tuples: a jitted caller would type a tuple of dispatchers as first-class functions.
_add_bias_s, _add_bias_p = _twice(_add_bias)
_head_norms_s, _head_norms_p = _twice(_head_norms)
_norm_inplace_s, _norm_inplace_p = _twice(_norm_inplace)


def rope_neox(qkv, positions, cos, sin, num_rot_heads, head_dim, rope_dim):
    """Rotate-half RoPE from Python (the draft heads' layer); see _rope_neox."""
    _pick(_ROPE_NEOX, qkv.shape[0])(qkv, positions, cos, sin, num_rot_heads, head_dim, rope_dim)


@nb.njit(cache=True)
def add_bias(qkv, bias, par):
    if par:
        _add_bias_p(qkv, bias)
    else:
        _add_bias_s(qkv, bias)


@nb.njit(cache=True)
def head_norms(qkv, q_weight, k_weight, eps, num_heads, num_kv_heads, head_dim, par):
    if par:
        _head_norms_p(qkv, q_weight, k_weight, eps, num_heads, num_kv_heads, head_dim)
    else:
        _head_norms_s(qkv, q_weight, k_weight, eps, num_heads, num_kv_heads, head_dim)


@nb.njit(cache=True)
def post_norm(x, weight, eps, par):
    if par:
        _norm_inplace_p(x, weight, eps)
    else:
        _norm_inplace_s(x, weight, eps)


@nb.njit(cache=True)
def skip_bias(qkv, bias, par):
    pass


@nb.njit(cache=True)
def skip_head_norms(qkv, q_weight, k_weight, eps, num_heads, num_kv_heads, head_dim, par):
    pass


@nb.njit(cache=True)
def skip_post_norm(x, weight, eps, par):
    pass


@nb.njit(cache=True)
def scale_output(x, weight, eps, par):
    """A sublayer's output times its residual multiplier (weight[0]) before the residual add (Granite)."""
    x *= weight[0]
