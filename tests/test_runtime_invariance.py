"""A request's logits are bit-identical however its tokens are batched (real SmolLM2 model), in
both numerics modes (int8 integer products with an fp16 KV cache; exact float32).

(a) one token per step vs T tokens per step, (b) alone vs inside a ragged batch with
other requests, (c) however its prompt is split into prefill chunks. Speculative
decoding is lossless only because of this.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.model.cpu_runner import ForwardBatch


class Harness:
    """Feeds runs of tokens for several requests through the runner, tracking their caches."""

    def __init__(self, engine, columns: np.ndarray | None = None):
        # Blocks come from the engine's own manager: the runner's KV cache is shared with it, and
        # writing blocks it believes hold a cached prefix would corrupt later requests.
        self.runner = engine.runner
        self.blocks = engine.scheduler.blocks
        self.batch = ForwardBatch(self.runner.cache)
        self.tables: dict[str, list[int]] = {}
        self.cached: dict[str, int] = {}
        self.columns = columns  # keep only these vocabulary columns of each row (None: all)

    def step(self, runs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Append each request's run; returns logits for every appended token, per request."""
        self.batch.clear()
        for rid, run in runs.items():
            table = self.tables.setdefault(rid, [])
            n0 = self.cached.setdefault(rid, 0)
            assert self.blocks.allocate(table, n0 + len(run))
            self.batch.add(np.asarray(run, np.int32), n0, table, len(run))
        logits = self.runner.forward(self.batch)
        out, row = {}, 0
        for rid, run in runs.items():
            rows = logits[row : row + len(run)]
            out[rid] = rows.copy() if self.columns is None else rows[:, self.columns]
            row += len(run)
            self.cached[rid] += len(run)
        return out

    def release(self):
        for table in self.tables.values():
            self.blocks.free_blocks(table)


def feed(engine, tokens: np.ndarray, chunks: list[int], others: dict[str, np.ndarray] | None = None,
         columns: np.ndarray | None = None) -> np.ndarray:
    """Logits of every token of `tokens` (only `columns` of them, if given), fed in the given chunk sizes,
    optionally beside other requests."""
    h = Harness(engine, columns)
    others = others or {}
    other_pos = dict.fromkeys(others, 0)
    rows, pos = [], 0
    for i, n in enumerate(chunks):
        runs = {}
        for j, (name, other) in enumerate(others.items()):
            if j == len(others) // 2:
                runs["me"] = tokens[pos : pos + n]  # "me" sits in the middle of the batch
            k = 1 + (i + 2 * j) % 5  # other requests append ragged runs of 1..5 tokens
            runs[name] = other[other_pos[name] : other_pos[name] + k]
            other_pos[name] += k
        runs.setdefault("me", tokens[pos : pos + n])
        rows.append(h.step(runs)["me"])
        pos += n
    h.release()
    assert pos == len(tokens)
    return np.concatenate(rows)


@pytest.fixture(scope="module")
def tokens(runner):
    rng = np.random.default_rng(1234)
    return rng.integers(0, runner.config.vocab_size, size=80).astype(np.int32)


def split(total: int, sizes) -> list[int]:
    out, i = [], 0
    while sum(out) < total:
        out.append(min(sizes[i % len(sizes)], total - sum(out)))
        i += 1
    return out


def test_one_token_per_step_equals_t_tokens_per_step(any_engine, tokens):
    prompt, tail = 48, len(tokens) - 48
    reference = feed(any_engine, tokens, [prompt] + [1] * tail)
    for t in (2, 3, 4, 8, 16):
        got = feed(any_engine, tokens, [prompt] + split(tail, [t]))
        assert np.array_equal(got, reference), f"T={t} changed the logits"


def test_alone_equals_inside_a_ragged_batch(any_engine, tokens):
    rng = np.random.default_rng(7)
    others = {f"other{i}": rng.integers(0, any_engine.runner.config.vocab_size, 300).astype(np.int32) for i in range(3)}
    chunks = [48] + split(len(tokens) - 48, [1, 4, 2, 8])
    alone = feed(any_engine, tokens, chunks)
    batched = feed(any_engine, tokens, chunks, others)
    assert np.array_equal(alone, batched)


@pytest.mark.parametrize("sizes", [[7], [16, 3], [1, 30, 5], [64]])
def test_prefill_chunking_does_not_change_logits(any_engine, tokens, sizes):
    whole = feed(any_engine, tokens, [len(tokens)])
    chunked = feed(any_engine, tokens, split(len(tokens), sizes))
    assert np.array_equal(whole, chunked)
