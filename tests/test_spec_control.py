"""The draft-length controller: when speculation pays, how often a request probes when it does not,
and how the sources of a hybrid proposer are judged apart."""

import numpy as np
import pytest

from engine.serving.protocol import SamplingParams
from engine.core.sequence import Sequence
from engine.spec_decode.spec_control import COST_SAMPLES, PRIOR_WEIGHT, PROBE_EVERY, PROBE_MAX, DraftController, SourceStats

LINEAR_COST = np.arange(10, dtype=np.float64)  # verify_cost[T] = T: a verify of T tokens costs T plain steps
FLAT_COST = np.ones(10)  # verifying T tokens costs one plain step
HYBRID = ("ngram", "mtp")


RECORD = 1e9  # outcomes behind make_seq's estimates: the request's own record outweighs any prior
CPU_CURVE = np.array([0.0, 1.0, 1.14, 1.24, 1.35, 1.5])  # verify cost measured on the 2-core CPU
HEAD_COST = 0.13  # an eagle draft token there, in plain steps


def make_seq(**first: float) -> Sequence:
    """A request whose sources have a long record at the given first-draft acceptance rates."""
    seq = Sequence("r", [1, 2, 3], SamplingParams(max_tokens=10_000), capacity=16)
    seq.draft_stats = {name: SourceStats(first=value, weight=RECORD, cont_weight=RECORD) for name, value in first.items()}
    return seq


def drafting_steps(ctl: DraftController, seq: Sequence, hits: list[bool], source: str = "eagle") -> int:
    """Steps (one per entry of `hits`) on which `source` drafted; a draft passes where hits says so."""
    count = 0
    for hit in hits:
        ctl.start_step()
        k = ctl.room(None, seq.draft_stats, 10_000, (source,))[source]
        ctl.record(seq.draft_stats, source if k else None, k, int(hit and k > 0))
        count += k > 0
    return count


def run_steps(ctl: DraftController, seq: Sequence, num_steps: int, source: str = "ngram") -> list[int]:
    """Steps at which the controller let `source` draft; every draft is rejected, as the engine records it."""
    drafted = []
    for step in range(num_steps):
        ctl.start_step()
        k = ctl.room(None, seq.draft_stats, 10_000, (source,))[source]
        if k > 0:
            drafted.append(step)
        ctl.record(seq.draft_stats, source if k else None, k, 0)
    return drafted


def test_best_k_follows_the_cost_model():
    ctl = DraftController(max_k=4, step_budget=0, verify_cost=FLAT_COST)
    assert ctl.best_k(first=0.9, cont=0.9, cap=4) == 4  # free verification: draft all you may
    # ... unless drafting itself costs: a draft token at the price of a plain step never pays at first = 0.5
    assert ctl.best_k(first=0.5, cont=0.5, cap=4, draft_cost=1.0) == 0
    ctl = DraftController(max_k=4, step_budget=0, verify_cost=LINEAR_COST)
    # k drafts cost k extra steps and yield at most k extra tokens: never better than plain decoding
    assert ctl.best_k(first=0.9, cont=0.9, cap=4) == 0


def test_probes_back_off_while_drafting_does_not_pay():
    ctl = DraftController(max_k=4, step_budget=0, verify_cost=LINEAR_COST)
    seq = make_seq(ngram=0.0)
    probes = run_steps(ctl, seq, 1000)
    gaps = np.diff([-1] + probes) - 1  # plain steps before each probe
    expected = [PROBE_EVERY]
    while sum(expected) + len(expected) < 1000 - PROBE_MAX:
        expected.append(min(2 * expected[-1], PROBE_MAX))
    assert gaps.tolist()[: len(expected)] == expected
    assert expected[:5] == [8, 16, 32, 64, 128] and PROBE_MAX == 128


def test_back_off_resets_once_drafting_pays_again():
    ctl = DraftController(max_k=4, step_budget=0, verify_cost=LINEAR_COST)
    seq = make_seq(ngram=0.0)
    run_steps(ctl, seq, 300)
    stats = seq.draft_stats["ngram"]
    assert stats.probe_interval == PROBE_MAX
    ctl.verify_cost, stats.first = FLAT_COST, 0.5  # drafting pays again: every step drafts
    assert run_steps(ctl, seq, 3) == [0, 1, 2]
    assert stats.probe_interval == 0
    ctl.verify_cost = LINEAR_COST  # and stops paying: the first probe comes after PROBE_EVERY steps again
    assert run_steps(ctl, seq, PROBE_EVERY + 1) == [PROBE_EVERY]


