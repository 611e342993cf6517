"""Picking draft tokens from a proposer's logits: greedy, or sampled with q kept for verification."""

from __future__ import annotations

import numpy as np

from proposers.base import DraftRequest


def pick_tokens(logits: np.ndarray, draft_vocab: np.ndarray, asks: list[DraftRequest], vocab_size: int, rng):
    """One draft token per row of logits [R, V_d]: greedy at temperature 0, else sampled from
    q = softmax(logits / T) (the full-vocabulary q row comes back for rejection verification)."""
    tokens = np.empty(len(asks), np.int32)
    probs: list[np.ndarray | None] = []
    for r, ask in enumerate(asks):
        if ask.temperature <= 0:
            tokens[r] = draft_vocab[int(np.argmax(logits[r]))]
            probs.append(None)
            continue
        z = logits[r].astype(np.float64) / ask.temperature
        q = np.exp(z - z.max())
        q /= q.sum()
        gen = ask.rng if ask.rng is not None else rng
        i = min(int(np.searchsorted(np.cumsum(q), gen.random() * q.sum(), side="right")), len(q) - 1)
        tokens[r] = draft_vocab[i]
        row = np.zeros(vocab_size, np.float32)
        row[draft_vocab] = q
        probs.append(row)
    return tokens, probs
