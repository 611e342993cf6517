"""Small per-row Numba kernels: RMSNorm (+residual), RoPE, SwiGLU, slot mapping.

Every kernel computes each token row with the same sequential float32 code, so a
row's result never depends on how many rows share the call (the invariance the
speculative step relies on). fastmath stays off for the same reason.
"""

from __future__ import annotations

import numba as nb
import numpy as np


@nb.njit(parallel=True, cache=True)
def rms_norm(x, weight, eps, out):
    # x, out: [num_tokens, hidden]; weight: [hidden]
    num_tokens, hidden = x.shape
    for t in nb.prange(num_tokens):
        acc = np.float32(0.0)
        for i in range(hidden):
            acc += x[t, i] * x[t, i]
        inv = np.float32(1.0) / np.sqrt(acc / np.float32(hidden) + np.float32(eps))
        for i in range(hidden):
            out[t, i] = x[t, i] * inv * weight[i]


@nb.njit(parallel=True, cache=True)
def add_rms_norm(x, delta, weight, eps, out):
    """x += delta (the residual stream), then out = rms_norm(x)."""
    num_tokens, hidden = x.shape
    for t in nb.prange(num_tokens):
        acc = np.float32(0.0)
        for i in range(hidden):
            v = x[t, i] + delta[t, i]
            x[t, i] = v
            acc += v * v
        inv = np.float32(1.0) / np.sqrt(acc / np.float32(hidden) + np.float32(eps))
        for i in range(hidden):
            out[t, i] = x[t, i] * inv * weight[i]


@nb.njit(parallel=True, cache=True)
def add_inplace(x, delta):
    # x, delta: [num_tokens, hidden]
    for t in nb.prange(x.shape[0]):
        for i in range(x.shape[1]):
            x[t, i] += delta[t, i]


@nb.njit(parallel=True, cache=True)
def rope_adjacent(qkv, positions, cos, sin, num_rot_heads, head_dim, rope_dim):
    """Rotate pairs (2i, 2i+1) of the first `num_rot_heads` heads of each row (q then k).

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
                a = qkv[t, base + 2 * i]
                b = qkv[t, base + 2 * i + 1]
                qkv[t, base + 2 * i] = a * c - b * s
                qkv[t, base + 2 * i + 1] = a * s + b * c


@nb.njit(parallel=True, cache=True)
def swiglu(gate_up, out):
    # gate_up: [num_tokens, 2 * inter] (gate | up); out: [num_tokens, inter]
    inter = out.shape[1]
    for t in nb.prange(out.shape[0]):
        for i in range(inter):
            g = gate_up[t, i]
            out[t, i] = g / (np.float32(1.0) + np.exp(-g)) * gate_up[t, inter + i]


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


def rope_tables(max_pos: int, rope_dim: int, theta: float, scale: float, freq_factors=None):
    """cos/sin tables [max_pos, rope_dim // 2] (computed in float64, stored float32)."""
    inv_freq = 1.0 / (theta ** (np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim))
    if freq_factors is not None:
        inv_freq = inv_freq / np.asarray(freq_factors[: rope_dim // 2], dtype=np.float64)
    angles = np.outer(np.arange(max_pos, dtype=np.float64) / scale, inv_freq)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
