"""Greedy speculative output is token-for-token identical to non-speculative output (real model)."""

from __future__ import annotations

import dataclasses
import json
import logging

import numpy as np
import pytest

from engine.generate import generate
from engine.serving.protocol import ChatMessage, SamplingParams
from proposers.base import Drafts, Proposer

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


PENALIZED = SamplingParams(max_tokens=48, temperature=0.0, frequency_penalty=0.6, presence_penalty=0.4,
                           repetition_penalty=1.1, logit_bias={28: -5.0, 30: 2.0})
MASKED = SamplingParams(max_tokens=48, temperature=0.0, bad_words=["Bob", "return a", "name"], min_tokens=40)


@pytest.mark.parametrize("processed", [PENALIZED, MASKED], ids=["penalties", "bad_words+min_tokens"])
def test_penalties_and_logit_bias_identical_to_non_speculative(spec_engine, engine, reference, processed):
    """The penalties and bad_words count the drafts a verify row follows, min_tokens its position
    (engine/core/logits_processing.py): speculative output still equals plain decoding with the same parameters,
    token for token."""
    want = [generate(engine, [p], processed)[0] for p in PROMPTS]
    got = [generate(spec_engine, [p], processed)[0] for p in PROMPTS]
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert [w.token_ids for w in want] != [r.token_ids for r in reference]  # the penalties changed the outputs
    if spec_engine.spec_method != "naive":
        assert sum(g.num_accepted_tokens for g in got) > 0, "no draft passed: the test proves nothing"


def test_seeded_sampling_identical_to_non_speculative(spec_engine, engine, reference):
    """A sampled row's uniforms are keyed by (seed, output position) and one-hot drafts are verified by sampling
    the target (target_match): a seeded request emits, token for token, what plain decoding samples with that
    seed, alone or batched, and its output is a sample (not the greedy one)."""
    sampled = [SamplingParams(max_tokens=48, temperature=0.8, top_p=0.95, seed=100 + i) for i in range(len(PROMPTS))]
    want = [generate(engine, [p], s)[0] for p, s in zip(PROMPTS, sampled)]
    alone = [generate(spec_engine, [p], s)[0] for p, s in zip(PROMPTS, sampled)]
    assert [g.token_ids for g in alone] == [w.token_ids for w in want]
    together = generate(spec_engine, PROMPTS, sampled)  # one batch, each request its own seed
    assert [g.token_ids for g in together] == [w.token_ids for w in want]
    assert [w.token_ids for w in want] != [r.token_ids for r in reference]
    if spec_engine.spec_method != "naive":
        assert sum(g.num_accepted_tokens for g in alone) > 0, "no draft passed: the test proves nothing"


def test_per_request_cap_disables_drafting(spec_engine, reference):
    params = SamplingParams(max_tokens=48, temperature=0.0, num_speculative_tokens=0)
    got = generate(spec_engine, [PROMPTS[0]], params)[0]
    assert got.num_draft_tokens == 0
    assert got.token_ids == reference[0].token_ids


class ContractBreaker(Proposer):
    """A third-party proposer (this test module's) that breaks the contract in turn: every fifth step it raises,
    every fifth returns too few entries, and otherwise each request's drafts are bad every other time (a valid
    token, the request's last one, in between)."""

    BAD = (lambda v: np.array([v + 5], np.int32), lambda v: np.array([-1], np.int64),
           lambda v: np.array([1.0], np.float32), lambda v: np.zeros((1, 1), np.int32))

    def __init__(self, config, vocab_size):
        super().__init__(config, vocab_size)
        self.calls = self.steps = 0

    def propose(self, requests):
        self.steps += 1
        if self.steps % 5 == 3:
            raise RuntimeError("a bug in the plugin")
        if self.steps % 5 == 4:
            return Drafts(token_ids=[])
        drafts = Drafts.empty(len(requests))
        drafts.probs = [None] * len(requests)
        for i, ask in enumerate(requests):
            self.calls += 1
            if self.calls % 2:
                drafts.token_ids[i] = self.BAD[self.calls // 2 % len(self.BAD)](self.vocab_size)
            elif self.calls % 6 == 2:  # a valid id with q rows of the wrong width
                drafts.token_ids[i] = ask.token_ids[-1:]
                drafts.probs[i] = np.full((1, 7), 0.5, np.float32)
            else:
                drafts.token_ids[i] = ask.token_ids[-1:]
        return drafts


def test_a_plugins_bad_drafts_are_dropped_and_every_output_stays_identical(make_engine, reference, monkeypatch,
                                                                            caplog):
    """Drafts outside the vocabulary, of the wrong type or shape, or with q rows of the wrong width cost only the
    step's drafts of that request, and a propose() that raises or returns too few entries only that step's
    drafts: no step fails, every output equals plain decoding, the valid drafts are verified, and each problem
    is logged once, naming the proposer."""
    eng = make_engine(speculative_config=json.dumps(METHODS[1]))
    bad = ContractBreaker(dataclasses.replace(eng.spec, options={}), eng.runner.config.vocab_size)
    monkeypatch.setattr(eng.proposers, "default", bad)
    monkeypatch.setitem(eng.proposers.by_method, eng.spec.method, bad)
    with caplog.at_level(logging.WARNING, logger="speculant.engine"):
        got = generate(eng, PROMPTS + PROMPTS[:2], GREEDY)
    assert [g.token_ids for g in got] == [r.token_ids for r in reference + reference[:2]]
    assert sum(g.num_draft_tokens for g in got) > 0, "no valid draft reached verification"
    warnings = [r.getMessage() for r in caplog.records if "ContractBreaker" in r.getMessage()]
    for problem in ("outside the vocabulary", "1-D integer array", "float32 [num_drafts", "raised RuntimeError",
                    "one entry per request"):
        assert sum(problem in w for w in warnings) == 1, (problem, warnings)
