"""How many draft tokens a request may take this step.

Three limits, smallest wins:
- the request's own cap (`num_speculative_tokens` in the request; 0 = off) and the server's K;
- a per-step draft-token budget shared by the batch (FastDeploy-style), so speculation
  backs off under load instead of slowing everyone down;
- an acceptance-aware choice: with per-token acceptance rate a, a chain of k drafts
  yields E[tokens] = (1 - a^(k+1)) / (1 - a) per verify of k+1 tokens whose cost,
  relative to a plain decode, is cost(k+1) from the runner's measured verify curve.
  We pick the k that maximises E[tokens] / cost(k+1); at low acceptance that is k = 0,
  which is plain decoding.
"""

from __future__ import annotations

import numpy as np

PROBE_EVERY = 8  # steps


def expected_tokens(alpha: float, k: int) -> float:
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


class DraftController:
    def __init__(self, max_k: int, step_budget: int, verify_cost: np.ndarray | None = None):
        self.max_k = max_k
        self.step_budget = step_budget  # 0 = unlimited
        # verify_cost[T] = time of a forward with T tokens / time with 1 token (T = 1..max_k + 1)
        if verify_cost is None:
            verify_cost = np.ones(max_k + 2)
        self.verify_cost = verify_cost
        self.left = step_budget

    def start_step(self) -> None:
        self.left = self.step_budget

    def best_k(self, alpha: float, cap: int) -> int:
        cap = min(cap, self.max_k, len(self.verify_cost) - 2)
        rates = [expected_tokens(alpha, k) / self.verify_cost[k + 1] for k in range(cap + 1)]
        return int(np.argmax(rates))

    def room(self, requested_cap: int | None, seq, remaining_tokens: int) -> int:
        cap = self.max_k if requested_cap is None else min(requested_cap, self.max_k)
        cap = min(cap, remaining_tokens - 1)
        if cap <= 0:
            return 0
        k = self.best_k(seq.acceptance_ema, cap)
        if k == 0 and seq.steps_without_drafts >= PROBE_EVERY:
            k = 1  # probe now and then, so a request whose acceptance recovers gets drafts again
        if self.step_budget:
            k = min(k, self.left)
            self.left -= k
        return max(k, 0)
