"""vLLM's --scheduling-policy: `priority` admits, budgets and preempts by (priority, arrival); `fcfs` by arrival.

The scheduler alone (its block manager, no model) for the order; the engine on the real model for the request
field: priority changes who goes first, never what a request generates."""

from __future__ import annotations

import pytest

from engine.core.block_manager import BlockManager
from engine.core.scheduler import Scheduler
from engine.core.sequence import Sequence, Status
from engine.errors import InvalidRequest
from engine.generate import generate
from engine.serving.protocol import Generate, SamplingParams

BLOCK = 4


def request(name: str, priority: int = 0, prompt_len: int = 3) -> Sequence:
    return Sequence(name, list(range(10, 10 + prompt_len)), SamplingParams(max_tokens=64, priority=priority),
                    capacity=128)


def step(sched: Scheduler) -> list[str]:
    """One engine step as the engine books it (no drafts): scheduled request ids, in budget order; each
    scheduled decode appends one token."""
    out = sched.schedule(lambda seq: 0)
    for item in out.scheduled:
        item.seq.num_computed_tokens += item.num_new_tokens
        if item.seq.num_computed_tokens == item.seq.num_tokens:
            item.seq.append(1)
    return [item.seq.request_id for item in out.scheduled]


def scheduler(policy: str, num_blocks: int = 64, max_num_seqs: int = 8) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, BLOCK), max_num_seqs, max_num_batched_tokens=64, max_model_len=128,
                     policy=policy)


@pytest.mark.parametrize("policy, order", [("fcfs", ["a", "b", "c"]), ("priority", ["c", "a", "b"])])
def test_waiting_requests_are_admitted_in_the_policys_order(policy, order):
    sched = scheduler(policy, max_num_seqs=1)
    seqs = {s.request_id: s for s in (request("a", 0), request("b", 5), request("c", -1))}
    for s in seqs.values():
        sched.add(s)
    admitted = []
    while len(admitted) < 3:
        (running,) = step(sched)
        if running not in admitted:
            admitted.append(running)
            sched.finish(seqs[running])  # done after one step: the next one gets the slot
    assert admitted == order


def test_equal_priorities_keep_arrival_order():
    sched = scheduler("priority")
    for name in "abcd":
        sched.add(request(name, 2))
    assert step(sched) == list("abcd")


def test_a_later_request_of_a_lower_value_gets_the_budget_first():
    sched = scheduler("priority")
    sched.add(request("late", 4))
    step(sched)
    sched.add(request("urgent", 1))
    assert step(sched) == ["late", "urgent"]  # admitted after the running requests had their share
    assert step(sched) == ["urgent", "late"]  # running: first in line for the budget


@pytest.mark.parametrize("policy, victim", [("fcfs", "urgent"), ("priority", "late")])
def test_the_victim_of_a_preemption(policy, victim):
    """Two requests fill the KV cache; when one must grow, fcfs preempts the last admitted, priority the one with
    the higher value (here the one that arrived first)."""
    sched = scheduler(policy, num_blocks=2)
    late, urgent = request("late", 3, prompt_len=BLOCK), request("urgent", 0, prompt_len=BLOCK)
    sched.add(late)
    sched.add(urgent)
    step(sched)  # both prefilled: a block each, full; the next decode needs a second block
    out = sched.schedule(lambda seq: 0)
    assert [s.request_id for s in out.preempted] == [victim]
    assert {"late": late, "urgent": urgent}[victim].status is Status.WAITING
    assert [item.seq.request_id for item in out.scheduled] == [n for n in ("late", "urgent") if n != victim]


def test_a_preempted_request_waits_ahead_of_later_arrivals_of_its_priority():
    sched = scheduler("priority", num_blocks=2)
    first, second = request("first", 3, prompt_len=BLOCK), request("second", 0, prompt_len=BLOCK)
    sched.add(first)
    sched.add(second)
    step(sched)
    sched.add(request("third", 3))  # arrives after `first`
    sched.schedule(lambda seq: 0)  # `first` is preempted
    assert [s.request_id for s in sched.waiting] == ["first", "third"]


def test_an_unknown_policy_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match="scheduling_policy"):
        scheduler("lottery")


# ---------------------------------------------------------------- the engine, real model


PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "List three colours: red,"]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def test_priority_orders_the_engines_requests_and_keeps_their_text(engine, make_engine):
    """One running slot: requests finish in priority order; each text is what an fcfs engine gives it alone."""
    from msgspec.structs import replace

    prio = make_engine(scheduling_policy="priority", max_num_seqs=1)
    alone = [generate(engine, [p], GREEDY)[0] for p in PROMPTS]
    priorities = [2, 0, 1]
    for i, (prompt, p) in enumerate(zip(PROMPTS, priorities)):
        prio.add_request(Generate(f"p{i}", replace(GREEDY, priority=p), prompt=prompt))
    finished, tokens = [], {}
    while prio.has_unfinished():
        for out in prio.step():
            tokens[out.request_id] = tokens.get(out.request_id, []) + out.token_ids
            if out.finish_reason is not None:
                finished.append(out.request_id)
    assert finished == ["p1", "p2", "p0"]
    assert [tokens[f"p{i}"] for i in range(3)] == [c.token_ids for c in alone]


def test_an_fcfs_engine_refuses_a_priority_naming_the_field(engine):
    with pytest.raises(InvalidRequest) as err:
        engine.add_request(Generate("prio-refused", SamplingParams(max_tokens=2, priority=1), prompt="Hi"))
    assert err.value.param == "priority" and "--scheduling-policy priority" in str(err.value)
    assert not engine.has_unfinished()
    assert generate(engine, ["Hi"], SamplingParams(max_tokens=2, priority=0))[0].finish_reason == "length"
