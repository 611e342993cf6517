"""Build a head for a target GGUF and train it: draft vocabulary, frozen target matrices, AdamW loop."""

from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from proposers.training.data import Dataset
from proposers.training.modules import DraftHead, HeadShape
from proposers.training.objectives import Batch, extra_positions, head_loss, make_batch, windows

log = logging.getLogger("speculant.train_head")


@dataclass
class TrainConfig:
    epochs: int
    lr: float
    batch_size: int  # windows per step
    seq_len: int  # rows per window
    unroll: int  # eagle: steps trained on the head's own features
    ce_weight: float  # eagle: weight of the cross-entropy beside the feature regression
    noise_abs: float  # eagle / mtp: uniform input-feature noise, absolute
    soft: float  # weight of the target's distribution (vs its token) in the cross-entropy
    seed: int
    bf16: bool = False  # bfloat16 autocast for the training forward (weights and optimizer stay float32)


def bf16_is_fast() -> bool:
    """Whether bfloat16 autocast beats float32 here on a head-sized product, timed (best of 3 each).

    oneDNN's support flag alone is not enough: on a Xeon VM that advertises AMX without letting it be
    used, a bfloat16 product ran 3.7x slower than float32, and so did the whole training step."""
    if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return False
    x, w = torch.randn(512, 576), torch.randn(576, 2048)  # [rows, hidden] @ [hidden, draft vocab slice]

    def best_s(bf16: bool) -> float:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            x @ w  # oneDNN picks and JITs its kernel on the first call
            times = []
            for _ in range(3):
                start = time.perf_counter()
                x @ w
                times.append(time.perf_counter() - start)
        return min(times)

    return best_s(True) < 0.8 * best_s(False)


def choose_draft_vocab(data: Dataset, size: int, vocab_size: int) -> np.ndarray:
    """[V_d] ascending ids: the most frequent answer tokens of the training split, then prompt tokens,
    then the lowest remaining ids (BPE ids roughly follow merge order, i.e. corpus frequency)."""
    size = min(size, vocab_size)
    answer = np.bincount(data.answer_tokens(held_out=False), minlength=vocab_size)
    prompt = np.zeros(vocab_size, np.int64)
    for i in data.split(held_out=False):
        ids, _, prompt_len = data.seq(i)
        prompt += np.bincount(ids[:prompt_len], minlength=vocab_size)
    order = np.lexsort((np.arange(vocab_size), -prompt, -answer))  # last key sorts first
    return np.sort(order[:size]).astype(np.int32)


def draft_index_of(draft_vocab: np.ndarray, vocab_size: int) -> np.ndarray:
    """[vocab] int64: position of each token id in the draft vocab, -1 where it is not draftable."""
    index = np.full(vocab_size, -1, np.int64)
    index[draft_vocab] = np.arange(len(draft_vocab))
    return index


def target_matrices(model) -> tuple[np.ndarray, np.ndarray]:
    """(embedding [V, H], LM head [V, H]) of the target, dequantized to float32."""
    embed = model.dense("token_embd.weight")
    lm_head = embed if model.config.tied_embeddings else model.dense("output.weight")
    return embed, lm_head


def build_head(model, kind: str, num_modules: int, intermediate_size: int | None, draft_vocab: np.ndarray,
               seed: int) -> DraftHead:
    cfg = model.config
    shape = HeadShape(kind, num_modules, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                      intermediate_size or cfg.intermediate_size, cfg.rms_eps, cfg.rope_theta)
    embed, lm_head = target_matrices(model)
    torch.manual_seed(seed)
    return DraftHead(shape, torch.from_numpy(np.array(embed)), torch.from_numpy(np.array(lm_head[draft_vocab])))


def batches_of(items: list, batch_size: int, rng: random.Random | None) -> list[list]:
    """Windows grouped into batches of similar length (less padding); shuffled when `rng` is given."""
    items = list(items)
    if rng is not None:
        rng.shuffle(items)
    groups = []
    for lo in range(0, len(items), batch_size * 8):  # sort by length within pools of 8 batches
        pool = sorted(items[lo: lo + batch_size * 8], key=lambda w: w[2] - w[1])
        groups += [pool[i: i + batch_size] for i in range(0, len(pool), batch_size)]
    if rng is not None:
        rng.shuffle(groups)
    return groups


def eval_batches(data: Dataset, head: DraftHead, cfg: TrainConfig, draft_index: np.ndarray, num_drafts: int) -> list[Batch]:
    """The held-out sequences as batches, built once, reaching `num_drafts` + 1 positions past each row."""
    extra = max(extra_positions(head.shape.kind, head.shape.num_modules, cfg.unroll), num_drafts + 1)
    held = windows(data, data.split(held_out=True), cfg.seq_len)
    return [make_batch(data, g, extra, draft_index) for g in batches_of(held, cfg.batch_size, None)]


def train(head: DraftHead, data: Dataset, cfg: TrainConfig, draft_index: np.ndarray) -> dict:
    """AdamW with warm-up and cosine decay; returns the loss history and timing."""
    extra = extra_positions(head.shape.kind, head.shape.num_modules, cfg.unroll)
    items = windows(data, data.split(held_out=False), cfg.seq_len)
    steps_per_epoch = math.ceil(len(items) / cfg.batch_size)
    num_steps = max(1, cfg.epochs * steps_per_epoch)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.01)
    warmup = max(1, num_steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s / num_steps, 1.0)))))
    rng, losses, start = random.Random(cfg.seed), [], time.perf_counter()
    torch.manual_seed(cfg.seed)
    head.train()
    with tqdm(total=num_steps, desc=f"train {head.shape.kind}", unit="step") as bar:
        for _ in range(cfg.epochs):
            for group in batches_of(items, cfg.batch_size, rng):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
                    loss, parts = head_loss(head, make_batch(data, group, extra, draft_index), cfg, train=True)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
                sched.step()
                losses.append(loss.item())
                bar.update(1)
                bar.set_postfix(loss=f"{np.mean(losses[-20:]):.3f}", **{k: f"{v:.2f}" for k, v in parts.items()})
    head.eval()
    tail = min(steps_per_epoch, max(1, len(losses) // 2))  # first vs last epoch: the same windows
    return {
        "steps": len(losses),
        "epochs": cfg.epochs,
        "bf16": cfg.bf16,
        "train_windows": len(items),
        "train_s": round(time.perf_counter() - start, 1),
        "train_loss_first": round(float(np.mean(losses[:tail])), 4),
        "train_loss_last": round(float(np.mean(losses[-tail:])), 4),
    }
