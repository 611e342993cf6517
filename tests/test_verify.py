"""engine.spec_decode.verify: hand-made cases per strategy and policy, and statistical losslessness checks.

The statistical tests follow vLLM's rejection-sampler test: put many independent one-draft
requests into one verify call and compare the empirical distribution of the first output token
with the target p (computed here by an independent float64 NumPy reference).
"""

import math

import numpy as np
import pytest

from engine.spec_decode.verify import (
    ACCEPT_ALL,
    GREEDY,
    NORMAL,
    REJECT_ALL,
    REJECTION,
    TARGET_MATCH,
    TOPP,
    target_probs,
    verify,
)


def ref_target_probs(logits_row, temperature, top_k=0, top_p=1.0):
    """Reference p in float64: softmax(l / T) on the top_k logits, then the top_p nucleus."""
    logits = np.asarray(logits_row, dtype=np.float64)
    vocab = logits.shape[0]
    ids = np.arange(vocab)
    if temperature == 0:
        return np.eye(vocab)[np.argmax(logits)]  # np.argmax returns the lowest id among ties
    p = np.exp((logits - logits.max()) / temperature)
    if 0 < top_k < vocab:
        order = np.lexsort((ids, -logits))  # by logit descending, then id ascending
        p[order[top_k:]] = 0.0
    p /= p.sum()
    if top_p < 1.0:
        order = np.lexsort((ids, -p))
        cum = np.cumsum(p[order])
        num_kept = int(np.searchsorted(cum, top_p)) + 1  # first prefix with mass >= top_p
        p[order[num_kept:]] = 0.0
        p /= p.sum()
    return p


def run_verify(logits, num_drafts, draft_ids, *, temperature=1.0, top_p=1.0, top_k=0,
               strategy=GREEDY, policy=NORMAL, uniforms=None, draft_probs=None, seed=0, **kw):
    """Call verify for requests with the given draft counts; returns (list of outputs, num_accepted)."""
    num_reqs = len(num_drafts)
    cu_rows = np.zeros(num_reqs + 1, dtype=np.int32)
    cu_rows[1:] = np.cumsum(np.asarray(num_drafts) + 1)
    num_rows, vocab = logits.shape
    if uniforms is None:
        uniforms = np.random.default_rng(seed).random((num_rows, 2))
    has_q = np.full(num_reqs, draft_probs is not None)
    if draft_probs is None:
        draft_probs = np.zeros((0, vocab), dtype=np.float32)
    full = lambda v, dt: np.full(num_reqs, v, dtype=dt)  # noqa: E731
    out_ids = np.full(num_rows, -1, dtype=np.int32)
    num_accepted = np.zeros(num_reqs, dtype=np.int32)
    verify(np.ascontiguousarray(logits, dtype=np.float32), cu_rows, np.asarray(draft_ids, np.int32),
           np.ascontiguousarray(draft_probs, dtype=np.float32), has_q, full(temperature, np.float32),
           full(top_p, np.float32), full(top_k, np.int32), full(strategy, np.int32), policy,
           uniforms, out_ids, num_accepted, **kw)
    outs = [out_ids[cu_rows[r]: cu_rows[r] + num_accepted[r] + 1].tolist() for r in range(num_reqs)]
    return outs, num_accepted


def one_hot_logits(winners, vocab=8):
    logits = np.zeros((len(winners), vocab), dtype=np.float32)
    logits[np.arange(len(winners)), winners] = 5.0
    return logits


# --- hand-made cases ---------------------------------------------------------------------------

def test_greedy_accepts_prefix_then_recovers_argmax():
    logits = one_hot_logits([3, 4, 5, 6])  # argmax per row
    outs, num_accepted = run_verify(logits, [3], [3, 4, 1])
    assert outs == [[3, 4, 5]] and num_accepted.tolist() == [2]  # 2 accepted + recovered 5


def test_greedy_all_accepted_gets_bonus_from_last_row():
    logits = one_hot_logits([3, 4, 5, 6])
    outs, num_accepted = run_verify(logits, [3], [3, 4, 5])
    assert outs == [[3, 4, 5, 6]] and num_accepted.tolist() == [3]


def test_greedy_ties_pick_lowest_id_and_zero_drafts_give_bonus_only():
    logits = np.zeros((1, 8), dtype=np.float32)
    logits[0, [2, 6]] = 1.0
    outs, _ = run_verify(logits, [0], [])
    assert outs == [[2]]


