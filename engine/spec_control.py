"""How many draft tokens a request may take this step.

Three limits, smallest wins:
- the request's own cap (`num_speculative_tokens` in the request; 0 = off) and the server's K;
- a per-step draft-token budget shared by the batch (FastDeploy-style), so speculation
  backs off under load instead of slowing everyone down;
- an acceptance-aware choice. Model-free drafts are accepted in runs: once the first
  draft token passes, the next ones almost always do. With a1 = P(first draft accepted)
  and c = P(next accepted | previous accepted), a chain of k drafts yields
  E[tokens] = 1 + a1 (1 - c^k) / (1 - c) per verify of k+1 tokens, whose cost relative to
  a plain decode is cost(k+1) from the runner's measured verify curve. We pick the k
  that maximises E[tokens] / (cost(k+1) + k * d), where d is the proposer's measured time per
  draft token relative to a plain decode (about 0 for lookups, a real share for a draft model or
  head); at low acceptance that is k = 0, plain decoding.

While k = 0 a request probes with one draft token every PROBE_EVERY steps, so it notices when
acceptance recovers. A probe that does not bring drafting back doubles the wait before the
next one (up to PROBE_MAX steps): on text a proposer cannot predict, probing then costs a
fraction of a percent instead of a verify of two tokens every few steps.
"""

from __future__ import annotations

import numpy as np

PROBE_EVERY = 8  # steps
PROBE_MAX = 128  # steps


def expected_tokens(first: float, cont: float, k: int) -> float:
    if k == 0:
        return 1.0
    if cont >= 1.0:
        return 1.0 + first * k
    return 1.0 + first * (1.0 - cont**k) / (1.0 - cont)


class DraftController:
    def __init__(self, max_k: int, step_budget: int, verify_cost: np.ndarray | None = None, t1_seconds: float = 0.0,
                 adaptive: bool = True):
        self.max_k = max_k
        self.step_budget = step_budget  # 0 = unlimited
        # verify_cost[T] = time of a forward with T tokens / time with 1 token (T = 1..max_k + 1)
        if verify_cost is None:
            verify_cost = np.ones(max_k + 2)
        self.verify_cost = verify_cost
        self.left = step_budget
        self.adaptive = adaptive
        self.t1_seconds = t1_seconds  # a plain decode forward, the unit of cost
        self.draft_cost = 0.0  # EMA of one draft token's proposer time, in units of t1

    def note_draft_time(self, seconds: float, num_draft_tokens: int) -> None:
        if num_draft_tokens > 0 and self.t1_seconds > 0:
            cost = seconds / num_draft_tokens / self.t1_seconds
            self.draft_cost = 0.8 * self.draft_cost + 0.2 * cost if self.draft_cost else cost

    def start_step(self) -> None:
        self.left = self.step_budget

    def best_k(self, first: float, cont: float, cap: int) -> int:
        cap = min(cap, self.max_k, len(self.verify_cost) - 2)
        rates = [expected_tokens(first, cont, k) / (self.verify_cost[k + 1] + k * self.draft_cost)
                 for k in range(cap + 1)]
        return int(np.argmax(rates))

    def room(self, requested_cap: int | None, seq, remaining_tokens: int) -> int:
        cap = self.max_k if requested_cap is None else min(requested_cap, self.max_k)
        cap = min(cap, remaining_tokens - 1)
        if cap <= 0:
            return 0
        k = self.best_k(seq.first_accept_ema, seq.cont_accept_ema, cap) if self.adaptive else cap
        if k > 0:
            seq.probe_interval = 0
        elif seq.steps_without_drafts >= (seq.probe_interval or PROBE_EVERY):
            k = 1  # probe now and then, so a request whose acceptance recovers gets drafts again
            seq.probe_interval = min(2 * (seq.probe_interval or PROBE_EVERY), PROBE_MAX)
        if self.step_budget:
            k = min(k, self.left)
            self.left -= k
        return max(k, 0)
