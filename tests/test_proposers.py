"""Built-in proposers on tiny hand-made arrays (vLLM test_ngram style), plus brute-force references."""

import collections
import random

import numpy as np
import pytest

from engine.spec_decode.spec_config import SpeculativeConfig
from proposers.base import DraftRequest
from proposers.naive import NaiveProposer
from proposers.ngram import NgramProposer
from proposers.suffix import SuffixProposer
from proposers.suffix_tree import SuffixTree


def make(cls, method, k=5, **options):
    return cls(SpeculativeConfig(method=method, num_speculative_tokens=k, options=options), vocab_size=100)


def request(token_ids, k, request_id="r", num_prompt_tokens=None):
    token_ids = np.asarray(token_ids, dtype=np.int32)
    num_prompt = len(token_ids) if num_prompt_tokens is None else num_prompt_tokens
    return DraftRequest(request_id, token_ids, num_prompt, k, temperature=0.0)


def drafts_of(proposer, requests):
    out = proposer.propose(requests)
    assert len(out.token_ids) == len(requests)
    for d, r in zip(out.token_ids, requests, strict=True):
        assert d.dtype == np.int32 and len(d) <= r.max_draft_tokens
    return [d.tolist() for d in out.token_ids]


# --- naive ---------------------------------------------------------------------------------------

def test_naive_never_drafts():
    proposer = make(NaiveProposer, "naive")
    assert drafts_of(proposer, [request([1, 2, 1, 2], 5), request([3], 2)]) == [[], []]


# --- ngram ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("context,min_n,max_n,k,expected", [
    ([1, 2, 3, 4, 1, 2, 3], 2, 5, 3, [4, 1, 2]),  # vLLM's example
    ([1, 2, 3, 4, 1, 2, 3], 2, 5, 2, [4, 1]),  # truncated to max_draft_tokens
    ([1, 2, 3, 4, 1, 2, 3], 2, 5, 0, []),  # max_draft_tokens 0
    ([1, 2, 3, 4, 5], 1, 5, 3, []),  # no match at all
    ([7, 8, 9], 1, 3, 3, []),  # the only occurrence of the key is the key itself
    ([1, 2, 3, 4, 1], 2, 5, 3, []),  # only a 1-gram matches, below min_ngram_size
    ([1, 2, 3, 4, 1], 1, 5, 3, [2, 3, 4]),  # ... which is enough with min 1
    ([1, 2, 3, 9, 2, 3, 5, 1, 2, 3], 2, 5, 2, [9, 2]),  # the 3-gram beats a later 2-gram
    ([1, 2, 7, 1, 2, 8, 1, 2], 2, 5, 3, [8, 1, 2]),  # equal lengths: the most recent wins
    ([1, 2, 3, 1, 2, 3, 1, 2], 2, 5, 5, [3, 1, 2, 3, 1]),  # copy runs on through the drafts
    ([4, 4, 4], 2, 5, 4, [4, 4, 4, 4]),  # a loop of period 1
    ([5, 1, 2, 3, 4, 1, 2, 3], 2, 2, 3, [4, 1, 2]),  # max 2: key [2, 3]
])
def test_ngram_hand_made(context, min_n, max_n, k, expected):
    proposer = make(NgramProposer, "ngram", min_ngram_size=min_n, max_ngram_size=max_n)
    assert drafts_of(proposer, [request(context, k)]) == [expected]


def ref_ngram(context, min_n, max_n, k):
    """Brute force: longest n first, latest earlier occurrence, periodic copy past the end."""
    num_tokens = len(context)
    for n in range(max_n, min_n - 1, -1):
        key = context[num_tokens - n:]
        for i in range(num_tokens - n - 1, -1, -1):
            if n <= num_tokens - 1 and context[i:i + n] == key:
                ext = list(context)
                for j in range(k):
                    ext.append(ext[i + n + j])
                return ext[num_tokens:]
    return []


