"""`ngram`: prompt lookup. Draft what followed the latest earlier occurrence of the context's tail.

For each request the key is the last n tokens of prompt + output, for n from `max_ngram_size` down
to `min_ngram_size` (longest first: a longer key pins down the context better). The draft is the
tokens that followed the match, up to this step's `max_draft_tokens`.

Choices, and why:
- Defaults 5 / 2. A 1-token key matches almost everywhere and drafts noise, and every rejected
  draft still costs verify compute (on our 2-core CPU a T=8 forward costs about 4x a T=1 one), so the
  shortest key is 2, as in FastDeploy's hybrid matcher and HF's default. Keys longer than 5 rarely
  change which continuation wins; vLLM and FastDeploy also stop at 5.
- The MOST RECENT occurrence wins among equally long matches (vLLM, FastDeploy and HF pick the
  earliest). In edited or repeated text (code revisions, lists, a chat history quoting itself) the
  latest copy reflects the current state of the text; llama.cpp's ngram-simple and SGLang's BFS
  mode also prefer recency. It also lets the scan stop at the first full-length match.
- When the continuation runs into the end of the context, the copy goes on through the drafts
  themselves (LZ77-style overlapping copy): a match at distance d means "the text repeats with
  period d", so a loop of period 3 drafts a full K tokens instead of 3. This is what the earliest
  occurrence would give in periodic text, without its staleness elsewhere.

The search is one Numba call over the whole batch (a flat token buffer with `cu_` offsets); one
backward pass per request finds the longest match length for every end position, so the cost is
O(num_tokens) per request with an early exit, independent of the number of key sizes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar

import msgspec
import numpy as np
from numba import njit

from proposers.base import DraftRequest, Drafts, Proposer

_DEFAULT_MIN, _DEFAULT_MAX = 2, 5


class NgramOptions(msgspec.Struct, forbid_unknown_fields=True):
    max_ngram_size: Annotated[int, msgspec.Meta(ge=1, le=64)] = _DEFAULT_MAX
    min_ngram_size: Annotated[int, msgspec.Meta(ge=1, le=64)] = _DEFAULT_MIN

    def __post_init__(self):
        if self.min_ngram_size > self.max_ngram_size:
            raise ValueError(
                f"min_ngram_size ({self.min_ngram_size}) must be <= max_ngram_size ({self.max_ngram_size})"
            )


@njit(cache=True)
def ngram_propose_one(token_ids, min_n, max_n, max_drafts, out_draft_ids):
    """Draft into out_draft_ids[:k] for one context [num_tokens]; returns k (0 = no match)."""
    num_tokens = token_ids.shape[0]
    if max_drafts <= 0 or num_tokens <= min_n:
        return 0
    last = token_ids[num_tokens - 1]
    best_len = 0
    best_end = -1
    # e = end of an earlier occurrence; match length = common suffix of tokens[:e+1] and tokens.
    for e in range(num_tokens - 2, -1, -1):
        if token_ids[e] != last:
            continue
        limit = min(max_n, e + 1)
        m = 1
        while m < limit and token_ids[e - m] == token_ids[num_tokens - 1 - m]:
            m += 1
        if m > best_len:  # strict: among equal lengths the latest (first seen) occurrence stays
            best_len = m
            best_end = e
            if m == max_n:
                break
    if best_len < min_n:
        return 0
    start = best_end + 1
    for j in range(max_drafts):
        src = start + j
        # Past the context's end, keep copying from the drafts: src - num_tokens < j.
        out_draft_ids[j] = token_ids[src] if src < num_tokens else out_draft_ids[src - num_tokens]
    return max_drafts


@njit(cache=True)
def ngram_propose_batch(
    token_ids,  # [total_tokens] int32: every request's context, back to back
    cu_num_tokens,  # [num_reqs + 1] int64
    max_drafts,  # [num_reqs] int32
    min_n,
    max_n,
    out_draft_ids,  # [num_reqs, >= max(max_drafts)] int32
    out_num_drafts,  # [num_reqs] int32
):
    # Serial on purpose: ~5 us per 8k-token context, less than waking a thread pool costs (and
    # a parallel region stalls for milliseconds when another process holds a core).
    for i in range(max_drafts.shape[0]):
        context = token_ids[cu_num_tokens[i]:cu_num_tokens[i + 1]]
        out_num_drafts[i] = ngram_propose_one(context, min_n, max_n, max_drafts[i], out_draft_ids[i])


class NgramProposer(Proposer):
    """Prompt-lookup drafts; stateless apart from reusable buffers."""

    Options: ClassVar[type[msgspec.Struct]] = NgramOptions
    option_aliases: ClassVar[Mapping[str, str]] = {
        "prompt_lookup_max": "max_ngram_size",  # vLLM's names
        "prompt_lookup_min": "min_ngram_size",
    }

    def __init__(self, config, vocab_size: int):
        super().__init__(config, vocab_size)
        self._token_buf = np.empty(1 << 16, dtype=np.int32)
        # Compile (or load from the cache) now, not on the first request.
        ngram_propose_batch(np.array([1, 2, 1, 2], np.int32), np.array([0, 4]), np.array([1], np.int32),
                            1, 2, np.empty((1, 1), np.int32), np.empty(1, np.int32))
        ngram_propose_one(np.array([1, 2, 1, 2], np.int32), 1, 2, 1, np.empty(1, np.int32))

    @classmethod
    def parse_options(cls, options: Mapping[str, Any]) -> msgspec.Struct:
        canonical = cls._resolve_aliases(options)
        # As in vLLM, one bound given alone drags the other's default along instead of failing.
        if "max_ngram_size" in canonical and "min_ngram_size" not in canonical:
            value = canonical["max_ngram_size"]
            if isinstance(value, int) and not isinstance(value, bool):
                canonical["min_ngram_size"] = min(_DEFAULT_MIN, value)
        if "min_ngram_size" in canonical and "max_ngram_size" not in canonical:
            value = canonical["min_ngram_size"]
            if isinstance(value, int) and not isinstance(value, bool):
                canonical["max_ngram_size"] = max(_DEFAULT_MAX, value)
        return super().parse_options(canonical)

    def propose(self, requests: list[DraftRequest]) -> Drafts:
        num_reqs = len(requests)
        if num_reqs == 1:  # one request: one compiled call, none of the batch's arrays to build
            r, opts = requests[0], self.options
            out = np.empty(max(r.max_draft_tokens, 0), np.int32)
            n = ngram_propose_one(r.token_ids, opts.min_ngram_size, opts.max_ngram_size, r.max_draft_tokens, out)
            return Drafts(token_ids=[out[:n]])
        max_drafts = np.array([r.max_draft_tokens for r in requests], dtype=np.int32)
        if num_reqs == 0 or max_drafts.max() <= 0:
            return Drafts.empty(num_reqs)
        cu_num_tokens = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum([r.token_ids.shape[0] for r in requests], out=cu_num_tokens[1:])
        if cu_num_tokens[-1] > self._token_buf.shape[0]:
            self._token_buf = np.empty(int(cu_num_tokens[-1]) * 2, dtype=np.int32)
        token_ids = self._token_buf[: cu_num_tokens[-1]]
        for i, r in enumerate(requests):
            token_ids[cu_num_tokens[i]: cu_num_tokens[i + 1]] = r.token_ids
        out_draft_ids = np.empty((num_reqs, int(max_drafts.max())), dtype=np.int32)
        out_num_drafts = np.empty(num_reqs, dtype=np.int32)
        opts = self.options
        ngram_propose_batch(token_ids, cu_num_tokens, max_drafts, opts.min_ngram_size,
                            opts.max_ngram_size, out_draft_ids, out_num_drafts)
        return Drafts(token_ids=[out_draft_ids[i, : out_num_drafts[i]] for i in range(num_reqs)])
