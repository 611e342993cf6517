"""The draft-length controller: when speculation pays, and how often a request probes when it does not."""

import numpy as np

from engine.protocol import SamplingParams
from engine.sequence import Sequence
from engine.spec_control import PROBE_EVERY, PROBE_MAX, DraftController

LINEAR_COST = np.arange(10, dtype=np.float64)  # verify_cost[T] = T: a verify of T tokens costs T plain steps
FLAT_COST = np.ones(10)  # verifying T tokens costs one plain step


def make_seq() -> Sequence:
    return Sequence("r", [1, 2, 3], SamplingParams(max_tokens=10_000), capacity=16)


def run_steps(ctl: DraftController, seq: Sequence, num_steps: int) -> list[int]:
    """Steps at which the controller gave drafts, updating the counter the way the engine does."""
    drafted = []
    for step in range(num_steps):
        ctl.start_step()
        if ctl.room(None, seq, remaining_tokens=10_000) > 0:
            drafted.append(step)
            seq.steps_without_drafts = 0
        else:
            seq.steps_without_drafts += 1
    return drafted


def test_best_k_follows_the_cost_model():
    ctl = DraftController(max_k=4, step_budget=0, verify_cost=FLAT_COST)
    assert ctl.best_k(first=0.9, cont=0.9, cap=4) == 4  # free verification: draft all you may
    ctl = DraftController(max_k=4, step_budget=0, verify_cost=LINEAR_COST)
    # k drafts cost k extra steps and yield at most k extra tokens: never better than plain decoding
    assert ctl.best_k(first=0.9, cont=0.9, cap=4) == 0


def test_probes_back_off_while_drafting_does_not_pay():
    ctl = DraftController(max_k=4, step_budget=0, verify_cost=LINEAR_COST)
    seq = make_seq()
    seq.first_accept_ema = 0.0
    probes = run_steps(ctl, seq, 1000)
    gaps = np.diff([-1] + probes) - 1  # plain steps before each probe
    expected = [PROBE_EVERY]
    while sum(expected) + len(expected) < 1000 - PROBE_MAX:
        expected.append(min(2 * expected[-1], PROBE_MAX))
    assert gaps.tolist()[: len(expected)] == expected
    assert expected[:5] == [8, 16, 32, 64, 128] and PROBE_MAX == 128


def test_back_off_resets_once_drafting_pays_again():
    ctl = DraftController(max_k=4, step_budget=0, verify_cost=LINEAR_COST)
    seq = make_seq()
    seq.first_accept_ema = 0.0
    run_steps(ctl, seq, 300)
    assert seq.probe_interval == PROBE_MAX
    ctl.verify_cost, seq.first_accept_ema = FLAT_COST, 0.5  # drafting pays again: every step drafts
    assert run_steps(ctl, seq, 3) == [0, 1, 2]
    assert seq.probe_interval == 0
    ctl.verify_cost = LINEAR_COST  # and stops paying: the first probe comes after PROBE_EVERY steps again
    assert run_steps(ctl, seq, PROBE_EVERY + 1) == [PROBE_EVERY]


def test_non_adaptive_drafts_the_full_cap_every_step():
    ctl = DraftController(max_k=3, step_budget=0, verify_cost=LINEAR_COST, adaptive=False)
    seq = make_seq()
    seq.first_accept_ema = 0.0
    assert [ctl.room(None, seq, 10_000) for _ in range(5)] == [3] * 5