@pytest.mark.parametrize("num_tokens", [30, 3000])  # 3000 x 4 requests takes the parallel kernel
def test_ngram_batch_matches_brute_force(num_tokens):
    rng = np.random.default_rng(num_tokens)
    contexts = [rng.integers(0, 6, size=num_tokens - 3 * i).tolist() for i in range(4)]
    ks = [0, 1, 4, 7]
    proposer = make(NgramProposer, "ngram", min_ngram_size=2, max_ngram_size=4)
    requests = [request(c, k, f"r{i}") for i, (c, k) in enumerate(zip(contexts, ks, strict=True))]
    got = drafts_of(proposer, requests)
    assert got == [ref_ngram(c, 2, 4, k) for c, k in zip(contexts, ks, strict=True)]


def test_ngram_options_follow_vllm_aliases_and_defaults():
    assert NgramProposer.options_dict({}) == {"max_ngram_size": 5, "min_ngram_size": 2}
    assert NgramProposer.options_dict({"prompt_lookup_max": 3, "prompt_lookup_min": 3}) == {
        "max_ngram_size": 3, "min_ngram_size": 3}
    assert NgramProposer.options_dict({"prompt_lookup_max": 1}) == {"max_ngram_size": 1, "min_ngram_size": 1}
    with pytest.raises(ValueError, match="min_ngram_size"):
        NgramProposer.options_dict({"min_ngram_size": 4, "max_ngram_size": 3})


# --- suffix tree ---------------------------------------------------------------------------------

def brute_counts(seqs, depth):
    counts = collections.Counter()
    for s in seqs:
        for i in range(len(s)):
            for j in range(i + 1, min(len(s), i + depth) + 1):
                counts[tuple(s[i:j])] += 1
    return dict(counts)


def test_suffix_tree_counts_match_brute_force_through_growth_and_eviction():
    rng = random.Random(0)
    for _ in range(300):
        depth, alphabet = rng.randint(2, 7), rng.randint(1, 4)
        tree, seqs = SuffixTree(depth), {}
        for seq_id in range(rng.randint(1, 5)):
            tokens = [rng.randrange(alphabet) for _ in range(rng.randint(0, 14))]
            for start in range(0, len(tokens), 3):  # grow in chunks, as responses do
                tree.extend(seq_id, tokens[start:start + 3])
            tree.extend(seq_id, [])
            tree.close(seq_id)
            seqs[seq_id] = tokens
            if rng.random() < 0.4:
                victim = rng.choice(sorted(seqs))
                tree.remove(victim)
                del seqs[victim]
            assert tree.counts() == brute_counts(seqs.values(), depth)


def ref_speculate(seqs, depth, context, k, factor, min_prob, exclude):
    """Brute force over substring counts; returns (tokens, score) or None when a tie makes it ambiguous."""
    counts = brute_counts(seqs, depth)
    best = ([], 0.0)
    for m in range(1, min(len(context), depth - 1) + 1):
        path = tuple(context[len(context) - m:])
        if counts.get(path, 0) <= exclude:
            break
        tokens, score, prob, first = [], 0.0, 1.0, True
        while len(tokens) < min(k, int(m * factor)):
            children = {t: c for s, c in counts.items() if len(s) == len(path) + 1 and s[:-1] == path
                        for t in [s[-1]]}
            if not children:
                break
            top = max(children.values())
            if list(children.values()).count(top) > 1:
                return None
            token = max(children, key=children.get)
            prob *= top / (counts[path] - (exclude if first else 0))
            first = False
            if prob < min_prob:
                break
            path += (token,)
            tokens.append(token)
            score += prob
        if tokens and score >= best[1]:
            best = (tokens, score)
    return best


def test_suffix_tree_speculation_matches_brute_force():
    rng = random.Random(1)
    checked = 0
    for _ in range(400):
        depth, k = rng.randint(3, 8), rng.randint(1, 6)
        seqs = [[rng.randrange(3) for _ in range(rng.randint(1, 20))] for _ in range(rng.randint(1, 3))]
        tree = SuffixTree(depth)
        for i, s in enumerate(seqs):
            tree.extend(i, s)
            tree.close(i)
        context = [rng.randrange(3) for _ in range(rng.randint(1, 6))]
        factor, min_prob = rng.choice([0.5, 1.0, 2.0]), rng.choice([0.0, 0.2, 0.5])
        expected = ref_speculate(seqs, depth, context, k, factor, min_prob, exclude=0)
        if expected is None:
            continue
        got = tree.speculate(context, k, factor, 0.0, min_prob)
        assert got.token_ids == expected[0] and got.score == pytest.approx(expected[1]), (seqs, context)
        checked += 1
    assert checked > 200


