"""Completions' echo with logprobs (engine/core/prompt_echo.py): each prompt token's logprob is the model's after
the tokens before it, checked against a runner of the test's own, and unchanged by prefill chunking and by a
cached prefix (a scored prompt never reuses cached blocks)."""

from __future__ import annotations

import numpy as np
import pytest

from engine.serving.protocol import Generate, SamplingParams


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, model_path):
    from tiny_models import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("echo") / "tiny.gguf", model_path, seed=5)


def first_output(engine, prompt: list[int], params: SamplingParams, request_id: str):
    engine.add_request(Generate(request_id, params, prompt_token_ids=prompt))
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == request_id]
    return outs[0]


def reference_logprobs(tiny, prompt: list[int], top: int) -> list[tuple[float, list[int], int]]:
    """(logprob of token p, the top ids, 1 + how many logits exceed token p's) for p = 1.., each from a fresh
    forward over tokens 0..p-1."""
    from engine.model.cpu_runner import CacheConfig, CpuRunner, ForwardBatch
    from engine.model.gguf_loader import GGUFModel

    cache = CacheConfig(block_size=16, num_blocks=8, max_model_len=128, max_num_seqs=1, max_num_batched_tokens=128)
    runner = CpuRunner(GGUFModel(tiny), cache, num_threads=2, numerics="int8")
    batch, out = ForwardBatch(runner.cache), []
    for p in range(1, len(prompt)):
        batch.clear()
        batch.add(np.array(prompt[:p], np.int32), 0, list(range(8)), 1)
        row = runner.forward(batch)[0].astype(np.float64)
        logz = row.max() + np.log(np.exp(row - row.max()).sum())
        rank = 1 + sum(1 for x in row if x > row[prompt[p]])
        out.append((float(row[prompt[p]] - logz), np.argsort(-row, kind="stable")[:top].tolist(), rank))
    return out


def test_prompt_logprobs_match_the_reference_whatever_the_chunking_and_the_cache(tiny, monkeypatch):
    from conftest import engine_args

    from engine.core import prompt_echo
    from engine.llm_engine import LLMEngine

    prompt = [(7 * i + 3) % 900 + 10 for i in range(40)]  # 40 tokens: two full blocks of 16 can be cached
    params = SamplingParams(max_tokens=1, temperature=0.0, echo=True, logprobs=2)
    want = reference_logprobs(tiny, prompt, 2)
    whole = LLMEngine.from_args(engine_args(model=str(tiny), max_model_len=128))
    chunked = LLMEngine.from_args(engine_args(model=str(tiny), max_model_len=128, max_num_batched_tokens=16))
    runs = ((whole, "a", 64), (chunked, "b", 64), (whole, "c", 64), (whole, "e", 7))  # "c", "e": prefix cached
    for engine, request_id, rows_per_pass in runs:  # "e": a forward's rows scored 7 at a time
        monkeypatch.setattr(prompt_echo, "ROWS_PER_PASS", rows_per_pass)
        out = first_output(engine, prompt, params, request_id)
        assert out.prompt_text == engine.tokenizer.decode(prompt)
        first, *rest = out.prompt_logprobs
        assert (first.token_id, first.logprob) == (prompt[0], None)
        assert [e.token_id for e in rest] == prompt[1:]
        for entry, (logprob, top, _) in zip(rest, want):
            assert entry.logprob == pytest.approx(logprob, abs=1e-9)
            assert [t for t, _, _ in entry.top] == top
    assert whole.scheduler.blocks.num_cache_hits == 0  # the scored prompt took nothing from the cache
    plain = first_output(whole, prompt, SamplingParams(max_tokens=1, temperature=0.0), "d")
    assert plain.prompt_text is None and whole.scheduler.blocks.num_cache_hits > 0


def test_vllm_prompt_logprobs_score_the_prompt_without_echo(tiny):
    """vLLM's prompt_logprobs: the entries carry the reference's logprobs, the prompt token's rank among the row's
    logits and the top alternatives; no echoed text; with echo and logprobs too, the larger count of alternatives."""
    from conftest import engine_args

    from engine.llm_engine import LLMEngine

    prompt = [(5 * i + 11) % 700 + 20 for i in range(24)]
    want = reference_logprobs(tiny, prompt, 4)
    engine = LLMEngine.from_args(engine_args(model=str(tiny), max_model_len=128))
    for request_id, params, top in (("p", SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3), 3),
                                    ("q", SamplingParams(max_tokens=1, temperature=0.0, echo=True, logprobs=1,
                                                         prompt_logprobs=4), 4)):
        out = first_output(engine, prompt, params, request_id)
        assert out.prompt_text == (engine.tokenizer.decode(prompt) if params.echo else None)
        first, *rest = out.prompt_logprobs
        assert (first.token_id, first.logprob, first.rank) == (prompt[0], None, 0)
        assert [e.token_id for e in rest] == prompt[1:]
        for entry, (logprob, ids, rank) in zip(rest, want):
            assert entry.logprob == pytest.approx(logprob, abs=1e-9) and entry.rank == rank
            assert [t for t, _, _ in entry.top] == ids[:top]
    assert engine.scheduler.blocks.num_cache_hits == 0  # a scored prompt computes every position

