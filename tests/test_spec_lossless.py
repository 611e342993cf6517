"""Greedy speculative output is token-for-token identical to non-speculative output (real model)."""

from __future__ import annotations

import json

import pytest

from engine.generate import generate
from engine.serving.protocol import ChatMessage, SamplingParams

SOURCE = """def add(a, b):
    return a + b

def sub(a, b):
    return a - b

def mul(a, b):
    return a * b
"""

PROMPTS = [
    [ChatMessage("user", "Copy this code exactly, then stop:\n" + SOURCE)],
    "Alice met Bob. Alice said hello to Bob. Bob said hello to Alice. Alice met Bob. Alice said",
    '{"name": "a", "id": 1}\n{"name": "b", "id": 2}\n{"name": "c", "id": 3}\n{"name": "d", "id":',
    "Once upon a time",
    [ChatMessage("user", "What is the boiling point of water?")],
]
GREEDY = SamplingParams(max_tokens=48, temperature=0.0)

METHODS = [
    {"method": "naive", "num_speculative_tokens": 4},
    {"method": "ngram", "num_speculative_tokens": 5, "max_ngram_size": 4, "min_ngram_size": 1},
    {"method": "suffix", "num_speculative_tokens": 6},
]


@pytest.fixture(scope="module")
def reference(engine):
    return [generate(engine, [p], GREEDY)[0] for p in PROMPTS]


@pytest.fixture(scope="module", params=METHODS, ids=lambda m: m["method"])
def spec_engine(request, make_engine):
    return make_engine(speculative_config=json.dumps(request.param))


def test_alone_identical_to_non_speculative(spec_engine, reference):
    got = [generate(spec_engine, [p], GREEDY)[0] for p in PROMPTS]
    for g, r in zip(got, reference):
        assert g.token_ids == r.token_ids
        assert g.text == r.text and g.finish_reason == r.finish_reason
    if spec_engine.spec_method != "naive":
        assert sum(g.num_draft_tokens for g in got) > 0, "the proposer never drafted: the test proves nothing"
        assert sum(g.num_accepted_tokens for g in got) > 0


def test_concurrent_identical_to_non_speculative(spec_engine, reference):
    got = generate(spec_engine, PROMPTS + PROMPTS[:2], GREEDY)
    assert [g.token_ids for g in got] == [r.token_ids for r in reference + reference[:2]]


def test_multi_token_steps_respect_stops(spec_engine, reference):
    ref = reference[0]
    stop = ref.text[len(ref.text) // 2 : len(ref.text) // 2 + 4]
    params = SamplingParams(max_tokens=48, temperature=0.0, stop=[stop], logprobs=2)
    got = generate(spec_engine, [PROMPTS[0]], params)[0]
    assert got.text == ref.text[: ref.text.index(stop)]
    assert len(got.logprobs) == len(got.token_ids)
    assert got.token_ids == ref.token_ids[: len(got.token_ids)]
    capped = generate(spec_engine, [PROMPTS[0]], SamplingParams(max_tokens=7, temperature=0.0))[0]
    assert capped.token_ids == ref.token_ids[:7] and capped.finish_reason == "length"


def test_per_request_cap_disables_drafting(spec_engine, reference):
    params = SamplingParams(max_tokens=48, temperature=0.0, num_speculative_tokens=0)
    got = generate(spec_engine, [PROMPTS[0]], params)[0]
    assert got.num_draft_tokens == 0
    assert got.token_ids == reference[0].token_ids
