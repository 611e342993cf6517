"""`bigram`: draft the chain of most frequent successors from bigram counts over all requests."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import Annotated, ClassVar

import msgspec
import numpy as np

from proposers.base import DraftRequest, Drafts, Proposer


class BigramOptions(msgspec.Struct, forbid_unknown_fields=True):
    min_count: Annotated[int, msgspec.Meta(ge=1)] = 2  # successors seen fewer times are not drafted


class BigramProposer(Proposer):
    Options: ClassVar[type[msgspec.Struct]] = BigramOptions

    def __init__(self, config, vocab_size: int):
        super().__init__(config, vocab_size)
        self._next: defaultdict[int, Counter[int]] = defaultdict(Counter)  # token -> successor counts
        self._last: dict[str, int] = {}  # request id -> its last token

    def _count(self, request_id: str, token_ids: Sequence[int]) -> None:
        prev = self._last.get(request_id)
        for token in token_ids:
            if prev is not None:
                self._next[prev][int(token)] += 1
            prev = int(token)
        if prev is not None:
            self._last[request_id] = prev

    def start_request(self, request_id: str, prompt_token_ids: np.ndarray) -> None:
        self._count(request_id, prompt_token_ids.tolist())

    def extend_request(self, request_id: str, accepted_token_ids: Sequence[int]) -> None:
        self._count(request_id, accepted_token_ids)

    def stop_request(self, request_id: str) -> None:
        self._last.pop(request_id, None)

    def propose(self, requests: list[DraftRequest]) -> Drafts:
        drafts = []
        for request in requests:
            draft: list[int] = []
            token = int(request.token_ids[-1]) if request.token_ids.shape[0] else None
            while token is not None and len(draft) < request.max_draft_tokens:
                successors = self._next.get(token)
                if not successors:
                    break
                token, count = successors.most_common(1)[0]
                if count < self.options.min_count:
                    break
                draft.append(token)
            drafts.append(np.array(draft, dtype=np.int32))
        return Drafts(token_ids=drafts)
