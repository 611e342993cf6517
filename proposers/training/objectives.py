"""Training batches and the loss of each head kind.

A batch holds B windows of sequences (prompt + answer); rows 0..T-1 of a window are the rows
trained, and `extra` more positions follow so every target exists (padding past a sequence's
end is masked out). Only targets that are answer tokens (the target model's own output) count
in the cross-entropy; they are draft-vocabulary indices, -1 (ignored) outside it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from proposers.training.data import Dataset


@dataclass
class Batch:
    token_ids: torch.Tensor  # [B, L] int64
    draft_ids: torch.Tensor  # [B, L] int64, index into the draft vocab, -1 outside it
    features: torch.Tensor  # [B, L, H] float32, f_p
    pos: torch.Tensor  # [B, L] int64, position in the sequence
    is_valid: torch.Tensor  # [B, L] bool, inside the sequence
    is_answer: torch.Tensor  # [B, L] bool, an answer token
    num_rows: int  # T = L - extra

    def at(self, offset: int) -> slice:
        """Columns offset .. offset+T-1: the value at p + offset for each row p."""
        return slice(offset, offset + self.num_rows)


def windows(data: Dataset, seq_ids: list[int], seq_len: int) -> list[tuple[int, int, int]]:
    """(sequence, start, stop) row windows of at most `seq_len` rows covering the sequences."""
    out = []
    for i in seq_ids:
        n = int(data.cu_seqlens[i + 1] - data.cu_seqlens[i])
        out += [(i, start, min(n, start + seq_len)) for start in range(0, n - 1, seq_len)]
    return out


def make_batch(data: Dataset, items: list[tuple[int, int, int]], extra: int, draft_index: np.ndarray) -> Batch:
    rows = max(stop - start for _, start, stop in items)
    size, hidden = rows + extra, data.features.shape[1]
    tokens = np.zeros((len(items), size), np.int64)
    feats = np.zeros((len(items), size, hidden), np.float32)
    is_valid = np.zeros((len(items), size), bool)
    is_answer = np.zeros((len(items), size), bool)
    pos = np.arange(size)[None].repeat(len(items), 0)
    for b, (i, start, stop) in enumerate(items):
        ids, f, prompt_len = data.seq(i)
        end = min(len(ids), stop + extra)
        tokens[b, : end - start], feats[b, : end - start] = ids[start:end], f[start:end]
        is_valid[b, : end - start] = True
        is_answer[b, : end - start] = np.arange(start, end) >= prompt_len
        pos[b] += start
    t = torch.from_numpy
    return Batch(t(tokens), t(draft_index[tokens]), t(feats), t(pos), t(is_valid), t(is_answer), rows)


def draft_ce(head, z, b: Batch, offset: int, module: int = 0, soft: float = 0.0) -> torch.Tensor:
    """Cross-entropy of the draft logits of rows z [B, T, H] against the token at p + offset:
    (1 - soft) x the answer token (rows where it is an answer token inside the draft vocab)
    + soft x the target's own distribution there, softmax(f_{p+offset-1} @ lm_head[draft_vocab].T)."""
    cols = b.at(offset)
    target = b.draft_ids[:, cols]
    is_hard = b.is_valid[:, cols] & b.is_answer[:, cols] & (target >= 0)
    rows = b.is_valid[:, cols] if soft > 0 else is_hard
    if not rows.any():
        return z.sum() * 0.0
    logp = F.log_softmax(head.logits(z[rows], module), -1)  # [num_rows, V_d]
    loss = z.sum() * 0.0
    hard = is_hard[rows]
    if soft < 1 and hard.any():
        loss = loss + (1 - soft) * F.nll_loss(logp[hard], target[rows][hard])
    if soft > 0:
        with torch.no_grad():
            teacher = torch.softmax((b.features[:, b.at(offset - 1)][rows] @ head.lm_head.T).float(), -1)
        loss = loss + soft * -(teacher * logp).sum(-1).mean()
    return loss


def causal_mask(num_rows: int, shift: int = 0) -> torch.Tensor:
    """[T, T] bool: row t sees rows s <= t - shift."""
    idx = torch.arange(num_rows)
    return idx[None, :] <= idx[:, None] - shift


def eagle_loss(head, b: Batch, unroll: int, ce_weight: float, noise: float, soft: float) -> tuple[torch.Tensor, dict]:
    """Step j (1..unroll) predicts f_{p+j} (SmoothL1) and x_{p+j+1} (CE) from step j-1's feature
    (step 1: the target's f_p, with uniform noise) and the real token x_{p+j}."""
    T, module = b.num_rows, head.m[0]
    feat = b.features[:, :T]
    if noise > 0:
        feat = feat + (torch.rand_like(feat) * 2 - 1) * noise
    z, (k1, v1) = module(head.embed[b.token_ids[:, b.at(1)]], feat, b.pos[:, :T])
    total, parts, chain, visible = 0.0, {}, [], causal_mask(T)
    for j in range(1, unroll + 1):
        if j > 1:
            z, kv = module(head.embed[b.token_ids[:, b.at(j)]], z, b.pos[:, :T] + j - 1, (k1, v1, visible), chain)
            chain.append(kv)
        valid = b.is_valid[:, b.at(j)]
        reg = F.smooth_l1_loss(z[valid].float(), b.features[:, b.at(j)][valid]) if valid.any() else z.sum() * 0.0
        ce = draft_ce(head, z, b, j + 1, soft=soft)
        total = total + 0.7 ** (j - 1) * (reg + ce_weight * ce)
        parts[f"reg{j}"], parts[f"ce{j}"] = reg.item(), ce.item()
    return total, parts


def mtp_loss(head, b: Batch, noise: float, soft: float) -> tuple[torch.Tensor, dict]:
    """Module i (teacher-forced token x_{p+1+i}, feature z of module i-1) predicts x_{p+2+i}."""
    T = b.num_rows
    feat = b.features[:, :T]
    if noise > 0:
        feat = feat + (torch.rand_like(feat) * 2 - 1) * noise
    total, parts = 0.0, {}
    for i, module in enumerate(head.m):
        feat, _ = module(head.embed[b.token_ids[:, b.at(1 + i)]], feat, b.pos[:, :T])
        ce = draft_ce(head, feat, b, 2 + i, module=i, soft=soft)
        total = total + 0.8**i * ce
        parts[f"ce{i + 1}"] = ce.item()
    return total, parts


def medusa_loss(head, b: Batch, soft: float) -> tuple[torch.Tensor, dict]:
    """Head i on f_p predicts x_{p+2+i}."""
    f = b.features[:, : b.num_rows]
    total, parts = 0.0, {}
    for i, module in enumerate(head.m):
        ce = draft_ce(head, module(f), b, 2 + i, soft=soft)
        total = total + ce
        parts[f"ce{i + 1}"] = ce.item()
    return total, parts


def extra_positions(kind: str, num_modules: int, unroll: int) -> int:
    """How many positions past the last row the targets of `kind` reach."""
    return unroll + 1 if kind == "eagle" else num_modules + 1


def head_loss(head, b: Batch, cfg, train: bool) -> tuple[torch.Tensor, dict]:
    noise = cfg.noise_abs if train else 0.0
    if head.shape.kind == "eagle":
        return eagle_loss(head, b, cfg.unroll, cfg.ce_weight, noise, cfg.soft)
    if head.shape.kind == "mtp":
        return mtp_loss(head, b, noise, cfg.soft)
    return medusa_loss(head, b, cfg.soft)
