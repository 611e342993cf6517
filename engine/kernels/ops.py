"""Small per-row Numba kernels: RMSNorm (+residual), RoPE, SwiGLU, slot mapping.

Every kernel computes each token row with the same sequential float32 code, so a
row's result never depends on how many rows share the call (the invariance the
speculative step relies on). fastmath stays off for the same reason.

Each kernel is compiled twice from one Python function: a parallel version for
large batches and a serial one for decode-sized batches, where waking the thread
pool costs more than the work (prange is plain range in the serial build). Rows are
computed by identical code in both, so the choice never changes a result.
"""

from __future__ import annotations

import types

import numba as nb
import numpy as np

from engine.kernels.simd import f32_add, f32_hsum, f32_mul, f32_sigmoid, f32_zero, row_f32, store_rows
from engine.kernels.simd_rope import rotate_pairs16

# Rows from which the row kernels (norms, RoPE, activation) wake the second thread. Waking it costs a
# few us, about a norm of 8 rows: measured on the Xeon (avx512) in the whole 30-layer forward, serial
# small ops took a verify of 8 from 6.37 / 6.30 to 6.09 / 6.02 ms (layers), 10 and 12 were level or
# better, 16 worse (10.85 / 10.45 parallel, 11.08 / 10.96 serial).
PARALLEL_MIN_ROWS = 16


def _twice(fn):
    """(serial, parallel) builds of one kernel.

    The serial build gets its own function object and name, so Numba's on-disk cache
    (keyed by qualified name) keeps the two builds apart.
    """
    serial = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__ + "_serial", fn.__defaults__, fn.__closure__)
    serial.__qualname__ = fn.__qualname__ + "_serial"
    return nb.njit(cache=True)(serial), nb.njit(parallel=True, cache=True)(fn)


def _pick(pair, num_rows: int):
    return pair[1] if num_rows >= PARALLEL_MIN_ROWS else pair[0]


@nb.njit(cache=True, inline="always")
def q8_scale(x, start):
    """The q8 block scale of x[start:start+32], as llama.cpp's q8_0 / q8_1 take it: (max|x| / 127, its
    inverse, 0 for an all-zero block). The block's values are then round-half-even(x * inverse)."""
    amax = np.float32(0.0)
    for j in range(32):
        amax = max(amax, abs(x[start + j]))
    scale = amax / np.float32(127.0)
    return scale, np.float32(1.0) / scale if scale > 0 else np.float32(0.0)


@nb.njit(cache=True, inline="always")
def sum_squares(row, n):
    """Sum of row[i]^2 for i < n, in a fixed order: 16 lane sums over the 16-value chunks in turn (each
    square and sum rounded to float32), folded by simd.f32_hsum's tree, then the n % 16 tail in order.
    A sequential sum waits 4 cycles per value on the previous add: 1.1 us per row of 576."""
    body = n - n % 16
    lanes = f32_zero(1)
    for i in range(0, body, 16):
        v = row_f32(row, i)
        lanes = f32_add(lanes, f32_mul(v, v))
    acc = f32_hsum(lanes)
    for i in range(body, n):
        acc += row[i] * row[i]
    return acc


def _rms_norm(x, weight, eps, out):
    # x, out: [num_tokens, hidden]; weight: [hidden]
    num_tokens, hidden = x.shape
    for t in nb.prange(num_tokens):
        acc = sum_squares(x[t], hidden)
        inv = np.float32(1.0) / np.sqrt(acc / np.float32(hidden) + np.float32(eps))
        for i in range(hidden):
            out[t, i] = x[t, i] * inv * weight[i]


def _add_rms_norm(x, delta, weight, eps, out):
    """x += delta (the residual stream), then out = rms_norm(x)."""
    num_tokens, hidden = x.shape
    for t in nb.prange(num_tokens):
        for i in range(hidden):
            x[t, i] += delta[t, i]
        acc = sum_squares(x[t], hidden)
        inv = np.float32(1.0) / np.sqrt(acc / np.float32(hidden) + np.float32(eps))
        for i in range(hidden):
            out[t, i] = x[t, i] * inv * weight[i]


def _add_inplace(x, delta):
    # x, delta: [num_tokens, hidden]
    for t in nb.prange(x.shape[0]):
        for i in range(x.shape[1]):
            x[t, i] += delta[t, i]


