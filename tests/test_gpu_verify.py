"""The fused CUDA verification kernel against the CPU verification (engine.spec_decode.verify.verify).

Same inputs, same uniforms: the kernel must emit the same tokens and accept lengths for every
strategy and policy (sampling is by inverse CDF over ids with the given uniform, so it is a
pure function; only a uniform within rounding distance of a CDF step could tell the two apart).
Logits are quantised to 0.25 steps so ties at the argmax, the top-k cut and the nucleus cut are
common. The rejection sampler is also checked statistically: the first emitted token of a
request is distributed as the target p, whatever the draft distribution q.
Runs on a CUDA device (marker `gpu`) and on the CPU emulator of the same kernel source.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.gpu.testing import BACKEND_PARAMS, Backend
from engine.spec_decode.verify import ACCEPT_ALL, GREEDY, NORMAL, REJECT_ALL, REJECTION, TARGET_MATCH, TOPP, verify


@pytest.fixture(scope="module", params=BACKEND_PARAMS)
def backend(request) -> Backend:
    return Backend(request.param)


def make_batch(rng, vocab, num_drafts, strategy, temperature, top_k, top_p, has_q):
    num_reqs = len(num_drafts)
    cu_rows = np.concatenate([[0], np.cumsum(np.add(num_drafts, 1))]).astype(np.int32)
    num_rows = int(cu_rows[-1])
    logits = (np.round(rng.standard_normal((num_rows, vocab)) * 8) / 4).astype(np.float32)  # many ties
    for row in range(num_rows):
        if rng.random() < 0.4:  # a tie at the top (often next door): argmax must pick the lowest id
            top = int(np.argmax(logits[row]))
            logits[row, (top + 1) % vocab if rng.random() < 0.5 else rng.integers(vocab)] = logits[row, top]
    draft_ids = np.zeros(num_rows - num_reqs, np.int32)
    for r in range(num_reqs):
        for i in range(num_drafts[r]):
            row = cu_rows[r] + i
            rank = int(rng.choice([0] * 8 + [1, 2, 3, 4, 50]))  # mostly likely tokens: long accept chains
            order = np.lexsort((np.arange(vocab), -logits[row]))  # by logit desc, then id
            draft_ids[row - r] = int(order[rank]) if rng.random() < 0.85 else int(rng.integers(vocab))
    probs = rng.dirichlet(np.full(vocab, 0.3), size=num_rows - num_reqs).astype(np.float32)
    return dict(
        logits=logits, cu_rows=cu_rows, draft_ids=draft_ids,
        draft_probs=probs if any(has_q) else np.zeros((0, vocab), np.float32),
        has_draft_probs=np.array(has_q, np.bool_), temperature=np.array(temperature, np.float32),
        top_p=np.array(top_p, np.float32), top_k=np.array(top_k, np.int32), strategy=np.array(strategy, np.int32),
        uniforms=rng.random((num_rows, 2)),
    )


def run_cpu(b, policy, max_candidate_len=5, verify_top_p=1.0):
    num_rows, num_reqs = b["logits"].shape[0], len(b["strategy"])
    out, acc = np.full(num_rows, -1, np.int32), np.full(num_reqs, -1, np.int32)
    verify(b["logits"], b["cu_rows"], b["draft_ids"], b["draft_probs"], b["has_draft_probs"], b["temperature"],
           b["top_p"], b["top_k"], b["strategy"], policy, b["uniforms"], out, acc, max_candidate_len, verify_top_p)
    return out, acc


def run_device(be: Backend, b, policy, max_candidate_len=5, verify_top_p=1.0):
    num_rows, num_reqs = b["logits"].shape[0], len(b["strategy"])
    out, acc = be.dev(np.full(num_rows, -1, np.int32)), be.dev(np.full(num_reqs, -1, np.int32))
    dev = {k: be.dev(v.view(np.uint8) if v.dtype == np.bool_ else v) for k, v in b.items()}
    be.kernels().verify(dev["logits"], dev["cu_rows"], dev["draft_ids"], dev["draft_probs"], dev["has_draft_probs"],
                        dev["temperature"], dev["top_p"], dev["top_k"], dev["strategy"], policy, dev["uniforms"],
                        max_candidate_len, verify_top_p, out, acc, num_reqs)
    return be.host(out), be.host(acc)


def assert_same(b, cpu, dev):
    (c_out, c_acc), (d_out, d_acc) = cpu, dev
    assert np.array_equal(d_acc, c_acc), f"accepted: device {d_acc} cpu {c_acc}"
    for r, a in enumerate(c_acc):
        lo = b["cu_rows"][r]
        assert np.array_equal(d_out[lo : lo + a + 1], c_out[lo : lo + a + 1]), f"request {r}"


NUM_DRAFTS = [0, 3, 1, 5, 2, 4]
SETTINGS = {
    # name: (strategy, temperature, top_k, top_p) per request
    "greedy": ([GREEDY] * 6, [0, 0, 0.8, 1, 0, 1.3], [0] * 6, [1] * 6),
    "target_match": ([TARGET_MATCH] * 6, [0.7, 1, 1, 0.5, 0, 1], [0, 5, 0, 3, 0, 40], [1, 1, 0.8, 0.9, 1, 0.6]),
    "topp": ([TOPP] * 6, [1, 0.7, 1, 1, 0.9, 1], [0, 0, 7, 0, 0, 2], [1, 0.7, 1, 0.95, 1, 1]),
    "rejection": ([REJECTION] * 6, [1, 0.6, 1, 1.5, 1, 0.8], [0, 0, 4, 0, 9, 0], [1, 0.9, 1, 1, 0.75, 1]),
    "mixed": ([GREEDY, TARGET_MATCH, TOPP, REJECTION, REJECTION, TARGET_MATCH], [0, 1, 1, 1, 0, 0.9],
              [0, 3, 0, 0, 0, 6], [1, 1, 0.8, 0.85, 1, 1]),
}


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_matches_cpu_verify(backend, setting, seed):
    rng = np.random.default_rng(100 * list(SETTINGS).index(setting) + seed)
    has_q = [False, True, False, True, True, False]
    b = make_batch(rng, 301, NUM_DRAFTS, *SETTINGS[setting], has_q=has_q)
    assert_same(b, run_cpu(b, NORMAL, 3, 0.9), run_device(backend, b, NORMAL, 3, 0.9))


@pytest.mark.parametrize("policy", [ACCEPT_ALL, REJECT_ALL])
def test_debug_policies_match_cpu_verify(backend, policy):
    rng = np.random.default_rng(11 + policy)
    b = make_batch(rng, 301, NUM_DRAFTS, *SETTINGS["mixed"], has_q=[False] * 6)
    cpu = run_cpu(b, policy)
    assert_same(b, cpu, run_device(backend, b, policy))
    expected = np.array(NUM_DRAFTS) if policy == ACCEPT_ALL else np.zeros(6, np.int32)
    assert np.array_equal(cpu[1], expected)


@pytest.mark.parametrize("with_q", [False, True], ids=["one_hot_q", "draft_q"])
def test_rejection_first_token_is_distributed_as_target(backend, with_q):
    """Draft x ~ q, then verify: the first emitted token (accepted x or recovered) must be ~ p."""
    rng = np.random.default_rng(12 + with_q)
    vocab, num_reqs = 20, 1500 if backend.name == "emu" else 100_000
    row = (rng.standard_normal(vocab) * 1.5).astype(np.float32)
    p = np.exp(row - row.max())
    p /= p.sum()
    q = rng.dirichlet(np.ones(vocab)).astype(np.float32)
    draft_ids = np.searchsorted(np.cumsum(q / q.sum()), rng.random(num_reqs)).clip(0, vocab - 1).astype(np.int32)
    if not with_q:  # model-free drafts: x comes from anywhere (here q) but is verified as one-hot
        q = None
    b = dict(
        logits=np.tile(row, (2 * num_reqs, 1)), cu_rows=np.arange(0, 2 * num_reqs + 1, 2, dtype=np.int32),
        draft_ids=draft_ids,
        draft_probs=np.tile(q, (num_reqs, 1)) if with_q else np.zeros((0, vocab), np.float32),
        has_draft_probs=np.full(num_reqs, with_q), temperature=np.ones(num_reqs, np.float32),
        top_p=np.ones(num_reqs, np.float32), top_k=np.zeros(num_reqs, np.int32),
        strategy=np.full(num_reqs, REJECTION, np.int32), uniforms=rng.random((2 * num_reqs, 2)),
    )
    out, acc = run_device(backend, b, NORMAL)
    first = out[0::2]
    freq = np.bincount(first, minlength=vocab) / num_reqs
    tv = 0.5 * np.abs(freq - p).sum()
    expected_tv = 0.5 * np.sqrt(p * (1 - p) / num_reqs).sum()  # ~ mean TV of a sample this size
    assert tv < 3 * expected_tv, f"TV(first token, p) = {tv:.4f} vs ~{expected_tv:.4f} by chance"
    assert 0 < acc.mean() < 1  # both branches ran
