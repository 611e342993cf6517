"""`naive`: the speculative code path with zero drafts.

Every step still goes through propose -> verify -> accept, but verify sees one row per request
and emits exactly what decoding without speculation would (the bonus token). Useful to measure
the cost of the speculative machinery itself and to check it changes no outputs.
"""

from __future__ import annotations

from typing import ClassVar

from proposers.base import DraftRequest, Drafts, Proposer


class NaiveProposer(Proposer):
    default_num_speculative_tokens: ClassVar[int] = 0

    def propose(self, requests: list[DraftRequest]) -> Drafts:
        return Drafts.empty(len(requests))
