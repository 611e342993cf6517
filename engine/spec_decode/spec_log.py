"""The worker's speculation counters, and a periodic one-line summary of them like vLLM's SpecDecodingLogging."""

from __future__ import annotations

import logging
import time

import numpy as np

log = logging.getLogger("speculant.spec")


class SpecTotals:
    """Counts since the worker started (their one owner): steps that verified drafts, draft tokens, accepted
    drafts, accepted drafts a grammar forced, and how often each draft position passed."""

    def __init__(self, num_speculative_tokens: int):
        self.counts = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "num_grammar_tokens": 0}
        # [K]; a list: a NumPy slice update costs ~30 us a step more with the caches cold after a forward
        self._per_pos = [0] * max(num_speculative_tokens, 1)

    @property
    def accepted_per_pos(self) -> np.ndarray:
        """[K] int64: how often each draft position passed (a copy)."""
        return np.array(self._per_pos, np.int64)

    def record(self, seq, num_drafts: int, num_accepted: int) -> None:
        """A verified step of `seq` with drafts; also counted on the request."""
        seq.num_drafts += 1
        seq.num_draft_tokens += num_drafts
        seq.num_accepted_tokens += num_accepted
        self.counts["num_drafts"] += 1
        self.counts["num_draft_tokens"] += num_drafts
        self.counts["num_accepted_tokens"] += num_accepted
        per_pos = self._per_pos
        for j in range(min(num_accepted, len(per_pos))):  # grammar-forced runs may pass K
            per_pos[j] += 1

    def record_grammar(self, seq, num_forced_accepted: int) -> None:
        seq.num_grammar_tokens += num_forced_accepted
        self.counts["num_grammar_tokens"] += num_forced_accepted

    def fields(self) -> dict:
        """WorkerStats' speculation fields."""
        return {**self.counts, "accepted_per_pos": list(self._per_pos)}


class SpecLogger:
    def __init__(self, interval_s: float = 10.0):
        self.interval_s = interval_s
        self.last_time = time.monotonic()
        self.last_totals = (0, 0, 0)
        self.last_per_pos: np.ndarray | None = None

    def maybe_log(self, spec_totals: SpecTotals) -> None:
        now = time.monotonic()
        if now - self.last_time < self.interval_s:
            return
        totals, accepted_per_pos = spec_totals.counts, spec_totals.accepted_per_pos
        drafts, draft_tokens, accepted = (
            totals["num_drafts"], totals["num_draft_tokens"], totals["num_accepted_tokens"])
        d_drafts = drafts - self.last_totals[0]
        d_tokens = draft_tokens - self.last_totals[1]
        d_acc = accepted - self.last_totals[2]
        prev = self.last_per_pos if self.last_per_pos is not None else np.zeros_like(accepted_per_pos)
        self.last_time, self.last_totals, self.last_per_pos = now, (drafts, draft_tokens, accepted), accepted_per_pos
        if d_drafts == 0:
            return
        per_pos = (accepted_per_pos - prev) / d_drafts
        log.info(
            "SpecDecoding metrics: mean acceptance length %.2f, draft acceptance rate %.1f%%, "
            "drafts %d, draft tokens %d, accepted %d, per-position acceptance rate %s",
            1 + d_acc / d_drafts, 100 * d_acc / max(d_tokens, 1), d_drafts, d_tokens, d_acc,
            np.round(per_pos, 3).tolist(),
        )
