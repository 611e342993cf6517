"""Self-distillation data: the target's own answers, then its final-normed hidden state at every position.

1. The real engine answers each prompt (greedy by default), exactly as it would when serving.
2. A fresh runner (sharing the engine's packed weights) runs every prompt + answer once more with
   `capture_hidden`, recording f_p, the final-normed hidden state that feeds the LM head.
   The engine's kernels give the same row values however the rows are batched or chunked.

Everything is cached in one `.npz`; a cache made with other settings is rebuilt.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from tqdm import tqdm

log = logging.getLogger("speculant.train_head")


@dataclass
class Dataset:
    token_ids: np.ndarray  # [total_tokens] int32, every sequence (prompt + answer) back to back
    features: np.ndarray  # [total_tokens, hidden] float16, f_p of each position
    cu_seqlens: np.ndarray  # [num_seqs + 1] int64, sequence i is rows cu_seqlens[i]:cu_seqlens[i+1]
    prompt_lens: np.ndarray  # [num_seqs] int32
    is_held_out: np.ndarray  # [num_seqs] bool
    meta: dict  # settings that made the data, plus timings

    @property
    def num_seqs(self) -> int:
        return len(self.prompt_lens)

    def seq(self, i: int) -> tuple[np.ndarray, np.ndarray, int]:
        """(token_ids [n], features [n, hidden], prompt_len) of sequence i."""
        lo, hi = self.cu_seqlens[i], self.cu_seqlens[i + 1]
        return self.token_ids[lo:hi], self.features[lo:hi], int(self.prompt_lens[i])

    def split(self, held_out: bool) -> list[int]:
        return [i for i in range(self.num_seqs) if bool(self.is_held_out[i]) == held_out]

    def answer_tokens(self, held_out: bool) -> np.ndarray:
        """[num_answer_tokens] the answer tokens of the train (or held-out) sequences."""
        cu, starts = self.cu_seqlens, self.cu_seqlens[:-1] + self.prompt_lens
        parts = [self.token_ids[starts[i]: cu[i + 1]] for i in self.split(held_out)]
        return np.concatenate(parts) if parts else np.zeros(0, np.int32)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp.npz")
        np.savez(tmp, token_ids=self.token_ids, features=self.features, cu_seqlens=self.cu_seqlens,
                 prompt_lens=self.prompt_lens, is_held_out=self.is_held_out, meta=np.array(json.dumps(self.meta)))
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> Dataset:
        with np.load(path) as z:
            return cls(z["token_ids"], z["features"], z["cu_seqlens"], z["prompt_lens"], z["is_held_out"],
                       json.loads(str(z["meta"])))


def make_engine(model_path: Path, max_model_len: int, max_num_seqs: int, threads: int):
    """A plain (non-speculative) engine sized for `max_num_seqs` requests of `max_model_len` tokens."""
    from engine.model.cpu_runner import CpuRunner
    from engine.model.gguf_loader import GGUFModel
    from engine.llm_engine import LLMEngine

    per_block = CpuRunner.kv_bytes_per_block(GGUFModel(model_path).config, 16)
    num_blocks = max_num_seqs * (-(-max_model_len // 16) + 1) + 1
    args = SimpleNamespace(
        model=str(model_path), max_model_len=max_model_len, kv_cache_memory=num_blocks * per_block / 2**30,
        block_size=16, max_num_seqs=max_num_seqs, max_num_batched_tokens=512, threads=threads, device="cpu",
        speculative_config=None, served_model_name=None,
    )
    return LLMEngine.from_args(args)


def generate_answers(engine, prompt_ids: list[list[int]], max_tokens: int, temperature: float,
                     seed: int) -> list[list[int]]:
    """The engine's answer (token ids, a final stop token included) to each prompt."""
    from engine.serving.protocol import Generate, SamplingParams

    answers: dict[str, list[int]] = {}
    for i, ids in enumerate(prompt_ids):
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed + i)
        engine.add_request(Generate(f"train-{i}", params, prompt_token_ids=ids))
        answers[f"train-{i}"] = []
    with tqdm(total=len(prompt_ids), desc="generate answers", unit="prompt") as bar:
        while engine.has_unfinished():
            for out in engine.step():
                answers[out.request_id] += out.token_ids
                bar.update(out.finish_reason is not None)
    return [answers[f"train-{i}"] for i in range(len(prompt_ids))]


