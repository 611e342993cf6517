"""A periodic one-line summary of speculation, like vLLM's SpecDecodingLogging."""

from __future__ import annotations

import logging
import time

import numpy as np

log = logging.getLogger("speculant.spec")


class SpecLogger:
    def __init__(self, interval_s: float = 10.0):
        self.interval_s = interval_s
        self.last_time = time.monotonic()
        self.last_totals = (0, 0, 0)
        self.last_per_pos: np.ndarray | None = None

    def maybe_log(self, totals: dict, accepted_per_pos: np.ndarray) -> None:
        now = time.monotonic()
        if now - self.last_time < self.interval_s:
            return
        drafts, draft_tokens, accepted = (
            totals["num_drafts"], totals["num_draft_tokens"], totals["num_accepted_tokens"])
        d_drafts = drafts - self.last_totals[0]
        d_tokens = draft_tokens - self.last_totals[1]
        d_acc = accepted - self.last_totals[2]
        prev = self.last_per_pos if self.last_per_pos is not None else np.zeros_like(accepted_per_pos)
        self.last_time, self.last_totals, self.last_per_pos = now, (drafts, draft_tokens, accepted), accepted_per_pos.copy()
        if d_drafts == 0:
            return
        per_pos = (accepted_per_pos - prev) / d_drafts
        log.info(
            "SpecDecoding metrics: mean acceptance length %.2f, draft acceptance rate %.1f%%, "
            "drafts %d, draft tokens %d, accepted %d, per-position acceptance rate %s",
            1 + d_acc / d_drafts, 100 * d_acc / max(d_tokens, 1), d_drafts, d_tokens, d_acc,
            np.round(per_pos, 3).tolist(),
        )
