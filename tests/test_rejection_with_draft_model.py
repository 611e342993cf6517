"""Sampling stays lossless with real draft probabilities: a draft model (the first layer of a tiny
random two-layer target, whose distribution differs clearly from the target's) proposes at
temperature 1 through the whole engine (draft_model proposer, q rows into `rejection`
verification), and the verified tokens follow the target's own distribution.

The reference is independent of the speculative path: the target's softmax from a plain forward.
Chi-square at alpha ~ 5e-4 (Wilson-Hilferty critical value); the draft's distribution is checked to
differ clearly from the target's, so a verifier that let drafts through unchecked would fail.
"""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from conftest import engine_args
from engine.model.cpu_runner import CacheConfig, CpuRunner, ForwardBatch
from engine.generate import generate
from engine.model.gguf_loader import GGUFModel
from engine.llm_engine import LLMEngine
from engine.serving.protocol import SamplingParams
from tiny_models import write_tiny_llama

PROMPT = [1, 504, 3458, 282, 253, 42]
NUM_SAMPLES = 4000
LOGIT_SCALE = 0.6


class NextToken:
    """The model's (or its first layers') next-token distribution, from plain forwards."""

    def __init__(self, path, num_layers=None):
        self.runner = CpuRunner(GGUFModel(path), CacheConfig(16, 4, 64, 1, 64), num_layers=num_layers)
        self.batch = ForwardBatch(self.runner.cache)

    def after(self, tokens) -> np.ndarray:
        self.batch.clear()
        self.batch.add(np.asarray(tokens, np.int32), 0, [0, 1, 2, 3], 1)
        z = self.runner.forward(self.batch)[0].astype(np.float64)
        p = np.exp(z - z.max())
        return p / p.sum()

    def at(self, context, position) -> np.ndarray:
        """Output token `position` (1 or 2) given a context ending with output 0; for position 2
        the mixture over the intermediate token (its most likely tokens up to 99.9% of the mass)."""
        first = self.after(context)
        if position == 1:
            return first
        order = np.argsort(-first)
        keep = order[: int(np.searchsorted(np.cumsum(first[order]), 0.999)) + 1][:300]
        mix = sum(first[t] * self.after(context + [int(t)]) for t in keep)
        return mix / mix.sum()


def chi_square_ok(samples: list[int], p: np.ndarray) -> tuple[bool, float, float]:
    n = len(samples)
    counts = Counter(samples)
    bins = [t for t in np.argsort(-p) if p[t] * n >= 5]
    observed = [counts.get(int(t), 0) for t in bins] + [n - sum(counts.get(int(t), 0) for t in bins)]
    expected = [p[t] * n for t in bins] + [n * (1 - p[bins].sum())]
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected) if e > 0)
    df = len(bins)
    crit = df * (1 - 2 / (9 * df) + 3.29 * np.sqrt(2 / (9 * df))) ** 3
    return stat < crit, stat, crit


@pytest.fixture(scope="module")
def target(tmp_path_factory, model_path):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "target.gguf", model_path, seed=1, layers=2,
                            logit_scale=LOGIT_SCALE)


def test_verified_tokens_follow_the_target_distribution(target):
    spec = {"method": "draft_model", "draft_layers": 1, "num_speculative_tokens": 2, "adaptive": False}
    engine = LLMEngine.from_args(engine_args(model=str(target), max_model_len=64, max_num_seqs=256,
                                             max_num_batched_tokens=2048, speculative_config=json.dumps(spec)))
    params = [SamplingParams(max_tokens=3, temperature=1.0, seed=i, ignore_eos=True) for i in range(NUM_SAMPLES)]
    outs = [o.token_ids for o in generate(engine, [PROMPT] * NUM_SAMPLES, params)]
    assert 0 < engine.spec_totals.counts["num_accepted_tokens"] < engine.spec_totals.counts["num_draft_tokens"], \
        "drafts must be both accepted and rejected for the test to mean anything"
    m1 = Counter(o[0] for o in outs).most_common(1)[0][0]
    given = [o for o in outs if o[0] == m1]  # x2, x3 both come out of the verify step after m1
    assert len(given) >= 400
    exact, draft = NextToken(target), NextToken(target, num_layers=1)
    for position in (1, 2):
        p, q = exact.at(PROMPT + [m1], position), draft.at(PROMPT + [m1], position)
        assert 0.5 * np.abs(p - q).sum() > 0.3, "draft and target must differ clearly"
        samples = [o[position] for o in given]
        ok, stat, crit = chi_square_ok(samples, p)
        assert ok, f"token {position + 1}: chi-square {stat:.1f} >= {crit:.1f} against the target distribution"
        assert not chi_square_ok(samples, q)[0], "the samples must not also fit the draft's distribution"


def lowercase_tokens(path) -> np.ndarray:
    """[vocab] bool: tokens whose text is only a-z (the regex's alphabet; computed from the vocabulary
    itself, not from the grammar library)."""
    from engine.model.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(path)
    return np.array([not tok.is_special(i) and tok.id_to_bytes(i).isalpha() and tok.id_to_bytes(i).islower()
                     and tok.id_to_bytes(i).isascii() for i in range(tok.vocab_size)])


def test_sampling_under_a_grammar_follows_the_masked_target(target):
    """Under the regex [a-z]{40,60} (no end within 3 tokens), sampled tokens follow the target's distribution
    restricted to a-z tokens and renormalised, while the draft model proposes from its unmasked q (its
    forbidden drafts are rejected against the masked target, leaving the residual max(0, p - q))."""
    import llguidance

    spec = {"method": "draft_model", "draft_layers": 1, "num_speculative_tokens": 2, "adaptive": False}
    engine = LLMEngine.from_args(engine_args(model=str(target), max_model_len=64, max_num_seqs=256,
                                             max_num_batched_tokens=2048, speculative_config=json.dumps(spec)))
    grammar = llguidance.LLMatcher.grammar_from_regex("[a-z]{40,60}")
    params = [SamplingParams(max_tokens=3, temperature=1.0, seed=i, grammar=grammar) for i in range(NUM_SAMPLES)]
    outs = [o.token_ids for o in generate(engine, [PROMPT] * NUM_SAMPLES, params)]
    assert 0 < engine.spec_totals.counts["num_accepted_tokens"] < engine.spec_totals.counts["num_draft_tokens"]
    allowed = lowercase_tokens(target)
    assert all(len(o) == 3 and allowed[o].all() for o in outs)
    exact = NextToken(target)
    masked = lambda p: np.where(allowed, p, 0) / p[allowed].sum()  # noqa: E731
    m1 = Counter(o[0] for o in outs).most_common(1)[0][0]
    given = [o for o in outs if o[0] == m1]
    assert len(given) >= 300
    first = masked(exact.after(PROMPT + [m1]))
    order = np.argsort(-first)
    keep = order[: int(np.searchsorted(np.cumsum(first[order]), 0.999)) + 1][:300]
    second = sum(first[t] * masked(exact.after(PROMPT + [m1, int(t)])) for t in keep)
    for position, p in ((1, first), (2, second / second.sum())):
        ok, stat, crit = chi_square_ok([o[position] for o in given], p)
        assert ok, f"token {position + 1}: chi-square {stat:.1f} >= {crit:.1f} against the masked target"
    ok, _, _ = chi_square_ok([o[1] for o in given], exact.after(PROMPT + [m1]))
    assert not ok, "the samples must not also fit the unmasked target"