@pytest.mark.parametrize("strategy", [TARGET_MATCH, TOPP, REJECTION])
def test_temperature_zero_reduces_every_strategy_to_greedy(strategy):
    logits = one_hot_logits([3, 4, 5, 6, 1, 1])
    outs, _ = run_verify(logits, [3, 1], [3, 4, 7, 2], temperature=0.0, strategy=strategy)
    assert outs == [[3, 4, 5], [1]]


def test_ragged_batch_outputs_do_not_depend_on_batch_neighbours():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((9, 16)).astype(np.float32)
    uniforms = rng.random((9, 2))
    drafts = rng.integers(0, 16, size=6).astype(np.int32)
    kw = dict(temperature=0.8, strategy=REJECTION)
    together, _ = run_verify(logits, [3, 0, 3], drafts, uniforms=uniforms, **kw)
    alone = run_verify(logits[5:9], [3], drafts[3:], uniforms=uniforms[5:9], **kw)[0]
    assert together[2] == alone[0]


def test_large_batches_take_the_parallel_kernel_and_agree_with_single_requests():
    rng = np.random.default_rng(9)
    num_reqs, vocab = 64, 4096  # 320 rows * 4096 >= the parallel threshold
    logits = (rng.standard_normal((num_reqs * 5, vocab)) * 3).astype(np.float32)
    uniforms = rng.random((num_reqs * 5, 2))
    drafts = np.argmax(logits, axis=1).astype(np.int32).reshape(num_reqs, 5)[:, :4].ravel()  # likely drafts
    kw = dict(temperature=0.7, top_k=50, strategy=REJECTION)
    together, _ = run_verify(logits, [4] * num_reqs, drafts, uniforms=uniforms, **kw)
    for r in range(0, num_reqs, 9):
        rows = slice(5 * r, 5 * r + 5)
        alone, _ = run_verify(logits[rows], [4], drafts[4 * r: 4 * r + 4], uniforms=uniforms[rows], **kw)
        assert together[r] == alone[0]


def test_compile_kernels_covers_the_signatures_a_big_batch_uses():
    """The served engine's warm-up calls compile_kernels; a big batch must then compile nothing new."""
    from engine.spec_decode.verify import compile_kernels
    from engine.spec_decode.verify_kernels import verify_parallel, verify_serial

    compile_kernels()
    before = (set(verify_parallel.signatures), set(verify_serial.signatures))
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((64 * 5, 4096)).astype(np.float32)  # above the parallel threshold
    run_verify(logits, [4] * 64, rng.integers(0, 4096, 64 * 4).astype(np.int32), temperature=0.7, strategy=REJECTION)
    run_verify(logits[:5], [4], rng.integers(0, 4096, 4).astype(np.int32))
    assert (set(verify_parallel.signatures), set(verify_serial.signatures)) == before
    assert before[0] and before[1]


def test_accept_all_accepts_every_draft_and_adds_bonus():
    logits = one_hot_logits([3, 4, 5, 6])
    outs, num_accepted = run_verify(logits, [3], [0, 1, 2], policy=ACCEPT_ALL)
    assert outs == [[0, 1, 2, 6]] and num_accepted.tolist() == [3]


@pytest.mark.parametrize("strategy", [GREEDY, TARGET_MATCH, TOPP, REJECTION])
def test_reject_all_emits_what_plain_decoding_would(strategy):
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((3, 32)).astype(np.float32)
    uniforms = rng.random((3, 2))
    drafts = [int(np.argmax(logits[0])), 0]  # even a perfect draft is rejected
    outs, num_accepted = run_verify(logits, [2], drafts, temperature=0.9, top_k=20,
                                    strategy=strategy, policy=REJECT_ALL, uniforms=uniforms)
    if strategy == GREEDY:
        expected = int(np.argmax(logits[0]))
    else:
        p = ref_target_probs(logits[0], 0.9, top_k=20)
        expected = int(np.searchsorted(np.cumsum(p), uniforms[0, 1], side="right"))
    assert outs == [[expected]] and num_accepted.tolist() == [0]


def test_rejection_always_accepts_certain_token_and_never_emits_impossible_draft():
    logits = one_hot_logits([3, 3]) * 10  # p(3) == 1 up to rounding
    outs, _ = run_verify(logits, [1], [3], strategy=REJECTION)
    assert outs[0][0] == 3
    rng = np.random.default_rng(3)
    logits = np.tile(rng.standard_normal(16).astype(np.float32), (2 * 200, 1))
    excluded = int(np.argmin(logits[0]))  # outside the top 8, so p(excluded) == 0
    outs, num_accepted = run_verify(logits, [1] * 200, [excluded] * 200, strategy=REJECTION, top_k=8)
    assert num_accepted.sum() == 0 and all(o[0] != excluded for o in outs)