def capture_features(model, weights_from, sequences: list[list[int]], budget: int = 512) -> list[np.ndarray]:
    """[n_i, hidden] float16 final-normed hidden states of each sequence (a fresh KV cache, shared weights)."""
    from engine.model.cpu_runner import CacheConfig, CpuRunner, ForwardBatch

    max_seqs = 64
    longest = max(len(s) for s in sequences)
    num_blocks = max(-(-longest // 16), -(-budget // 16) + max_seqs) + 1
    cache = CacheConfig(16, num_blocks, longest + 1, max_seqs, budget)
    runner = CpuRunner(model, cache, weights_from=weights_from)
    runner.capture_hidden = True
    batch, out = ForwardBatch(cache), []
    with tqdm(total=sum(map(len, sequences)), desc="capture features", unit="tok") as bar:
        for pack in _packs(sequences, budget, max_seqs):
            if len(sequences[pack[0]]) > budget:  # one long sequence, chunk by chunk
                out.append(_capture_long(runner, batch, np.asarray(sequences[pack[0]], np.int32), budget))
            else:  # whole sequences side by side, each in its own blocks
                out += _capture_pack(runner, batch, [np.asarray(sequences[j], np.int32) for j in pack])
            bar.update(sum(len(sequences[j]) for j in pack))
    return out


def _capture_pack(runner, batch, seqs: list[np.ndarray]) -> list[np.ndarray]:
    batch.clear()
    next_block = 0
    for seq in seqs:
        num_blocks = -(-len(seq) // 16)
        batch.add(seq, 0, list(range(next_block, next_block + num_blocks)), 1)
        next_block += num_blocks
    runner.forward(batch)
    hidden = runner.hidden_states(batch.num_tokens)  # [num_tokens, hidden]
    return [hidden[batch.cu_q[r]: batch.cu_q[r + 1]].astype(np.float16) for r in range(len(seqs))]


def _capture_long(runner, batch, seq: np.ndarray, budget: int) -> np.ndarray:
    parts, table = [], list(range(-(-len(seq) // 16)))
    for start in range(0, len(seq), budget):
        chunk = seq[start: start + budget]
        batch.clear()
        batch.add(chunk, start, table, 1)
        runner.forward(batch)
        parts.append(runner.hidden_states(len(chunk)).astype(np.float16))
    return np.concatenate(parts)


def _packs(sequences: list[list[int]], budget: int, max_seqs: int) -> list[list[int]]:
    """Group sequence indices so that each group fits one forward (a longer sequence is a group alone)."""
    packs, current, used = [], [], 0
    for j, s in enumerate(sequences):
        if current and (used + len(s) > budget or len(current) == max_seqs):
            packs.append(current)
            current, used = [], 0
        current.append(j)
        used += len(s)
    return packs + ([current] if current else [])


def build_dataset(model_path: Path, conversations: list[list[dict]], settings: dict) -> Dataset:
    """Tokenize with the chat template, generate the answers, capture the features, split off held-out."""
    from engine.model.gguf_loader import GGUFModel
    from engine.model.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(model_path)
    max_prompt = settings["max_prompt_tokens"]
    prompts = [tokenizer.encode(tokenizer.apply_chat_template(c, True)) for c in conversations]
    kept = [p for p in prompts if len(p) <= max_prompt]
    if len(kept) < len(prompts):
        log.warning("skipped %d prompts longer than %d tokens", len(prompts) - len(kept), max_prompt)
    if len(kept) < 2:
        raise ValueError("prompts: need at least 2 prompts (one train, one held-out) within --max-prompt-tokens")
    max_len = max(map(len, kept)) + settings["max_tokens"] + 1
    engine = make_engine(model_path, max_len, settings["max_num_seqs"], settings["threads"])
    start = time.perf_counter()
    answers = generate_answers(engine, kept, settings["max_tokens"], settings["temperature"], settings["seed"])
    gen_s = time.perf_counter() - start
    sequences = [p + a for p, a in zip(kept, answers)]
    features = capture_features(GGUFModel(model_path), engine.runner, sequences)
    num_held = max(1, round(settings["held_out"] * len(kept)))
    is_held_out = np.zeros(len(kept), bool)
    is_held_out[np.random.default_rng(settings["seed"]).permutation(len(kept))[:num_held]] = True
    meta = dict(settings, generate_s=round(gen_s, 1), capture_s=round(time.perf_counter() - start - gen_s, 1))
    return Dataset(
        token_ids=np.concatenate([np.asarray(s, np.int32) for s in sequences]),
        features=np.concatenate(features),
        cu_seqlens=np.concatenate([[0], np.cumsum([len(s) for s in sequences])]).astype(np.int64),
        prompt_lens=np.array([len(p) for p in kept], np.int32),
        is_held_out=is_held_out,
        meta=meta,
    )


def load_or_build(path: Path, model_path: Path, conversations: list[list[dict]], settings: dict) -> Dataset:
    """The cached dataset at `path` if it was made with these settings, else a new one (saved there)."""
    if path.is_file():
        data = Dataset.load(path)
        # Threads and batch width do not change the data: the engine's rows are batch-invariant.
        if all(data.meta.get(k) == v for k, v in settings.items() if k not in ("threads", "max_num_seqs")):
            log.info("reusing the cached dataset %s", path)
            return data
        log.warning("the cached dataset %s was made with other settings: rebuilding it", path)
    data = build_dataset(model_path, conversations, settings)
    data.save(path)
    return data