def test_a_probe_the_proposer_did_not_use_is_offered_again():
    """A lookup that found nothing did not probe: the wait does not grow until a probe really drafts."""
    ctl = DraftController(max_k=4, step_budget=0, verify_cost=LINEAR_COST)
    seq = make_seq(ngram=0.0)
    seq.draft_stats["ngram"].idle_steps = PROBE_EVERY
    for _ in range(3):  # offered a probe, but the lookup had no match
        assert ctl.room(None, seq.draft_stats, 10_000, ("ngram",)) == {"ngram": 1}
        ctl.record(seq.draft_stats, None, 0, 0)
    assert seq.draft_stats["ngram"].probe_interval == 0
    ctl.room(None, seq.draft_stats, 10_000, ("ngram",))
    ctl.record(seq.draft_stats, "ngram", 1, 0)  # this time it drafted, and missed
    assert seq.draft_stats["ngram"].probe_interval == 2 * PROBE_EVERY


def test_non_adaptive_drafts_the_full_cap_every_step():
    ctl = DraftController(max_k=3, step_budget=0, verify_cost=LINEAR_COST, adaptive=False)
    seq = make_seq(ngram=0.0)
    assert [ctl.room(None, seq.draft_stats, 10_000, ("ngram",)) for _ in range(5)] == [{"ngram": 3}] * 5


def test_a_weak_source_does_not_cost_the_strong_one_its_drafts():
    """Hybrid: the head's rejected drafts lower only the head's estimate; the lookup keeps drafting."""
    curve = np.array([0.0, 1.0, 1.3, 1.6, 1.9, 2.2])  # a verify curve shaped like the CPU's
    ctl = DraftController(max_k=4, step_budget=0, verify_cost=curve)
    earlier = make_seq(mtp=0.5)
    for _ in range(60):  # on this server the head's drafts have seldom passed
        ctl.record(earlier.draft_stats, "mtp", 2, 0)
    seq = make_seq()
    for step in range(40):
        caps = ctl.room(None, seq.draft_stats, 10_000, HYBRID)
        if step % 2 == 0 and caps["ngram"]:  # the lookup finds a match every other step; all 4 pass
            ctl.record(seq.draft_stats, "ngram", caps["ngram"], caps["ngram"])
        elif caps["mtp"]:  # elsewhere the head drafts; none passes
            ctl.record(seq.draft_stats, "mtp", caps["mtp"], 0)
        else:
            ctl.record(seq.draft_stats, None, 0, 0)
    caps = ctl.room(None, seq.draft_stats, 10_000, HYBRID)
    assert caps["ngram"] == 4 and caps["mtp"] == 0
    assert seq.draft_stats["ngram"].first > 0.99
    head = seq.draft_stats["mtp"]  # a few misses stopped it; its probes are backing off
    assert head.first < 0.2 and head.probe_interval >= 2 * PROBE_EVERY


def test_draft_cost_is_kept_per_source():
    ctl = DraftController(max_k=4, step_budget=0, verify_cost=FLAT_COST, t1_seconds=0.01)
    ctl.note_draft_time("mtp", seconds=0.02, num_draft_tokens=4)  # 5 ms a token = half a plain step
    ctl.note_draft_time("ngram", seconds=0.0001, num_draft_tokens=4)
    ctl.note_draft_time("ngram", seconds=0.0, num_draft_tokens=0)  # nothing drafted: no change
    assert ctl.draft_cost["mtp"] == 0.5 and ctl.draft_cost["ngram"] == 0.0025
    seq = make_seq(ngram=0.3, mtp=0.3)
    seq.draft_stats["ngram"].cont = seq.draft_stats["mtp"].cont = 0.3
    # same acceptance, but only the free source pays: at first = 0.3, k drafts yield < 1 + 0.43 tokens
    # for 1 + 0.5 k steps of drafting with the head
    assert ctl.room(None, seq.draft_stats, 10_000, HYBRID) == {"ngram": 4, "mtp": 0}


