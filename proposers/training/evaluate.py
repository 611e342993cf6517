"""Held-out loss and acceptance under greedy chain drafting, simulated on the target's own answers.

For each held-out start p (x_{p+1} is an answer token, so the target has just produced it, and
the K answer tokens after it exist), the head drafts K tokens by running on its own outputs.
Draft k is accepted if it and every draft before it equal the answer token x_{p+1+k}: with
greedy answers these are the target's greedy continuation. The per-position rate k is the
fraction of starts whose first k drafts were all accepted (vLLM's per-position acceptance);
mean acceptance length = 1 + their sum (the target's own token counts as one).

What a draft row may attend to (the rows whose inputs are known at drafting time):
  eagle: teacher-forced rows <= p, then its own earlier draft rows (positions p+1, p+2, ...);
  mtp:   module i's teacher-forced rows <= p - i (they need x_{q+1+i}), and itself, at position p;
  medusa: no attention.
"""

from __future__ import annotations

import numpy as np
import torch

from proposers.training.objectives import Batch, causal_mask, head_loss


def draft_tokens(head, b: Batch, num_drafts: int, draft_vocab: torch.Tensor) -> torch.Tensor:
    """[B, T, K] greedy draft token ids for every start p of the batch."""
    T, kind = b.num_rows, head.shape.kind
    feat, pos = b.features[:, :T], b.pos[:, :T]
    drafts = []
    if kind == "medusa":
        for i, module in enumerate(head.m[:num_drafts]):
            drafts.append(draft_vocab[head.logits(module(feat)).argmax(-1)])
        return torch.stack(drafts, -1)
    if kind == "eagle":
        module = head.m[0]
        z, (k1, v1) = module(head.embed[b.token_ids[:, b.at(1)]], feat, pos)
        drafts.append(draft_vocab[head.logits(z).argmax(-1)])
        chain, visible = [], causal_mask(T)
        for j in range(2, num_drafts + 1):
            z, kv = module(head.embed[drafts[-1]], z, pos + j - 1, (k1, v1, visible), chain)
            chain.append(kv)
            drafts.append(draft_vocab[head.logits(z).argmax(-1)])
        return torch.stack(drafts, -1)
    # mtp: teacher-forced rows of every module first, then the chain at position p
    cache, tf_feat = [], feat
    for i, module in enumerate(head.m):
        tf_feat, kv = module(head.embed[b.token_ids[:, b.at(1 + i)]], tf_feat, pos)
        cache.append((kv, tf_feat))
    z = cache[0][1]
    drafts.append(draft_vocab[head.logits(z, 0).argmax(-1)])
    for depth in range(1, num_drafts):
        i = min(depth, len(head.m) - 1)
        (k, v), _ = cache[i]
        z, _ = head.m[i](head.embed[drafts[-1]], z, pos, (k, v, causal_mask(T, shift=i)))
        drafts.append(draft_vocab[head.logits(z, i).argmax(-1)])
    return torch.stack(drafts, -1)


@torch.no_grad()
def acceptance(head, batches: list[Batch], num_drafts: int, draft_vocab: np.ndarray) -> dict:
    """Mean acceptance length and per-position acceptance rates over the held-out starts."""
    vocab = torch.from_numpy(draft_vocab.astype(np.int64))
    accepted = torch.zeros(num_drafts, dtype=torch.int64)
    num_starts = 0
    for b in batches:
        drafts = draft_tokens(head, b, num_drafts, vocab)  # [B, T, K]
        truth = torch.stack([b.token_ids[:, b.at(1 + k)] for k in range(1, num_drafts + 1)], -1)
        is_start = b.is_answer[:, b.at(1)] & b.is_valid[:, b.at(1 + num_drafts)]  # [B, T]
        run = (drafts == truth).to(torch.int64).cumprod(-1)  # [B, T, K]: first k all accepted
        accepted += run[is_start].sum(0)
        num_starts += int(is_start.sum())
    rates = (accepted.double() / max(num_starts, 1)).tolist()
    return {
        "num_drafts": num_drafts,
        "num_starts": num_starts,
        "per_position": [round(r, 4) for r in rates],
        "mean_acceptance_length": round(1 + sum(rates), 4),
    }


@torch.no_grad()
def mean_loss(head, batches: list[Batch], cfg) -> tuple[float, dict]:
    """Loss and its parts averaged over batches (no input noise)."""
    totals, parts = [], {}
    for b in batches:
        loss, p = head_loss(head, b, cfg, train=False)
        totals.append(float(loss))
        for k, v in p.items():
            parts.setdefault(k, []).append(v)
    return float(np.mean(totals)), {k: round(float(np.mean(v)), 4) for k, v in parts.items()}
