"""Measure one benchmark block on a live engine without editing it: timers and counter diffs.

`instrument(engine)` wraps `engine.proposer.propose` and `engine.runner.forward` in timing
shims (instance attributes, removed on exit) and diffs the engine's speculation counters
(`totals`, `accepted_per_pos`) across the block, so the engine's own bookkeeping is the
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
    counters: dict = field(default_factory=dict)  # engine.totals diff
    accepted_per_pos: list[int] = field(default_factory=list)  # [K] diff


def _timed(fn, timers: BlockTimers, kind: str):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            setattr(timers, f"{kind}_s", getattr(timers, f"{kind}_s") + time.perf_counter() - start)
            if kind == "propose":
                timers.num_propose_calls += 1
            else:
                timers.num_forwards += 1

    return wrapper


@contextmanager
def instrument(engine):
    timers = BlockTimers()
    totals_before = dict(engine.totals)
    per_pos_before = engine.accepted_per_pos.copy()
    proposer, runner = engine.proposer, engine.runner
    if proposer is not None:
        proposer.propose = _timed(proposer.propose, timers, "propose")
    runner.forward = _timed(runner.forward, timers, "forward")
    try:
        yield timers
    finally:
        if proposer is not None:
            del proposer.propose  # the class's method shows through again
        del runner.forward
        timers.counters = {k: engine.totals[k] - totals_before.get(k, 0) for k in engine.totals}
        timers.accepted_per_pos = (engine.accepted_per_pos - per_pos_before).tolist()


def reset_proposer(engine) -> None:
    """A fresh proposer of the same class and config: no state carried over from earlier blocks."""
    if engine.proposer is None:
        return
    if engine.has_unfinished():
        raise ValueError("engines: cannot reset the proposer of an engine with running requests")
    engine.proposer = type(engine.proposer)(engine.spec, engine.runner.config.vocab_size)


def block_raw(results: list[dict], wall_s: float, timers: BlockTimers) -> dict:
    """Raw sums of one block; every reported metric is derived from these (so they add up)."""
    tpots = [(r["done_s"] - r["first_s"]) / (len(r["token_ids"]) - 1)
             for r in results if len(r["token_ids"]) > 1 and r["done_s"] is not None]
    c = timers.counters
    return {
        "num_prompts": len(results),
        "output_tokens": sum(len(r["token_ids"]) for r in results),
        "wall_s": wall_s,
        "engine_steps": timers.num_forwards,
        "request_steps": sum(r["num_steps"] for r in results),
        "num_drafts": c.get("num_drafts", 0),
        "num_draft_tokens": c.get("num_draft_tokens", 0),
        "num_accepted_tokens": c.get("num_accepted_tokens", 0),
        "accepted_per_pos": timers.accepted_per_pos,
        "propose_s": timers.propose_s,
        "forward_s": timers.forward_s,
        "tpot_s_sum": float(np.sum(tpots)) if tpots else 0.0,
        "tpot_count": len(tpots),
        "token_ids": {r["prompt_id"]: r["token_ids"] for r in results},
    }