# --- suffix proposer -----------------------------------------------------------------------------

def suffix(k=8, **options):
    return make(SuffixProposer, "suffix", k=k, **options)


def test_suffix_drafts_from_the_request_prompt_without_counting_its_own_tail():
    proposer = suffix()
    prompt = [1, 2, 3, 9, 8, 7, 1, 2, 3]
    proposer.start_request("a", np.array(prompt, np.int32))
    # "1 2 3" occurred once before, followed by "9 8 7": probability 1, not 1/2; match 3 -> 3 tokens
    assert drafts_of(proposer, [request(prompt, 8, "a")]) == [[9, 8, 7]]


def test_suffix_drafts_a_cached_response_for_a_new_request():
    proposer = suffix(suffix_decoding_max_spec_factor=4.0)
    response = [40, 41, 42, 43, 44, 45, 46]
    proposer.start_request("a", np.array([1, 2, 3], np.int32))
    proposer.extend_request("a", response[:3])
    proposer.extend_request("a", response[3:])
    proposer.stop_request("a")
    assert proposer.num_cached_responses == 1
    prompt = [5, 6, 40, 41]  # ends like the start of the cached response
    proposer.start_request("b", np.array(prompt, np.int32))
    assert drafts_of(proposer, [request(prompt, 4, "b")]) == [[42, 43, 44, 45]]
    assert drafts_of(proposer, [request(prompt, 2, "b")]) == [[42, 43]]  # capped by max_draft_tokens
    assert drafts_of(proposer, [request(prompt, 0, "b")]) == [[]]


def run_request(proposer, request_id, prompt, response):
    proposer.start_request(request_id, np.array(prompt, np.int32))
    proposer.extend_request(request_id, response)
    proposer.stop_request(request_id)


def test_suffix_evicts_the_oldest_cached_response():
    proposer = suffix(suffix_decoding_max_cached_requests=1, suffix_decoding_max_spec_factor=4.0)
    run_request(proposer, "a", [1], [50, 51, 52, 53])
    run_request(proposer, "b", [1], [60, 61, 62, 63])
    assert proposer.num_cached_responses == 1
    assert drafts_of(proposer, [request([7, 50, 51], 3, "c")]) == [[]]  # "a" was evicted
    assert drafts_of(proposer, [request([7, 60, 61], 3, "d")]) == [[62, 63]]
    no_cache = suffix(suffix_decoding_max_cached_requests=0)
    run_request(no_cache, "a", [1], [50, 51, 52, 53])
    assert no_cache.num_cached_responses == 0


def test_suffix_stops_below_min_token_prob():
    # After "5 6" came 7 twice and 8 once; after "5 6 7" always 9.
    cached = [[5, 6, 7, 9], [5, 6, 7, 9], [5, 6, 8, 0]]
    for min_prob, expected in [(0.5, [7, 9]), (0.7, [])]:  # p(7 | 5 6) = 2/3
        proposer = suffix(suffix_decoding_min_token_prob=min_prob)
        for i, response in enumerate(cached):
            run_request(proposer, f"old{i}", [1], response)
        assert drafts_of(proposer, [request([3, 5, 6], 5, "new")]) == [expected]


def test_suffix_spec_factor_limits_draft_length_by_match_length():
    response = list(range(20, 40))
    for factor, expected_len in [(0.5, 2), (1.0, 4), (2.0, 8)]:  # match length 4
        proposer = suffix(k=16, suffix_decoding_max_spec_factor=factor)
        run_request(proposer, "a", [1], response)
        got = drafts_of(proposer, [request([9, 20, 21, 22, 23], 16, "b")])[0]
        assert got == list(range(24, 24 + expected_len))


def test_suffix_catches_up_when_hooks_were_missed():
    proposer = suffix()
    tokens = [1, 2, 3, 4, 1, 2, 3]
    # No start_request: the proposer builds the local tree from token_ids.
    assert drafts_of(proposer, [request(tokens, 3, "x", num_prompt_tokens=5)]) == [[4, 1, 2]]
    tokens += [4, 1]
    assert drafts_of(proposer, [request(tokens, 3, "x", num_prompt_tokens=5)]) == [[2, 3, 4]]