def inverse_cdf(weights, u):
    return int(np.searchsorted(np.cumsum(weights) / np.sum(weights), u, side="right"))


def test_target_match_accepts_while_the_target_sample_equals_the_draft():
    rng = np.random.default_rng(11)
    logits = rng.standard_normal((3, 8)).astype(np.float32)
    p = [ref_target_probs(row, 1.0) for row in logits]
    uniforms = rng.random((3, 2))
    sampled = [inverse_cdf(p[i], uniforms[i, 1]) for i in range(3)]
    other = (sampled[1] + 1) % 8
    outs, num_accepted = run_verify(logits, [2], [sampled[0], other], strategy=TARGET_MATCH, uniforms=uniforms)
    assert outs == [[sampled[0], sampled[1]]] and num_accepted.tolist() == [1]  # recovered = row 1's sample


def test_rejection_with_draft_probs_resamples_the_residual():
    logits = np.log(np.array([[0.5, 0.3, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25]], dtype=np.float32))
    q = np.array([[0.1, 0.8, 0.05, 0.05]], dtype=np.float32)  # draft 1 is over-proposed: p/q = 0.375
    for u_accept, accepted in [(0.3, True), (0.5, False)]:
        uniforms = np.array([[u_accept, 0.7], [0.0, 0.2]])
        outs, _ = run_verify(logits, [1], [1], strategy=REJECTION, draft_probs=q, uniforms=uniforms)
        residual = np.maximum(ref_target_probs(logits[0], 1.0) - q[0], 0)  # [0.4, 0, 0.05, 0.05]
        expected = [1, inverse_cdf([0.25] * 4, 0.2)] if accepted else [inverse_cdf(residual, 0.7)]
        assert outs == [expected]


def test_topp_accepts_drafts_among_the_top_candidates_only():
    logits = np.tile(np.arange(16, dtype=np.float32)[::-1].copy(), (9, 1))  # rank == token id
    _, num_accepted = run_verify(logits, [2, 2, 2], [1, 4, 4, 5, 0, 3], strategy=TOPP,
                                    temperature=2.0, max_candidate_len=5)
    # ranks 1 and 4 are inside the top 5; rank 5 is not; req 3: rank 0 then rank 3 -> bonus
    assert num_accepted.tolist() == [2, 1, 2]
    _, num_accepted = run_verify(logits[:2], [1], [2], strategy=TOPP, temperature=2.0, max_candidate_len=2)
    assert num_accepted.tolist() == [0]
    # verify_top_p: token 0 alone holds p = 1 - e^-0.5 = 0.39 > 0.3 of the mass, so rank 1 is out
    _, num_accepted = run_verify(logits[:4], [1, 1], [0, 1], strategy=TOPP, temperature=2.0, verify_top_p=0.3)
    assert num_accepted.tolist() == [1, 0]


@pytest.mark.parametrize("own_buffers", [False, True])
def test_bad_inputs_raise_value_error_naming_the_argument(own_buffers):
    """Every value a proposer or a request sets is checked, also for a caller whose buffers fix the dtypes and
    shapes (StepBatch): a draft id outside the vocabulary is a ValueError, not a wild read in the kernel."""
    logits = one_hot_logits([1, 2])
    kw = {"own_buffers": own_buffers}
    for cu_rows in ([0, 3], [0, 0, 2], [1, 2]):
        with pytest.raises(ValueError, match="cu_rows"):
            num_reqs = len(cu_rows) - 1
            verify(logits, np.array(cu_rows, np.int32), np.zeros(2 - num_reqs, np.int32), np.zeros((0, 8), np.float32),
                   np.zeros(num_reqs, bool), np.ones(num_reqs, np.float32), np.ones(num_reqs, np.float32),
                   np.zeros(num_reqs, np.int32), np.zeros(num_reqs, np.int32), NORMAL, np.zeros((2, 2)),
                   np.zeros(2, np.int32), np.zeros(num_reqs, np.int32), **kw)
    for bad_id in (99, 8, -1):
        with pytest.raises(ValueError, match="draft_ids"):
            run_verify(logits, [1], [bad_id], **kw)
    with pytest.raises(ValueError, match="top_p"):
        run_verify(logits, [1], [1], top_p=0.0, **kw)
    for bad in (-0.5, np.nan, np.inf):
        with pytest.raises(ValueError, match="temperature"):
            run_verify(logits, [1], [1], temperature=bad, **kw)
    with pytest.raises(ValueError, match="top_k"):
        run_verify(logits, [1], [1], top_k=-1, **kw)
    with pytest.raises(ValueError, match="strategy"):
        run_verify(logits, [1], [1], strategy=REJECTION + 1, **kw)
    with pytest.raises(ValueError, match="policy"):
        run_verify(logits, [1], [1], policy=7, **kw)


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, 0, 1.0), (0.5, 0, 1.0), (1.3, 7, 1.0), (0.8, 0, 0.7), (0.7, 20, 0.9), (0.0, 5, 0.5),
    (1.0, 1, 1.0), (2.0, 0, 0.05),
])
def test_target_probs_matches_numpy_reference(temperature, top_k, top_p):
    logits = (np.random.default_rng(4).standard_normal((4, 300)) * 2).astype(np.float32)
    got = target_probs(logits, temperature, top_k, top_p)
    for row in range(4):
        np.testing.assert_allclose(got[row], ref_target_probs(logits[row], temperature, top_k, top_p),
                                   rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 300, 1.0), (0.9, 0, 0.6), (1.2, 5000, 0.95)])
