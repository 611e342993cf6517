"""Constrained decoding with llguidance: one matcher per request under a grammar, masks in verification.

A request's grammar (SamplingParams.grammar, an llguidance grammar the gateway built and validated)
becomes an `LLMatcher` over the model's tokenizer; compiled matchers are kept by the grammar's hash
and copied per request, so a schema is compiled once.

Per step, for the requests under a grammar:
  draft    where the grammar allows exactly one continuation, its tokens (`compute_ff_tokens`) are
           the drafts: they cost no proposer call. Otherwise the proposer's drafts are cut at the
           first token the grammar forbids (it would be rejected anyway, and costs a verify row) --
           except that a draft with a real draft distribution q, sampled at temperature > 0, keeps
           that forbidden token: rejecting it against the masked target takes the residual
           max(0, p - q), which is what keeps sampling lossless (cutting it would sample p instead).
  verify   row j of a request is masked by the grammar state after its tokens plus drafts 0..j-1
           (one batched llguidance call for the whole step); forbidden tokens get -inf, so greedy
           verification takes the masked argmax and rejection sampling uses the masked,
           renormalised target distribution: the output is that of plain constrained decoding.
  accept   the matcher advances over the emitted tokens only (drafts were never consumed).
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict

import numpy as np

from engine.errors import InvalidRequest

_CACHE_SIZE = 64  # compiled grammars kept
GRAMMAR_SOURCE = "grammar"  # the draft source of grammar-forced tokens


class Grammars:
    """The matchers of the requests under a grammar; `tokenizer` is the engine's Tokenizer."""

    def __init__(self, tokenizer, vocab_size: int):
        self._tokenizer, self._vocab_size = tokenizer, vocab_size
        self._stop_ids = sorted(tokenizer.stop_token_ids)  # what ends a complete grammar
        self._ll_tokenizer = None
        self._executor = None
        self._compiled: OrderedDict[str, object] = OrderedDict()
        self.matchers: dict[str, object] = {}
        self._valid: dict[str, int] = {}  # this step: request -> drafts the grammar allows, where one is not
        self._bitmask = np.zeros((0, (vocab_size + 31) // 32), np.int32)
        self.mask_seconds = 0.0  # time spent computing and applying masks, and rows masked
        self.masked_rows = 0

    def _ll(self):
        if self._ll_tokenizer is None:
            import llguidance

            self._ll_tokenizer = llguidance.LLTokenizer(self._tokenizer.backend_json(), n_vocab=self._vocab_size,
                                                        eos_token=self._stop_ids)
            self._executor = llguidance.LLExecutor(num_threads=1)
        return self._ll_tokenizer

    def start(self, request_id: str, grammar: str) -> None:
        """A matcher for the request; InvalidRequest (param response_format) if the grammar does not compile."""
        import llguidance

        key = hashlib.sha256(grammar.encode()).hexdigest()
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = llguidance.LLMatcher(self._ll(), grammar, log_level=0)
            if compiled.is_error():
                raise InvalidRequest(f"response_format: the grammar does not compile: {compiled.get_error()}",
                                     "response_format")
            self._compiled[key] = compiled
            if len(self._compiled) > _CACHE_SIZE:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(key)
        self.matchers[request_id] = compiled.deep_copy()

    def stop(self, request_id: str) -> None:
        self.matchers.pop(request_id, None)
        self._valid.pop(request_id, None)

    def forced(self, request_id: str, limit: int) -> list[int]:
        """Up to `limit` tokens the grammar forces next (empty where it allows a choice)."""
        m = self.matchers[request_id]
        return [] if limit <= 0 or m.is_stopped() else list(m.compute_ff_tokens())[:limit]

    def cut(self, request_id: str, tokens, keep_forbidden: bool) -> int:
        """How many of a proposer's drafts to verify: those the grammar accepts in a row, plus the first
        forbidden one when `keep_forbidden` (a draft with a real q, sampled: see the module docstring).
        A kept forbidden draft's row is left unmasked by `mask_rows` (it is never sampled from)."""
        m = self.matchers[request_id]
        n = m.try_consume_tokens([int(t) for t in tokens])
        if n:
            m.rollback(n)
        if n < len(tokens) and keep_forbidden:
            self._valid[request_id] = n
            return n + 1
        return n

    def mask_rows(self, logits: np.ndarray, runs: list[tuple[str, int, list[int]]]) -> None:
        """Mask logits rows in place: runs of (request, first row, drafts), rows first .. first + len(drafts)
        (the drafts come from `forced` or `cut`, so all but a kept forbidden last one are grammar-valid)."""
        if not runs:
            return
        import llguidance.numpy as lln

        t0 = time.perf_counter()
        num_rows = sum(1 + len(d) for _, _, d in runs)  # an upper bound
        if self._bitmask.shape[0] < num_rows:
            self._bitmask = np.zeros((num_rows, self._bitmask.shape[1]), np.int32)
        self._ll()
        plain, drafted, rows, k = [], [], [], 0  # llguidance takes runs with and without drafts apart
        for rid, first, drafts in runs:
            drafts = drafts[: self._valid.pop(rid, len(drafts))]
            if len(drafts):
                drafted.append((self.matchers[rid], k, [int(t) for t in drafts]))
            else:
                plain.append((self.matchers[rid], k))
            rows.extend(range(first, first + 1 + len(drafts)))
            k += 1 + len(drafts)
        bitmask = self._bitmask[:k]
        if plain:
            lln.fill_next_token_bitmask_par(self._executor, plain, bitmask)
        if drafted:
            lln.fill_next_token_bitmask_par_with_draft_tokens(self._executor, drafted, bitmask)
        apply_bitmask(logits, np.asarray(rows, np.int64), bitmask)
        self.mask_seconds += time.perf_counter() - t0
        self.masked_rows += k

    def advance(self, request_id: str, tokens) -> tuple[int, bool]:
        """Consume emitted tokens until the grammar completes: (tokens consumed, whether it is complete
        or in error, which ends the request)."""
        m, n = self.matchers[request_id], 0
        for t in tokens:
            if m.is_stopped() or m.is_error():
                break
            m.consume_token(int(t))
            n += 1
        return n, m.is_stopped() or m.is_error()


def apply_bitmask(logits: np.ndarray, rows: np.ndarray, bitmask: np.ndarray) -> None:
    """logits[rows[i], t] = -inf where bit t of bitmask[i] is 0 (llguidance's layout: 32 tokens per int32)."""
    vocab = logits.shape[1]
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab]  # [rows, vocab]
    sub = logits[rows]
    sub[bits == 0] = -np.inf
    logits[rows] = sub
