"""Mixture-of-experts FFN (Qwen3-MoE, Mixtral): a router scores every expert for each token, the token runs
its top k experts' gated FFNs, and their outputs, weighted by the router's softmax, add up.

A MoE layer's LayerArgs (engine/kernels/layer.py) differ from a dense one's in four places: w[4] and w[5]
hold every expert's gate_up and down product arguments (UniTuples: one format per layer, indexed by
expert), w[9] the router: (its product arguments, its input buffers, top k, renormalize, scratch, shared),
and w[10] a shared expert's (gate_up, down, its gate_up, act and down-input buffers) (Qwen2-MoE: every
token runs it, its output times the sigmoid of its gate's row of the router; a layer without one holds
expert 0's products and the routed buffers there, unused).

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
    """A layer's packed router [experts, hidden] and experts: gate_up [2 x ff, hidden] and down [hidden, ff] each;
    with a shared expert (Qwen2-MoE) its gate_up and down, and the router one row longer: its gate's."""

    router: object
    gate_up: tuple
    down: tuple
    shared_gate_up: object = None
    shared_down: object = None

    def active_bytes(self, top_k: int) -> int:
        """What one token's FFN streams: the router, k experts and the shared one."""
        shared = 0 if self.shared_down is None else self.shared_gate_up.nbytes + self.shared_down.nbytes
        return self.router.nbytes + top_k * (self.gate_up[0].nbytes + self.down[0].nbytes) + shared


@nb.njit(cache=True)
def route(logits, experts, top_k, renorm, sel, wts):
    """Per row of logits [T, experts (+ a shared expert's gate, not routed)]: its top_k experts by softmax
    probability (ties: the lower id) into sel [T, top_k], their probabilities into wts [T, top_k], divided by
    the top k's sum when renorm."""
    num = logits.shape[0]
    p = np.empty(experts, np.float32)
    for t in range(num):
        high = logits[t, :experts].max()
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
def add_gated(y, logits, col, out):
    """out[t] += sigmoid(logits[t, col]) * y[t]: a shared expert's output under its gate."""
    for t in range(y.shape[0]):
        g = np.float32(1.0) / (np.float32(1.0) + np.exp(-logits[t, col]))
        for c in range(y.shape[1]):
            out[t, c] += g * y[t, c]


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
    router, router_rows, top_k, renorm, scratch, shared = args.w[9]
    logits, sel, wts, start, fill, order_t, order_w, xg, y = scratch
    hs, ds, experts = h[:num], delta[:num], fill.shape[0]
    par = num >= PARALLEL_MIN_ROWS
    _router(hs, router, logits[:num], router_rows)  # noqa: F821  [num, experts (+ the shared expert's gate)]
    route(logits[:num], experts, top_k, renorm, sel[:num], wts[:num])
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
    if shared:  # every token, after the routed experts; w[10]: its products' arguments and its buffers
        w_gu, w_down, gate_up_sh, act_sh, rows_sh = args.w[10]
        _gu_sh(hs, w_gu, gate_up_sh[:num], rows_h)  # noqa: F821  [num, 2 x shared ff]
        if par:
            _act_p(gate_up_sh[:num], act_sh[:num])  # noqa: F821
        else:
            _act_s(gate_up_sh[:num], act_sh[:num])  # noqa: F821
        _down_sh(act_sh[:num], w_down, y[:num], rows_sh)  # noqa: F821
        add_gated(y[:num], logits, experts, ds)
    _post_norm(ds, args.w[8][4], meta[4], par)  # noqa: F821


def scratch(capacity: int, hidden: int, num_experts: int, top_k: int, shared: bool = False) -> tuple:
    """`_layer_moe`'s scratch for up to `capacity` rows: (logits, sel, wts, start, fill, order_t, order_w, xg, y);
    shared: the logits hold a shared expert's gate after the experts'."""
    return (np.zeros((capacity, num_experts + shared), np.float32), np.zeros((capacity, top_k), np.int64),
            np.zeros((capacity, top_k), np.float32), np.zeros(num_experts + 1, np.int64),
            np.zeros(num_experts, np.int64), np.zeros(capacity * top_k, np.int64),
            np.zeros(capacity * top_k, np.float32), np.zeros((capacity, hidden), np.float32),
            np.zeros((capacity, hidden), np.float32))
