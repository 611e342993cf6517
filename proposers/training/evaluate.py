"""Held-out loss and acceptance under greedy chain drafting, simulated on the target's own answers.

For each held-out start p (x_{p+1} is an answer token, so the target has just produced it, and
the K answer tokens after it exist), the head drafts K tokens by running on its own outputs.
Draft k is accepted if it and every draft before it equal the answer token x_{p+1+k}: with
greedy answers these are the target's greedy continuation. The per-position rate k is the
fraction of starts whose first k drafts were all accepted (vLLM's per-position acceptance);
mean acceptance length = 1 + their sum (the target's own token counts as one).

Two ways to choose the starts:
  served walk (the headline): the starts greedy serving reaches. A step at p that accepts a drafts
    ends with the target emitting x_{p+a+2}, so the next step starts at p + a + 1, mostly right
    after a rejected draft, where prediction is harder than on average;
  all starts: every answer position (more starts, less noise, but optimistic).

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
    """Served-walk and all-starts acceptance of the head's greedy drafts on the held-out batches."""
    vocab = torch.from_numpy(draft_vocab.astype(np.int64))
    drafts = [draft_tokens(head, b, num_drafts, vocab) for b in batches]  # each [B, T, K]
    return acceptance_of_drafts(drafts, batches, num_drafts)


def acceptance_of_drafts(drafts: list[torch.Tensor], batches: list[Batch], num_drafts: int) -> dict:
    """Both reports from drafts [B, T, K] (drafts[b, p, k] is the guess for x_{p+2+k}) of each batch."""
    all_starts, walk = [], []
    for d, b in zip(drafts, batches):
        truth = torch.stack([b.token_ids[:, b.at(1 + k)] for k in range(1, num_drafts + 1)], -1)  # [B, T, K]
        accepted = (d == truth).to(torch.int64).cumprod(-1).sum(-1).numpy()  # [B, T]: leading drafts right
        is_start = (b.is_answer[:, b.at(1)] & b.is_valid[:, b.at(1 + num_drafts)]).numpy()  # [B, T]
        all_starts.append(accepted[is_start])
        walk += [walk_steps(row, starts) for row, starts in zip(accepted, is_start)]
    none = np.zeros(0, np.int64)
    walk_counts, start_counts = np.concatenate([none, *walk]), np.concatenate([none, *all_starts])
    return {
        "num_drafts": num_drafts,
        "served_walk": {"num_steps": len(walk_counts), **summary(walk_counts, num_drafts)},
        "all_starts": {"num_starts": len(start_counts), **summary(start_counts, num_drafts)},
    }


def walk_steps(accepted: np.ndarray, is_start: np.ndarray) -> np.ndarray:
    """Accepted drafts of each step of the greedy serving walk through one window's rows.

    accepted [T]: leading drafts from start p equal to the answer; is_start [T]: p is a start.
    The walk begins at the first start (a window's first answer start: the last prompt row, or
    row 0 of a window that continues a sequence), a step accepting a moves it to p + a + 1, and
    it ends at the first row that is not a start (the answer runs out or the window ends). Each
    window is walked on its own: eval batches regroup windows, and draft rows only see their own
    window. Restarting at a continuation window's row 0 misplaces one step per `seq_len` rows.
    """
    steps, rows = [], np.flatnonzero(is_start)
    p = int(rows[0]) if len(rows) else len(is_start)
    while p < len(is_start) and is_start[p]:
        steps.append(int(accepted[p]))
        p += int(accepted[p]) + 1
    return np.asarray(steps, np.int64)


def summary(counts: np.ndarray, num_drafts: int) -> dict:
    """Per-position rates and mean acceptance length from each step's accepted-draft count."""
    rates = [float(np.mean(counts > k)) if len(counts) else 0.0 for k in range(num_drafts)]
    return {"per_position": [round(r, 4) for r in rates], "mean_acceptance_length": round(1 + sum(rates), 4)}


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
