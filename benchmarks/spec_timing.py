"""Measure one benchmark block on a live engine without editing it: timers and counter diffs.

`instrument(engine)` wraps `engine.proposer.propose` and `engine.runner.forward` in timing
shims (instance attributes, removed on exit) and diffs the engine's speculation counters
(`spec_totals`: counts and accepted_per_pos) across the block, so the engine's own bookkeeping is the
source of acceptance numbers and nothing accumulates between blocks.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np


@dataclass
class BlockTimers:
    propose_s: float = 0.0
    num_propose_calls: int = 0
    forward_s: float = 0.0
    num_forwards: int = 0  # = engine steps that ran the model
    num_asks: int = 0  # (request, step) pairs the controller let draft
    num_allowed_tokens: int = 0  # sum of their max_draft_tokens: the controller's k
    counters: dict = field(default_factory=dict)  # engine.spec_totals.counts diff
    accepted_per_pos: list[int] = field(default_factory=list)  # [K] diff


def _timed_forward(fn, timers: BlockTimers):
    def forward(batch):
        start = time.perf_counter()
        try:
            return fn(batch)
        finally:
            timers.forward_s += time.perf_counter() - start
            timers.num_forwards += 1

    return forward


def _timed_propose(fn, timers: BlockTimers):
    """Times the call and records how many draft tokens the controller allowed."""
    def propose(requests):
        start = time.perf_counter()
        try:
            drafts = fn(requests)
        finally:
            timers.propose_s += time.perf_counter() - start
            timers.num_propose_calls += 1
        timers.num_asks += len(requests)
        timers.num_allowed_tokens += sum(r.max_draft_tokens for r in requests)
        return drafts

    return propose


@contextmanager
def instrument(engine):
    timers = BlockTimers()
    totals_before = dict(engine.spec_totals.counts)
    per_pos_before = engine.spec_totals.accepted_per_pos.copy()
    proposer, runner = engine.proposer, engine.runner
    if proposer is not None:
        proposer.propose = _timed_propose(proposer.propose, timers)
    runner.forward = _timed_forward(runner.forward, timers)
    try:
        yield timers
    finally:
        if proposer is not None:
            del proposer.propose  # the class's method shows through again
        del runner.forward
        timers.counters = {k: v - totals_before.get(k, 0) for k, v in engine.spec_totals.counts.items()}
        timers.accepted_per_pos = (engine.spec_totals.accepted_per_pos - per_pos_before).tolist()


def reset_proposer(engine) -> None:
    """A fresh proposer of the same class and config, and no acceptance history in the draft controller:
    no state carried over from earlier blocks."""
    if engine.has_unfinished():
        raise ValueError("engines: cannot reset the proposer of an engine with running requests")
    engine.reset_proposers()


def block_raw(results: list[dict], wall_s: float, timers: BlockTimers) -> dict:
    """Raw sums of one block; every reported metric is derived from these (so they add up)."""
    tpots = [(r["done_s"] - r["first_s"]) / (len(r["token_ids"]) - 1)
             for r in results if len(r["token_ids"]) > 1 and r["done_s"] is not None]
    c = timers.counters
    drafted, reached = _per_pos([d for r in results for d in r["drafts"]])
    return {
        "num_prompts": len(results),
        "output_tokens": sum(len(r["token_ids"]) for r in results),
        "wall_s": wall_s,
        "engine_steps": timers.num_forwards,
        "request_steps": sum(r["num_steps"] for r in results),
        "num_drafts": c.get("num_drafts", 0),
        "num_draft_tokens": c.get("num_draft_tokens", 0),
        "num_accepted_tokens": c.get("num_accepted_tokens", 0),
        "num_grammar_tokens": sum(r["grammar_tokens"] for r in results),
        "accepted_per_pos": timers.accepted_per_pos,
        "num_asks": timers.num_asks,
        "num_allowed_tokens": timers.num_allowed_tokens,
        "drafted_per_pos": drafted,
        "reached_per_pos": reached,
        "propose_s": timers.propose_s,
        "forward_s": timers.forward_s,
        "tpot_s_sum": float(np.sum(tpots)) if tpots else 0.0,
        "tpot_count": len(tpots),
        "token_ids": {r["prompt_id"]: r["token_ids"] for r in results},
    }


def _per_pos(drafts: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """From (draft length, accepted) per verify step: [i] = drafts longer than i, and of those
    the ones whose first i tokens were all accepted (so position i was actually put to the test)."""
    width = max((n for n, _ in drafts), default=0)
    drafted, reached = [0] * width, [0] * width
    for n, a in drafts:
        for i in range(n):
            drafted[i] += 1
            reached[i] += a >= i
    return drafted, reached
