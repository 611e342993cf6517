"""Mixture-of-experts FFN (Qwen3-MoE, Mixtral): a router scores every expert for each token, the token runs
its top k experts' gated FFNs, and their outputs, weighted by the router's softmax, add up.

A MoE layer's LayerArgs (engine/kernels/layer.py) differ from a dense one's in three places: w[4] and w[5]
hold every expert's gate_up and down product arguments (UniTuples: one format per layer, indexed by
expert), and w[9] the router: (its product arguments, its input buffers, top k, renormalize, scratch).

Bits: a token's routing, its rows of each product (integer sums with a fixed per-row combine: a row's
result does not depend on the other rows of the call) and its sum over experts (in expert order) depend
on that token alone, so its output is the same however it is batched, and speculation stays lossless.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba as nb
import numpy as np

from engine.kernels.ops import PARALLEL_MIN_ROWS


@dataclass(frozen=True)
class MoeWeights:
    """A layer's packed router [experts, hidden] and experts: gate_up [2 x ff, hidden] and down [hidden, ff] each."""

    router: object
    gate_up: tuple
    down: tuple

    def active_bytes(self, top_k: int) -> int:
        """What one token's FFN streams: the router and k experts."""
        return self.router.nbytes + top_k * (self.gate_up[0].nbytes + self.down[0].nbytes)


@nb.njit(cache=True)
def route(logits, top_k, renorm, sel, wts):
    """Per row of logits [T, experts]: its top_k experts by softmax probability (ties: the lower id) into
    sel [T, top_k], their probabilities into wts [T, top_k], divided by the top k's sum when renorm."""
    num, experts = logits.shape
    p = np.empty(experts, np.float32)
    for t in range(num):
        high = logits[t].max()
        total = np.float32(0.0)
        for e in range(experts):
            p[e] = np.exp(logits[t, e] - high)
            total += p[e]
        picked = np.float32(0.0)
        for j in range(top_k):
            best = 0
            for e in range(1, experts):
                if p[e] > p[best]:
                    best = e
            sel[t, j], wts[t, j] = best, p[best]
            picked += p[best]
            p[best] = -1.0
        norm = picked if renorm else total
        for j in range(top_k):
            wts[t, j] /= norm


@nb.njit(cache=True)
def group(sel, wts, start, fill, order_t, order_w):
    """The (token, pick) pairs sorted by expert (counting sort, tokens ascending within an expert): expert e's
    tokens are order_t[start[e] : start[e + 1]], their weights order_w[...]. start [experts + 1], fill [experts]."""
    num, top_k = sel.shape
    start[:] = 0
    for t in range(num):
        for j in range(top_k):
            start[sel[t, j] + 1] += 1
    for e in range(start.shape[0] - 1):
        start[e + 1] += start[e]
        fill[e] = start[e]
    for t in range(num):
        for j in range(top_k):
            e = sel[t, j]
            order_t[fill[e]], order_w[fill[e]] = t, wts[t, j]
            fill[e] += 1


@nb.njit(cache=True)
def gather(h, tokens, out):
    """out[i] = h[tokens[i]]."""
    for i in range(tokens.shape[0]):
        out[i] = h[tokens[i]]


@nb.njit(cache=True)
def scatter_add(y, tokens, weights, out):
    """out[tokens[i]] += weights[i] * y[i]."""
    for i in range(tokens.shape[0]):
        t, w = tokens[i], weights[i]
        for c in range(y.shape[1]):
            out[t, c] += w * y[i, c]


def _layer_moe(num, first, args, meta):
    """A MoE layer over the first `num` rows: the attention block, then each expert over its tokens."""
    _attn_block(num, first, args, meta)  # noqa: F821
    delta, h, gate_up, act, rows_h, rows_i = args.bufs[1], args.bufs[2], args.bufs[5], args.bufs[6], args.bufs[7], \
        args.bufs[9]
    router, router_rows, top_k, renorm, scratch = args.w[9]
    logits, sel, wts, start, fill, order_t, order_w, xg, y = scratch
    hs, ds = h[:num], delta[:num]
    _router(hs, router, logits[:num], router_rows)  # noqa: F821  [num, experts]
    route(logits[:num], top_k, renorm, sel[:num], wts[:num])
    group(sel[:num], wts[:num], start, fill, order_t, order_w)
    ds[:] = 0.0
    for e in range(fill.shape[0]):
        a, b = start[e], start[e + 1]
        m = b - a
        if m == 0:
            continue
        gather(hs, order_t[a:b], xg[:m])  # [m, hidden]
        _gu(xg[:m], args.w[4][e], gate_up[:m], rows_h)  # noqa: F821  [m, 2 x ff]
        if m >= PARALLEL_MIN_ROWS:
            _act_p(gate_up[:m], act[:m])  # noqa: F821
        else:
            _act_s(gate_up[:m], act[:m])  # noqa: F821
        _down(act[:m], args.w[5][e], y[:m], rows_i)  # noqa: F821  [m, hidden]
        scatter_add(y[:m], order_t[a:b], order_w[a:b], ds)
    _post_norm(ds, args.w[8][4], meta[4], num >= PARALLEL_MIN_ROWS)  # noqa: F821


def scratch(capacity: int, hidden: int, num_experts: int, top_k: int) -> tuple:
    """`_layer_moe`'s scratch for up to `capacity` rows: (logits, sel, wts, start, fill, order_t, order_w, xg, y)."""
    return (np.zeros((capacity, num_experts), np.float32), np.zeros((capacity, top_k), np.int64),
            np.zeros((capacity, top_k), np.float32), np.zeros(num_experts + 1, np.int64),
            np.zeros(num_experts, np.int64), np.zeros(capacity * top_k, np.int64),
            np.zeros(capacity * top_k, np.float32), np.zeros((capacity, hidden), np.float32),
            np.zeros((capacity, hidden), np.float32))