def test_target_probs_at_full_vocab_with_tied_logits(temperature, top_k, top_p):
    # Logits on a 0.25 grid: many exact ties, so the top_k and top_p cuts fall inside tie groups.
    logits = np.round(np.random.default_rng(10).standard_normal((2, 49152)) * 8) / 4
    got = target_probs(logits.astype(np.float32), temperature, top_k, top_p)
    for row in range(2):
        np.testing.assert_allclose(got[row], ref_target_probs(logits[row], temperature, top_k, top_p),
                                   rtol=1e-9, atol=1e-15)



@pytest.mark.parametrize("temperature", [1.0, 0.37, 2.5])
def test_target_probs_exp_is_float64_exact_across_its_range(temperature):
    # The kernels compute exp without libm (so that the vocabulary loop runs as vector code): check it
    # against NumPy's float64 exp over the whole range it serves, from the peak down to past underflow.
    # Below z = -708 the kernel gives 0 where NumPy gives a subnormal (< 3e-308 of the peak's mass). The
    # kernel scales by 1 / T (one more rounding of z: a relative error up to |z| * 2**-53, ~1e-13 at -708).
    z = -np.concatenate([[0.0], np.geomspace(1e-9, 900.0, 20_000), np.linspace(0.0, 40.0, 9_999)])
    logits = (z * temperature).astype(np.float32)[None, :]
    got = target_probs(logits, temperature)[0]
    want = ref_target_probs(logits[0], temperature)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-300)
    assert (got[(logits[0].astype(np.float64) - logits.max()) / temperature < -708.0] == 0).all()

# --- statistical tests -------------------------------------------------------------------------

SAMPLE_SIZES = (100, 1_000, 10_000, 100_000)


def tv_bound(num_samples, vocab, delta=1e-6):
    """E[TV] <= 0.5 * sqrt(2 * vocab / (pi * n)), plus McDiarmid's deviation sqrt(ln(1/delta) / 2n)."""
    return 0.5 * math.sqrt(2 * vocab / (math.pi * num_samples)) + math.sqrt(math.log(1 / delta) / (2 * num_samples))


def first_token_tv(p, logits_row, num_samples, strategy, q=None, seed=0, **kw):
    """TV distance between p and the first output token of `num_samples` one-draft requests."""
    vocab = p.shape[0]
    rng = np.random.default_rng(seed)
    # Model-free drafts: an arbitrary fixed rule (here, a skewed fixed pick) with one-hot q.
    drafts = rng.choice(vocab, size=num_samples, p=q if q is not None else _skewed(vocab))
    logits = np.tile(logits_row, (2 * num_samples, 1))
    draft_probs = None if q is None else np.tile(q, (num_samples, 1))
    outs, _ = run_verify(logits, [1] * num_samples, drafts, strategy=strategy, draft_probs=draft_probs,
                         seed=seed + 1, **kw)
    counts = np.bincount([o[0] for o in outs], minlength=vocab)
    return 0.5 * np.abs(counts / num_samples - p).sum()


def _skewed(vocab):
    w = np.arange(1, vocab + 1, dtype=np.float64) ** 2
    return w / w.sum()


