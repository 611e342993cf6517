"""`mtp`: DeepSeek-V3-style multi-token-prediction modules, optionally topped up by ngram lookup.

FastDeploy's semantics: `num_model_steps` (<= num_speculative_tokens) tokens come from the MTP
modules (the last module is reused when there are fewer modules than steps); with
`"mtp_strategy": "with_ngram"` prompt lookup then appends drafts after them, continuing from the
context plus the MTP drafts, up to this step's draft cap.

`"mtp_strategy": "ngram_first"` turns the order round per request and step: where prompt lookup
finds a continuation (the output is copying its context, as in code edits), its drafts are used;
elsewhere the MTP modules draft (topped up by lookup, as with `with_ngram`). Lookup matches are
accepted far more often than a head's guesses on copied text, so copied text keeps the lookup's
long accepted runs that `with_ngram` loses to a wrong first MTP draft.

Both hybrids have two draft sources, "mtp" (the modules, with any lookup top-up) and "ngram" (a
lookup alone). The engine's controller keeps each one's acceptance and cost per request and caps
each separately (`DraftRequest.caps`): where the modules do not pay for themselves their cap is 0
and the request drafts by lookup alone, so a weak head never costs the request its lookup drafts.
With `"adaptive": false` every cap is K and `with_ngram` is exactly FastDeploy's order.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Annotated, Literal

import msgspec
import numpy as np

from proposers.base import DraftRequest, Drafts
from proposers.heads.common import HeadOptions
from proposers.heads.feature_head import FeatureHeadProposer
from proposers.ngram import NgramProposer


class MtpOptions(HeadOptions, forbid_unknown_fields=True):
    num_model_steps: Annotated[int, msgspec.Meta(ge=1, le=16)] | None = None  # default: num_speculative_tokens
    mtp_strategy: Literal["default", "with_ngram", "ngram_first"] = "default"


class MtpProposer(FeatureHeadProposer):
    head_kind = "mtp"
    normed_inputs = True
    Options = MtpOptions

    def __init__(self, config, vocab_size: int):
        super().__init__(config, vocab_size)
        k = config.num_speculative_tokens
        steps = self.options.num_model_steps or k
        if steps > k:
            raise ValueError(f"speculative_config.num_model_steps: {steps} exceeds num_speculative_tokens ({k})")
        self.num_model_steps = steps
        self.ngram = NgramProposer(config.__class__(method="ngram", num_speculative_tokens=k), vocab_size) \
            if self.options.mtp_strategy != "default" else None

    @property
    def draft_sources(self) -> tuple[str, ...]:
        return ("mtp",) if self.ngram is None else ("ngram", "mtp")

    def model_steps(self, ask: DraftRequest) -> int:
        return min(ask.max_draft_tokens, self.num_model_steps)

    def propose(self, requests: list[DraftRequest]) -> Drafts:
        """Per request, the first source in the strategy's order that drafts anything within its cap."""
        if self.ngram is None:
            return super().propose(requests)
        order = ("mtp", "ngram") if self.options.mtp_strategy == "with_ngram" else ("ngram", "mtp")
        n = len(requests)
        out = Drafts([np.zeros(0, np.int32)] * n, [None] * n, [None] * n, {})
        for source in order:
            asks = [i for i in range(n) if out.sources[i] is None and requests[i].cap(source) > 0]
            start = time.perf_counter()
            got = self._propose_from(source, [replace(requests[i], max_draft_tokens=requests[i].cap(source))
                                              for i in asks])
            charged = self.charged_fraction if source == "mtp" else 1.0  # the modules' catch-up is not charged
            out.seconds[source] = (time.perf_counter() - start) * charged
            for j, i in enumerate(asks):
                if len(got.token_ids[j]):
                    out.token_ids[i] = got.token_ids[j].astype(np.int32)
                    out.probs[i] = got.probs[j] if got.probs else None  # None: looked up, one-hot
                    out.sources[i] = source
        return out

    def _propose_from(self, source: str, asks: list[DraftRequest]) -> Drafts:
        if source == "ngram":
            return self.ngram.propose(asks)
        return super().propose(asks)  # the modules, topped up by lookup (`draft`)

    def draft(self, asks):
        """The modules' drafts, topped up by lookup unless the strategy is "default"."""
        out = super().draft(asks)
        if self.ngram is None:
            return out
        more = [DraftRequest(a.request_id, np.concatenate([a.token_ids, t]), a.num_prompt_tokens,
                             a.max_draft_tokens - len(t), a.temperature) for a, (t, _) in zip(asks, out)]
        extra = self.ngram.propose(more).token_ids
        return [self._join(t, q, e) for (t, q), e in zip(out, extra)]

    def _join(self, tokens: np.ndarray, q: np.ndarray | None, extra: np.ndarray):
        if len(extra) == 0:
            return tokens, q
        if q is not None:  # a looked-up token is drafted with certainty: q = one-hot
            one_hot = np.zeros((len(extra), self.vocab_size), np.float32)
            one_hot[np.arange(len(extra)), extra] = 1.0
            q = np.concatenate([q, one_hot])
        return np.concatenate([tokens, extra.astype(np.int32)]), q
