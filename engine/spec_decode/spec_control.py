"""How many draft tokens a request may take this step, per draft source.

Three limits, smallest wins:
- the request's own cap (`num_speculative_tokens` in the request; 0 = off) and the server's K;
- a per-step draft-token budget shared by the batch (FastDeploy-style), so speculation
  backs off under load instead of slowing everyone down;
- an acceptance-aware choice. Model-free drafts are accepted in runs: once the first
  draft token passes, the next ones almost always do. With a1 = P(first draft accepted)
  and c = P(next accepted | previous accepted), a chain of k drafts yields
  E[tokens] = 1 + a1 (1 - c^k) / (1 - c) per verify of k+1 tokens, whose cost relative to
  a plain decode is cost(k+1) from the runner's measured verify curve. We pick the k
  that maximises E[tokens] / (cost(k+1) + k * d), where d is the source's measured time per
  draft token relative to a plain decode (about 0 for lookups, a real share for a draft model or
  head); at low acceptance that is k = 0, plain decoding.

A proposer drafts from one or more *sources* (a hybrid has a lookup and a model). Acceptance
(a1, c) is kept per request and source, and draft cost per source, so a weak head cannot pull
down the lookup drafts of the same request, nor a free lookup hide the cost of a head. Each
source gets its own k; the request reserves the largest, and the proposer drafts from one source
within that source's k. A new request's estimates start from the source's acceptance over recent
requests (a slow EMA), not from a fixed guess, so a head that seldom pays on this server's traffic
does not spend every new request's first steps finding that out again. The choice of k blends the
two like a Beta posterior: the source's rate counts as PRIOR_STRENGTH outcomes, the request's own
as many as it has, decayed (it remembers ~5 drafting steps, and while the request does not draft,
its record fades, so the estimate relaxes to the source's rate). An eagle head's first draft passes
~40% of the time on open chat and pays from ~27%; with a short per-request EMA instead, three or
four misses in a row switched it off, and the probes backing off kept it off for most of the
answer: adaptive eagle made 1.13 tokens a step there, against 1.39 when drafting on every step
(now 1.385).

A source's draft cost is the median of its last COST_SAMPLES timed drafts: one slow draft (a kernel
compiled on first use, a page fault) is not what the next will cost. With a running mean instead, an
eagle head whose first drafts waited on compilation (kernels rebuilt after a source change) still
stood at 3.0 plain steps per draft token after its first request, against ~0.15 warm, and drafted
on 5 of that request's 125 steps: it drafts again only on probes, each moving the mean by a fifth.

While a source's k is 0 a request probes it with one draft token every PROBE_EVERY steps, so it
notices when acceptance recovers. A probe that does not bring drafting back doubles the wait
before the next one (up to PROBE_MAX steps): on text a source cannot predict, probing then costs
a fraction of a percent instead of a verify of two tokens every few steps.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

import numpy as np

PROBE_EVERY = 8  # steps
PROBE_MAX = 128  # steps
PRIOR_WEIGHT = 0.02  # per drafting step of any request, in the per-source estimate new requests start from
PRIOR_STRENGTH = 8.0  # the source's server-wide rate counts as this many of the request's outcomes
EVIDENCE_DECAY = 0.8  # per drafting step: a request's own estimate remembers ~5 outcomes
IDLE_DECAY = 0.8  # per step without drafting: its weight fades, so the estimate relaxes to the source's
COST_SAMPLES = 9  # timed drafts per source behind its draft cost (their median)


@dataclass(slots=True)
class SourceStats:
    """One request's running record of one draft source."""

    first: float = 0.5  # decayed mean of (first draft accepted) over the request's drafting steps
    cont: float = 0.8  # decayed mean of P(next draft accepted | previous accepted)
    weight: float = 0.0  # decayed count of the outcomes behind `first` (0: none yet)
    cont_weight: float = 0.0  # ... behind `cont`
    idle_steps: int = 0  # steps since this source last drafted for the request
    probe_interval: int = 0  # steps between probes while drafting does not pay (0: not backing off)
    probing: bool = False  # this step's k is a probe

    def record(self, num_drafts: int, num_accepted: int) -> None:
        """The outcome of a step in which this source drafted num_drafts tokens (0: it did not draft)."""
        if num_drafts == 0:
            self.idle_steps += 1
            self.weight *= IDLE_DECAY
            self.cont_weight *= IDLE_DECAY
        else:
            self.idle_steps = 0
            self.weight = EVIDENCE_DECAY * self.weight + 1.0
            self.first += ((num_accepted > 0) - self.first) / self.weight
            if num_accepted > 0 and num_drafts > 1:
                self.cont_weight = EVIDENCE_DECAY * self.cont_weight + 1.0
                self.cont += ((num_accepted - 1) / (num_drafts - 1) - self.cont) / self.cont_weight
            if self.probing:  # a probe that ran: wait longer before the next (reset once drafting pays)
                self.probe_interval = min(2 * (self.probe_interval or PROBE_EVERY), PROBE_MAX)
        self.probing = False


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
        self.verify_cost = np.ones(max_k + 2) if verify_cost is None else verify_cost
        self.left = step_budget
        self.adaptive = adaptive
        self.t1_seconds = t1_seconds  # a plain decode forward, the unit of cost
        self.draft_cost: dict[str, float] = {}  # source -> one draft token's time, in units of t1 (median of recent)
        self._cost_samples: dict[str, deque] = {}
        # source -> acceptance over all requests (a slow EMA): where a new request's estimate starts
        self.prior: dict[str, SourceStats] = {}

    @property
    def verify_cost(self) -> np.ndarray:
        return self._verify_cost

    @verify_cost.setter
    def verify_cost(self, curve) -> None:
        self._verify_cost = np.asarray(curve, np.float64)
        self._cost = self._verify_cost.tolist()  # best_k's copy: plain floats (see best_k)

    def note_draft_time(self, source: str, seconds: float, num_draft_tokens: int) -> None:
        if num_draft_tokens > 0 and self.t1_seconds > 0:
            samples = self._cost_samples.setdefault(source, deque(maxlen=COST_SAMPLES))
            samples.append(seconds / num_draft_tokens / self.t1_seconds)
            self.draft_cost[source] = statistics.median(samples)  # a few us; np.median costs ~30

    def record(self, stats: dict[str, SourceStats], source: str | None, num_drafts: int, num_accepted: int) -> None:
        """A request's step outcome: `source` drafted num_drafts tokens (None or 0 drafts: no source did)."""
        for name, st in stats.items():
            st.record(num_drafts if name == source else 0, num_accepted)
        if source is not None and num_drafts > 0:
            prior = self.prior.setdefault(source, SourceStats())
            prior.first = (1 - PRIOR_WEIGHT) * prior.first + PRIOR_WEIGHT * (num_accepted > 0)
            if num_accepted > 0 and num_drafts > 1:
                prior.cont = (1 - PRIOR_WEIGHT) * prior.cont + PRIOR_WEIGHT * (num_accepted - 1) / (num_drafts - 1)

    def start_step(self) -> None:
        self.left = self.step_budget

    def best_k(self, first: float, cont: float, cap: int, draft_cost: float = 0.0) -> int:
        """The k of the best rate (the smallest on a tie). Plain Python floats: it runs once per request and
        step with the caches cold after a forward, where np.argmax over the rates took ~100 us and this ~40."""
        cost = self._cost
        best, best_rate = 0, -1.0
        for k in range(min(cap, self.max_k, len(cost) - 2) + 1):
            rate = expected_tokens(first, cont, k) / (cost[k + 1] + k * draft_cost)
            if rate > best_rate:
                best, best_rate = k, rate
        return best

    def room(self, requested_cap: int | None, stats: dict[str, SourceStats], remaining_tokens: int,
             sources: tuple[str, ...]) -> dict[str, int]:
        """Draft tokens each source may give the request this step ({} or all 0: none)."""
        cap = self.max_k if requested_cap is None else min(requested_cap, self.max_k)
        cap = min(cap, remaining_tokens - 1)
        if cap <= 0:
            return {}
        for s in sources:
            if s not in stats:
                stats[s] = SourceStats()  # no outcomes yet: `estimate` is the source's rate
        caps = {s: self._source_k(s, stats[s], cap) for s in sources}
        if self.step_budget:
            k = min(max(caps.values()), self.left)
            self.left -= k
            caps = {s: min(c, k) for s, c in caps.items()}
        return caps

    def estimate(self, source: str, st: SourceStats) -> tuple[float, float]:
        """(first, cont) for the choice of k: the request's own outcomes shrunk toward the source's rate."""
        prior = self.prior.get(source) or SourceStats()
        n = PRIOR_STRENGTH
        first = (st.weight * st.first + n * prior.first) / (st.weight + n)
        cont = (st.cont_weight * st.cont + n * prior.cont) / (st.cont_weight + n)
        return first, cont

    def _source_k(self, source: str, st: SourceStats, cap: int) -> int:
        if not self.adaptive:
            return cap
        first, cont = self.estimate(source, st)
        k = self.best_k(first, cont, cap, self.draft_cost.get(source, 0.0))
        if k > 0:
            st.probe_interval = 0
            return k
        # probe now and then, so a source whose acceptance recovers gets to draft again
        st.probing = st.idle_steps >= (st.probe_interval or PROBE_EVERY)
        return int(st.probing)
