"""`mtp`: DeepSeek-V3-style multi-token-prediction modules, optionally topped up by ngram lookup.

FastDeploy's semantics: `num_model_steps` (<= num_speculative_tokens) tokens come from the MTP
modules (the last module is reused when there are fewer modules than steps); with
`"mtp_strategy": "with_ngram"` prompt lookup then appends drafts after them, continuing from the
context plus the MTP drafts, up to this step's draft cap.

`"mtp_strategy": "ngram_first"` turns the order round per request and step: where prompt lookup
finds a continuation (the output is copying its context, as in code edits), its drafts are used;
elsewhere the MTP modules draft (topped up by lookup, as with `with_ngram`). Lookup matches are
accepted far more often than a head's guesses on copied text, so copied text keeps the lookup's
long accepted runs that `with_ngram` loses to a wrong first MTP draft (measured: level with ngram
alone on open chat and JSON, 6-9% behind it on code edits). The engine's draft-length controller sees one acceptance rate
per request, so in this mode the proposer also tracks how often each request's first MTP draft
passes (`ModelGate`) and drafts from the modules only while that pays; otherwise a weak head
would pull the rate down and cost the request its lookup drafts too.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
import numpy as np

from proposers.base import DraftRequest
from proposers.heads.common import HeadOptions
from proposers.heads.feature_head import FeatureHeadProposer
from proposers.ngram import NgramProposer


GATE_MIN_ACCEPT = 0.4  # first-draft pass rate from which a model draft pays (a 2-token verify ~ 1.3 plain steps)
GATE_PROBE_EVERY = 16  # asks: while below, still draft from the model this often, to notice recovery


class ModelGate:
    """Per request: a running rate of first MTP drafts that passed, and whether to draft from the model."""

    def __init__(self):
        self.rate: dict[str, float] = {}
        self.waited: dict[str, int] = {}
        self.pending: dict[str, int] = {}  # the first model draft of this step, until its outcome is known

    def allows(self, request_id: str) -> bool:
        if self.rate.get(request_id, 0.5) >= GATE_MIN_ACCEPT:
            return True
        self.waited[request_id] = self.waited.get(request_id, 0) + 1
        return self.waited[request_id] >= GATE_PROBE_EVERY

    def drafted(self, request_id: str, first_token: int) -> None:
        self.pending[request_id], self.waited[request_id] = first_token, 0

    def taken(self, request_id: str, token_ids) -> None:
        """The step's emitted tokens: the first equals the first draft exactly when that draft passed."""
        first = self.pending.pop(request_id, None)
        if first is not None and len(token_ids):
            self.rate[request_id] = 0.7 * self.rate.get(request_id, 0.5) + 0.3 * (int(token_ids[0]) == first)

    def forget(self, request_id: str) -> None:
        for table in (self.rate, self.waited, self.pending):
            table.pop(request_id, None)


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
        self.gate = ModelGate()

    def extend_request(self, request_id, accepted_token_ids) -> None:
        super().extend_request(request_id, accepted_token_ids)
        self.gate.taken(request_id, accepted_token_ids)

    def stop_request(self, request_id) -> None:
        super().stop_request(request_id)
        self.gate.forget(request_id)

    def model_steps(self, ask: DraftRequest) -> int:
        return min(ask.max_draft_tokens, self.num_model_steps)

    def draft(self, asks):
        if self.options.mtp_strategy != "ngram_first":
            return self._model_then_lookup(asks)
        looked = self.ngram.propose(asks).token_ids
        to_model = [a for a, e in zip(asks, looked) if len(e) == 0 and self.gate.allows(a.request_id)]
        from_model = dict(zip((a.request_id for a in to_model), self._model_then_lookup(to_model)))
        out = []
        for a, e in zip(asks, looked):
            if len(e):  # a looked-up draft is certain (q = None means one-hot, as for the ngram proposer)
                out.append((e.astype(np.int32), None))
            elif a.request_id in from_model:
                out.append(from_model[a.request_id])
                if len(out[-1][0]):
                    self.gate.drafted(a.request_id, int(out[-1][0][0]))
            else:
                out.append((np.zeros(0, np.int32), None))
        return out

    def _model_then_lookup(self, asks):
        if not asks:
            return []
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