def test_one_slow_draft_does_not_set_the_draft_cost():
    """A draft that waited on compilation (or a page fault) is not what drafting costs: the cost is the
    median of recent drafts, so it is back to the usual figure after two more, and a later outlier
    alone does not move it."""
    ctl = DraftController(max_k=4, step_budget=0, verify_cost=FLAT_COST, t1_seconds=0.01)
    ctl.note_draft_time("eagle", seconds=3.0, num_draft_tokens=1)  # 300 plain steps: a compile
    ctl.note_draft_time("eagle", seconds=0.0015, num_draft_tokens=1)
    ctl.note_draft_time("eagle", seconds=0.0015, num_draft_tokens=1)
    assert ctl.draft_cost["eagle"] == pytest.approx(0.15)
    for _ in range(5):
        ctl.note_draft_time("eagle", seconds=0.0015, num_draft_tokens=1)
    ctl.note_draft_time("eagle", seconds=1.0, num_draft_tokens=1)
    assert ctl.draft_cost["eagle"] == pytest.approx(0.15)
    for _ in range(COST_SAMPLES):  # and a head that became dearer is seen as such
        ctl.note_draft_time("eagle", seconds=0.005, num_draft_tokens=1)
    assert ctl.draft_cost["eagle"] == pytest.approx(0.5)


def test_the_step_budget_caps_every_source():
    ctl = DraftController(max_k=4, step_budget=3, verify_cost=FLAT_COST)
    seq_a, seq_b = make_seq(ngram=0.9, mtp=0.9), make_seq(ngram=0.9, mtp=0.9)
    ctl.start_step()
    assert ctl.room(None, seq_a.draft_stats, 10_000, HYBRID) == {"ngram": 3, "mtp": 3}
    assert ctl.room(None, seq_b.draft_stats, 10_000, HYBRID) == {"ngram": 0, "mtp": 0}


def test_a_new_request_starts_from_what_the_source_did_for_earlier_ones():
    ctl = DraftController(max_k=4, step_budget=0, verify_cost=np.array([0.0, 1.0, 1.3, 1.6, 1.9, 2.2]))
    assert ctl.room(None, make_seq().draft_stats, 10_000, ("eagle",))["eagle"] > 0  # no history: 0.5, try it
    earlier = make_seq(eagle=0.5)
    for _ in range(60):  # earlier requests: the head's drafts never passed
        ctl.record(earlier.draft_stats, "eagle", 2, 0)
    assert ctl.prior["eagle"].first == pytest.approx(0.5 * (1 - PRIOR_WEIGHT) ** 60)
    fresh = make_seq()
    assert ctl.room(None, fresh.draft_stats, 10_000, ("eagle",)) == {"eagle": 0}  # does not pay: plain from step 1
    assert ctl.estimate("eagle", fresh.draft_stats["eagle"]) == (ctl.prior["eagle"].first, ctl.prior["eagle"].cont)
    assert ctl.room(None, make_seq().draft_stats, 10_000, ("ngram",))["ngram"] > 0  # other sources keep 0.5


def test_a_head_that_pays_keeps_drafting_through_runs_of_misses():
    """A head whose first draft passes 40% of the time (it pays from ~27%) drafts on most steps,
    through the runs of four or five misses that such a rate brings."""
    ctl = DraftController(max_k=1, step_budget=0, verify_cost=CPU_CURVE[:3])
    ctl.draft_cost["eagle"] = HEAD_COST
    hits = (np.random.default_rng(0).random(400) < 0.4).tolist()
    assert drafting_steps(ctl, make_seq(), hits) >= 320  # 351; a short EMA without the server's rate: 48


def test_a_request_the_head_cannot_predict_seldom_drafts():
    """The head pays on this server's other requests, but misses every draft of this one: it retries only
    as the request's record fades toward the server's rate."""
    ctl = DraftController(max_k=1, step_budget=0, verify_cost=CPU_CURVE[:3])
    ctl.draft_cost["eagle"] = HEAD_COST
    drafting_steps(ctl, make_seq(), [True, False] * 100)  # earlier requests: 50%
    assert drafting_steps(ctl, make_seq(), [False] * 200) <= 60