def _rope_adjacent(qkv, positions, cos, sin, num_rot_heads, head_dim, rope_dim):
    """Rotate pairs (2i, 2i+1) of the first `num_rot_heads` heads of each row (q then k).

    qkv: [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]; cos/sin: [max_pos, rope_dim // 2].
    """
    half = rope_dim // 2
    body = rope_dim - rope_dim % 16  # 8 pairs at a time (simd_rope), then the rest one pair at a time
    for t in nb.prange(qkv.shape[0]):
        p = positions[t]
        row, cos_p, sin_p = qkv[t], cos[p], sin[p]
        for h in range(num_rot_heads):
            base = h * head_dim
            for j in range(0, body, 16):
                store_rows(row, base + j, 0, rotate_pairs16(row, base + j, cos_p, sin_p, j // 2), 16)
            for i in range(body // 2, half):
                c = cos[p, i]
                s = sin[p, i]
                a = qkv[t, base + 2 * i]
                b = qkv[t, base + 2 * i + 1]
                qkv[t, base + 2 * i] = a * c - b * s
                qkv[t, base + 2 * i + 1] = a * s + b * c


def _swiglu(gate_up, out):
    """out = silu(gate) * up, 16 lanes at a time (simd.f32_sigmoid); a tail of inter % 16 in scalar code.
    gate_up: [num_tokens, 2 * inter] (gate | up); out: [num_tokens, inter]."""
    inter = out.shape[1]
    body = inter - inter % 16
    for t in nb.prange(out.shape[0]):
        row, dst = gate_up[t], out[t]
        for i in range(0, body, 16):
            g = row_f32(row, i)
            store_rows(dst, i, 0, f32_mul(f32_mul(g, f32_sigmoid(g)), row_f32(row, inter + i)), 16)
        for i in range(body, inter):
            g = row[i]
            dst[i] = g / (np.float32(1.0) + np.exp(-g)) * row[inter + i]


_RMS_NORM = _twice(_rms_norm)
_ADD_RMS_NORM = _twice(_add_rms_norm)
_ADD_INPLACE = _twice(_add_inplace)
_ROPE = _twice(_rope_adjacent)
_SWIGLU = _twice(_swiglu)


def rms_norm(x, weight, eps, out):
    x = np.ascontiguousarray(x)  # the vector loads read a row as flat memory
    _pick(_RMS_NORM, x.shape[0])(x, weight, np.float32(eps), out)


def add_rms_norm(x, delta, weight, eps, out):
    if not x.flags.c_contiguous:
        raise ValueError("add_rms_norm updates x in place and reads its rows as flat memory: x must be C-contiguous")
    _pick(_ADD_RMS_NORM, x.shape[0])(x, delta, weight, np.float32(eps), out)


def add_inplace(x, delta):
    _pick(_ADD_INPLACE, x.shape[0])(x, delta)


def rope_adjacent(qkv, positions, cos, sin, num_rot_heads, head_dim, rope_dim):
    if not (qkv.flags.c_contiguous and cos.flags.c_contiguous and sin.flags.c_contiguous):
        raise ValueError("rope_adjacent rotates qkv in place with vector loads: qkv, cos and sin must be C-contiguous")
    _pick(_ROPE, qkv.shape[0])(qkv, positions, cos, sin, num_rot_heads, head_dim, rope_dim)


def swiglu(gate_up, out):
    _pick(_SWIGLU, out.shape[0])(gate_up, out)


@nb.njit(cache=True)
def fill_token_meta(cu_q, seq_lens, block_tables, block_size, req_of_token, positions, slot_mapping):
    """Per appended token: its request, absolute position and KV slot (block * block_size + offset)."""
    for r in range(cu_q.shape[0] - 1):
        num_q = cu_q[r + 1] - cu_q[r]
        start_pos = seq_lens[r] - num_q
        for j in range(num_q):
            t = cu_q[r] + j
            pos = start_pos + j
            req_of_token[t] = r
            positions[t] = pos
            slot_mapping[t] = block_tables[r, pos // block_size] * block_size + pos % block_size


def rope_tables(max_pos: int, rope_dim: int, theta: float, scale: float, freq_factors=None, mscale: float = 1.0):
    """cos/sin tables [max_pos, rope_dim // 2] (computed in float64, stored float32), both times `mscale`."""
    inv_freq = 1.0 / (theta ** (np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim))
    if freq_factors is not None:
        inv_freq = inv_freq / np.asarray(freq_factors[: rope_dim // 2], dtype=np.float64)
    angles = np.outer(np.arange(max_pos, dtype=np.float64) / scale, inv_freq)
    return (mscale * np.cos(angles)).astype(np.float32), (mscale * np.sin(angles)).astype(np.float32)
