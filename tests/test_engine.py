"""The engine on the real model: batching never changes a request's output; stops are exact."""

from __future__ import annotations

import numpy as np
import pytest

from engine.generate import generate
from engine.serving.protocol import ChatMessage, SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "List three colours: red,",
    [ChatMessage("user", "Say hello in Spanish.")],
]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def one_by_one(engine, prompts, params):
    return [generate(engine, [p], params)[0] for p in prompts]


def test_concurrent_requests_match_requests_run_alone(engine):
    alone = one_by_one(engine, PROMPTS, GREEDY)
    together = generate(engine, PROMPTS, GREEDY)
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]
    assert all(len(c.token_ids) == 24 and c.finish_reason == "length" for c in together)


def test_small_token_budget_chunks_prefill_without_changing_output(engine, small_budget_engine):
    long_prompt = "Speculative decoding drafts tokens cheaply and verifies them. " * 12
    ref = generate(engine, [long_prompt], GREEDY)[0]
    got = generate(small_budget_engine, [long_prompt, PROMPTS[0], PROMPTS[1]], GREEDY)[0]
    assert got.token_ids == ref.token_ids


def test_prefix_cache_reuses_blocks_and_output_is_unchanged(engine):
    prompt = "Prefix caching shares the KV blocks of a common prompt prefix. " * 4
    first = generate(engine, [prompt], GREEDY)[0]
    hits = engine.scheduler.blocks.num_cache_hits
    second = generate(engine, [prompt], GREEDY)[0]
    assert engine.scheduler.blocks.num_cache_hits > hits
    assert second.token_ids == first.token_ids


def test_preemption_by_recompute_keeps_outputs(engine, tiny_cache_engine):
    ref = one_by_one(engine, PROMPTS[:3], GREEDY)
    got = generate(tiny_cache_engine, PROMPTS[:3] * 2, GREEDY)
    assert tiny_cache_engine.scheduler.num_preemptions > 0
    assert [c.token_ids for c in got] == [c.token_ids for c in ref] * 2


def test_seed_reproduces_sampled_output(engine):
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=42, ignore_eos=True)
    a = generate(engine, [PROMPTS[0]], params)[0]
    b = generate(engine, [PROMPTS[0], PROMPTS[1]], params)[0]
    other = generate(engine, [PROMPTS[0]], SamplingParams(max_tokens=16, temperature=1.0, seed=43, ignore_eos=True))[0]
    assert a.token_ids == b.token_ids
    assert a.token_ids != other.token_ids


def test_stop_string_cuts_text_exactly(engine, tokenizer):
    ref = generate(engine, [PROMPTS[1]], GREEDY)[0]
    # choose a stop string from the middle of the reference text, spanning a token boundary if possible
    text = ref.text
    stop = text[len(text) // 3 : len(text) // 3 + 3]
    got = generate(engine, [PROMPTS[1]], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop]))[0]
    assert got.finish_reason == "stop"
    assert got.text == text[: text.index(stop)]
    assert stop not in got.text


def test_include_stop_str_in_output_keeps_the_stop_at_the_end(engine, tokenizer):
    """vLLM's include_stop_str_in_output: the text ends with the stop string (or the stop token's text)."""
    ref = generate(engine, [PROMPTS[1]], GREEDY)[0]
    stop = ref.text[len(ref.text) // 3 : len(ref.text) // 3 + 3]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)
    got = generate(engine, [PROMPTS[1]], params)[0]
    assert got.finish_reason == "stop" and got.text == ref.text[: ref.text.index(stop) + len(stop)]
    stop_id = ref.token_ids[5]
    by_id = generate(engine, [PROMPTS[1]], SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[stop_id],
                                                           include_stop_str_in_output=True))[0]
    assert by_id.token_ids == ref.token_ids[: ref.token_ids.index(stop_id) + 1]
    assert by_id.text == tokenizer.decode(by_id.token_ids)


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(engine, tokenizer):
    """vLLM's truncate_prompt_tokens: the request runs on the prompt's last k tokens, as that shorter prompt would."""
    ids = tokenizer.encode("One two three four five six seven eight nine ten eleven twelve thirteen")
    got = generate(engine, [ids], SamplingParams(max_tokens=8, temperature=0.0, truncate_prompt_tokens=5))[0]
    assert got.token_ids == generate(engine, [ids[-5:]], SamplingParams(max_tokens=8, temperature=0.0))[0].token_ids
    assert got.prompt_tokens == 5


def test_stop_token_ids_and_max_tokens(engine):
    ref = generate(engine, [PROMPTS[0]], GREEDY)[0]
    stop_id = ref.token_ids[5]
    got = generate(engine, [PROMPTS[0]], SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[stop_id]))[0]
    first = ref.token_ids.index(stop_id)
    assert got.token_ids == ref.token_ids[: first + 1]
    assert got.finish_reason == "stop"
    short = generate(engine, [PROMPTS[0]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))[0]
    assert short.token_ids == ref.token_ids[:3] and short.finish_reason == "length"


def test_logprobs_are_a_normalised_target_distribution(engine):
    got = generate(engine, [PROMPTS[0]], SamplingParams(max_tokens=6, temperature=0.0, logprobs=5, ignore_eos=True))[0]
    assert len(got.logprobs) == 6
    for tok, lp in zip(got.token_ids, got.logprobs):
        assert lp.token_id == tok
        top = [x[2] for x in lp.top]
        assert len(top) == 5 and top == sorted(top, reverse=True)
        assert lp.logprob == pytest.approx(top[0], abs=1e-6)  # greedy picks the most likely token
        assert np.exp(top).sum() <= 1.0 + 1e-6


def test_chat_prompt_is_rendered_with_the_template(engine, tokenizer):
    msgs = [ChatMessage("user", "Say hello in Spanish.")]
    via_chat = generate(engine, [msgs], GREEDY)[0]
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Say hello in Spanish."}], True)
    via_ids = generate(engine, [tokenizer.encode(text)], GREEDY)[0]
    assert via_chat.token_ids == via_ids.token_ids
