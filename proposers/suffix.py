"""`suffix`: SuffixDecoding (arXiv 2411.04975) in the spirit of arctic-inference.

Two count-annotated suffix tries (`proposers.suffix_tree`):
- a local one per running request, over its prompt and its response as it grows;
- a global one over the responses of finished requests, oldest evicted first once more than
  `suffix_decoding_max_cached_requests` are held (-1 = no limit, 0 = no global tree).
Each step, for every match length m of the context's suffix, follow the most frequent path from
the match: prob *= count(child) / count(node) per step, stopping when prob < min_token_prob or
the draft reaches min(max_draft_tokens, floor(m * max_spec_factor + max_spec_offset)). The draft
with the highest score (sum of probs) over match lengths and over the two trees wins; ties go to
the longer match, then to the local tree. Drafts are variable-length: confident paths run long,
and uncertain ones stop early, which matters when every verified token costs CPU time.

One deliberate difference from arctic: in the local tree the context's own occurrence (the live
end of the request) is not counted as evidence, so a phrase seen once before is followed with
probability 1, not 1/2.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Annotated, ClassVar

import msgspec
import numpy as np

from proposers.base import DraftRequest, Drafts, Proposer
from proposers.suffix_tree import SuffixDraft, SuffixTree

_SEQ = 0  # the only sequence id inside a request's local tree


class SuffixOptions(msgspec.Struct, forbid_unknown_fields=True):
    # Longest string kept in the tries; match length + draft length <= depth.
    suffix_decoding_max_tree_depth: Annotated[int, msgspec.Meta(ge=2, le=1024)] = 64
    # Responses kept in the global tree. Default 1000, not arctic's unbounded -1: in Python a
    # cached token costs ~0.3 KB of trie, so 1000 responses of ~500 tokens hold ~150 MB.
    suffix_decoding_max_cached_requests: Annotated[int, msgspec.Meta(ge=-1)] = 1000
    suffix_decoding_max_spec_factor: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    suffix_decoding_max_spec_offset: float = 0.0
    suffix_decoding_min_token_prob: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.1


class SuffixProposer(Proposer):
    Options: ClassVar[type[msgspec.Struct]] = SuffixOptions
    # Drafts are as long as the evidence allows, so K is only a ceiling; verify cost on a CPU
    # grows with T, so it stays well below the 24-32 that GPU servers use.
    default_num_speculative_tokens: ClassVar[int] = 8

    def __init__(self, config, vocab_size: int):
        super().__init__(config, vocab_size)
        opts = self.options
        self._depth = opts.suffix_decoding_max_tree_depth
        self._local: dict[str, SuffixTree] = {}  # request id -> prompt + response so far
        self._num_prompt: dict[str, int] = {}
        self._global = SuffixTree(self._depth)
        self._cached: deque[int] = deque()  # global sequence ids, oldest first
        self._next_cached_id = 0

    @property
    def num_cached_responses(self) -> int:
        return len(self._cached)

    def start_request(self, request_id: str, prompt_token_ids: np.ndarray) -> None:
        tree = SuffixTree(self._depth)
        tree.extend(_SEQ, np.asarray(prompt_token_ids).tolist())
        self._local[request_id] = tree
        self._num_prompt[request_id] = len(prompt_token_ids)

    def extend_request(self, request_id: str, accepted_token_ids: Sequence[int]) -> None:
        tree = self._local.get(request_id)
        if tree is not None:  # unknown ids are synced from token_ids at the next propose
            tree.extend(_SEQ, accepted_token_ids)

    def stop_request(self, request_id: str) -> None:
        tree = self._local.pop(request_id, None)
        num_prompt = self._num_prompt.pop(request_id, 0)
        if tree is None or tree.num_tokens(_SEQ) <= num_prompt:
            return
        max_cached = self.options.suffix_decoding_max_cached_requests
        if max_cached == 0:
            return
        response = tree.token_ids(_SEQ)[num_prompt:]
        seq_id = self._next_cached_id
        self._next_cached_id += 1
        self._global.extend(seq_id, response)
        self._global.close(seq_id)
        self._cached.append(seq_id)
        while 0 < max_cached < len(self._cached):
            self._global.remove(self._cached.popleft())

    def propose(self, requests: list[DraftRequest]) -> Drafts:
        drafts = []
        for request in requests:
            draft = self._propose_one(request) if request.max_draft_tokens > 0 else SuffixDraft()
            drafts.append(np.array(draft.token_ids, dtype=np.int32))
        return Drafts(token_ids=drafts)

    def _propose_one(self, request: DraftRequest) -> SuffixDraft:
        tree = self._sync(request)
        context = request.token_ids[-(self._depth - 1):].tolist()
        opts = self.options
        args = (request.max_draft_tokens, opts.suffix_decoding_max_spec_factor,
                opts.suffix_decoding_max_spec_offset, opts.suffix_decoding_min_token_prob)
        best = tree.speculate(context, *args, exclude_context=True)
        if self._cached:
            cached = self._global.speculate(context, *args)
            if cached.score > best.score:
                best = cached
        return best

    def _sync(self, request: DraftRequest) -> SuffixTree:
        """The request's local tree, caught up with token_ids if a hook was missed."""
        tree = self._local.get(request.request_id)
        num_tokens = request.token_ids.shape[0]
        if tree is not None and tree.num_tokens(_SEQ) > num_tokens:
            tree = None  # the engine rolled the request back: rebuild
        if tree is None:
            self.start_request(request.request_id, request.token_ids[: request.num_prompt_tokens])
            tree = self._local[request.request_id]
        if tree.num_tokens(_SEQ) < num_tokens:
            tree.extend(_SEQ, request.token_ids[tree.num_tokens(_SEQ):].tolist())
        return tree
