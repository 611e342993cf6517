"""Turn the tokens a step produced for a request into an `Output`: stops, text, logprobs.

A speculative step can produce several tokens at once. They are taken one at a
time so that EOS, stop token ids, stop strings, `max_tokens` and `max_model_len`
inside the step are honoured exactly: nothing after a stop leaks into the text,
the token counts, or the logprobs.
"""

from __future__ import annotations

import numpy as np

from engine.core.sequence import Sequence
from engine.model.detokenizer import IncrementalDetokenizer
from engine.serving.protocol import Output, TokenLogprob


class OutputState:
    """Per-request text state: detokenizer, generated text, how much of it was sent."""

    def __init__(self, tokenizer, seq: Sequence, max_model_len: int):
        self.tokenizer = tokenizer
        self.detok = IncrementalDetokenizer(tokenizer, list(seq.token_ids[: seq.num_prompt_tokens]),
                                            skip_special_tokens=seq.params.skip_special_tokens)
        self.text = ""
        self.num_sent_chars = 0
        self.stops = [s for s in seq.params.stop if s]
        self.max_stop_len = max((len(s) for s in self.stops), default=0)
        self.stop_ids = seq.params.stop_ids(tokenizer.stop_token_ids)
        self.max_model_len = max_model_len
        self.include_stop = seq.params.include_stop_str_in_output
        self.is_cut = False  # a stop string ended the text

    def _check_stop_string(self, start: int) -> bool:
        """Cut the text at the first stop string that ends after `start` (after it, with
        include_stop_str_in_output); True if one was found."""
        lo = max(0, start - self.max_stop_len + 1)
        hits = [(i, i + len(s)) for i, s in ((self.text.find(s, lo), s) for s in self.stops) if i >= 0]
        if not hits:
            return False
        start, end = min(hits, key=lambda h: (h[0], -h[1]))  # the first stop string to start; the longest there
        self.text = self.text[: end if self.include_stop else start]
        self.is_cut = True
        return True

    def add_tokens(self, seq: Sequence, token_ids) -> int:
        """Append tokens to the sequence until a stop; returns how many were taken."""
        params = seq.params
        for n, tok in enumerate(token_ids, start=1):
            tok = int(tok)
            seq.append(tok)
            if tok in self.stop_ids:
                seq.finish_reason = "stop"
                if self.include_stop and tok in params.stop_token_ids:
                    self.text += self.detok.push([tok])
                return n
            before = len(self.text)
            self.text += self.detok.push([tok])
            if self.stops and seq.num_output_tokens >= params.min_tokens and self._check_stop_string(before):
                seq.finish_reason = "stop"
                return n
            if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
                seq.finish_reason = "length"
                return n
        return len(token_ids)

    def take_text(self, is_finished: bool) -> str:
        """The text not yet sent; while running, hold back what could still become a stop string."""
        if is_finished and not self.is_cut:
            self.text += self.detok.flush()
        end = len(self.text)
        if not is_finished and self.stops:
            end = max(self.num_sent_chars, end - self.max_stop_len + 1)
        delta = self.text[self.num_sent_chars : end]
        self.num_sent_chars = end
        return delta

    def logprobs(self, rows: np.ndarray, token_ids, num_top: int) -> list[TokenLogprob]:
        """Target-model logprobs for each token of `token_ids`, from its logits row (before temperature; after
        a grammar's mask and engine/core/logits_processing.py, for the rows a step sampled from)."""
        out = []
        for row, tok in zip(rows, token_ids):
            row64 = row.astype(np.float64)
            m = row64.max()
            logz = m + np.log(np.exp(row64 - m).sum())
            top: list[tuple[int, str, float]] = []
            if num_top > 0:
                ids = np.argpartition(-row, num_top - 1)[:num_top]
                ids = ids[np.argsort(-row[ids], kind="stable")]
                top = [(int(i), self.tokenizer.id_to_piece(int(i)), float(row64[i] - logz)) for i in ids]
            rank = 1 + int(np.count_nonzero(row > row[tok]))
            piece = self.tokenizer.id_to_piece(int(tok))
            out.append(TokenLogprob(int(tok), piece, float(row64[tok] - logz), top, rank))
        return out


def make_output(seq: Sequence, state: OutputState, new_ids, drafted, logprobs, forced=None) -> Output:
    is_finished = seq.finish_reason is not None
    return Output(
        request_id=seq.request_id,
        text=state.take_text(is_finished),
        token_ids=[int(t) for t in new_ids],
        finish_reason=seq.finish_reason,
        prompt_tokens=seq.num_prompt_tokens,
        completion_tokens=seq.num_output_tokens,
        logprobs=logprobs,
        drafted=drafted if seq.params.include_provenance else None,
        grammar_forced=(forced or [False] * len(drafted)) if seq.params.include_provenance else None,
        num_drafts=seq.num_drafts,
        num_draft_tokens=seq.num_draft_tokens,
        num_accepted_tokens=seq.num_accepted_tokens,
        num_grammar_tokens=seq.num_grammar_tokens,
    )