def random_q(vocab, seed):
    q = np.random.default_rng(seed).dirichlet(np.ones(vocab))
    return q.astype(np.float32) / q.astype(np.float32).sum()


CASES = [  # (strategy, uses draft probs q, temperature, top_k, top_p)
    (REJECTION, False, 1.0, 0, 1.0),
    (REJECTION, True, 1.0, 0, 1.0),
    (REJECTION, True, 0.7, 10, 0.9),
    (TARGET_MATCH, False, 1.0, 0, 1.0),
    (TARGET_MATCH, True, 0.8, 0, 0.85),
]


@pytest.mark.parametrize("strategy,with_q,temperature,top_k,top_p", CASES)
def test_lossless_strategies_converge_to_target(strategy, with_q, temperature, top_k, top_p):
    vocab = 16
    logits_row = (np.random.default_rng(5).standard_normal(vocab) * 1.5).astype(np.float32)
    p = ref_target_probs(logits_row, temperature, top_k, top_p)
    q = random_q(vocab, 6) if with_q else None
    tvs = [first_token_tv(p, logits_row, n, strategy, q=q, seed=n, temperature=temperature,
                          top_k=top_k, top_p=top_p) for n in SAMPLE_SIZES]
    assert tvs[-1] < tv_bound(SAMPLE_SIZES[-1], vocab), tvs
    assert tvs[-1] < tvs[0] / 5, tvs  # the distance shrinks as the samples grow


def test_topp_is_not_lossless_and_the_test_can_tell():
    vocab = 16
    logits_row = (np.random.default_rng(5).standard_normal(vocab) * 1.5).astype(np.float32)
    p = ref_target_probs(logits_row, 1.0)
    q = random_q(vocab, 6)
    tv = first_token_tv(p, logits_row, SAMPLE_SIZES[-1], TOPP, q=q, seed=7)
    assert tv > 5 * tv_bound(SAMPLE_SIZES[-1], vocab)


def test_a_wrong_residual_is_caught():
    """Sanity of the statistical test: rejection that resamples from p (not p - q) is biased."""
    vocab, n = 16, SAMPLE_SIZES[-1]
    rng = np.random.default_rng(8)
    logits_row = (np.random.default_rng(5).standard_normal(vocab) * 1.5).astype(np.float32)
    p, q = ref_target_probs(logits_row, 1.0), random_q(vocab, 6).astype(np.float64)
    drafts = rng.choice(vocab, size=n, p=q / q.sum())
    accept = rng.random(n) * q[drafts] < p[drafts]
    resampled = rng.choice(vocab, size=n, p=p)  # the bug: forgets to subtract q
    first = np.where(accept, drafts, resampled)
    tv = 0.5 * np.abs(np.bincount(first, minlength=vocab) / n - p).sum()
    assert tv > 5 * tv_bound(n, vocab)


def argmax_cases():
    """Rows whose maximum sits at every chunk boundary the kernels use (16-element chunks, 64-element
    vector steps, a scalar tail), with ties, signed zeros, infinities and NaNs."""
    rng = np.random.default_rng(11)
    for n in (1, 15, 16, 17, 63, 64, 65, 200, 49152):
        row = rng.standard_normal(n).astype(np.float32)
        yield row
        for at in {0, n // 2, n - 1, min(n - 1, 63), min(n - 1, 64)}:
            tied = row.copy()
            tied[at] = tied[n - 1 - at] = 9.0  # two positions share the maximum: the lower id wins
            yield tied
        yield np.full(n, -np.inf, np.float32)
        yield np.where(rng.random(n) < 0.5, np.float32(0.0), np.float32(-0.0)).astype(np.float32)
        nan = row.copy()
        nan[rng.random(n) < 0.3] = np.nan
        nan[0] = 1.0
        yield nan


def test_argmax_and_extremes_match_numpy():
    """The vector argmax: the lowest id of the maximum, NaN never winning (NaN at index 0: 0, as a strict
    scan from index 0 gives); the logit extremes equal NumPy's NaN-ignoring max and min."""
    from engine.spec_decode.verify_kernels import _extreme, argmax

    for row in argmax_cases():
        values = np.where(np.isnan(row), -np.inf, row)
        want = int(np.flatnonzero(values == values.max())[0])
        assert argmax(row) == want, row
        assert _extreme(row, np.float32(1.0)) == np.nanmax(row)
        assert _extreme(row, np.float32(-1.0)) == np.nanmin(row)
    assert argmax(np.array([np.nan, 1.0, 2.0], np.float32)) == 0
