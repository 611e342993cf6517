"""Penalties, logit_bias, min_p, min_tokens, allowed_token_ids and bad_words, applied in place to the logits rows
a step samples from.

For a row that follows a request's tokens, in float32 and in this order (the parameters at their defaults
skip their part):

    allowed_token_ids (vLLM's): every other token is removed (-inf)
    bad_words (vLLM's): each word's tokens (as encoded alone and after a space); where the tokens before a row
        end with all of a word's tokens but its last, that last token is removed (a one-token word: always),
        unless that would leave no token
    min_tokens n (vLLM's): at output positions below n the stop tokens (EOS unless ignore_eos, and the
        request's stop_token_ids) are removed, unless nothing else is left (then the request may only stop);
        the output processor does not look for stop strings before n tokens either
    repetition_penalty r (vLLM's): each token seen in the prompt or the generated text:
        logit / r if logit > 0, else logit * r
    frequency_penalty f, presence_penalty p (OpenAI's): with c[t] the times t occurs in the generated text
        (the prompt does not count, as in OpenAI's definition and vLLM's):
        logit[t] -= f * c[t] + p * (c[t] > 0)
    logit_bias (OpenAI's): logit[t] += bias[t]
    min_p m (at temperature T > 0; vLLM's and llama.cpp's): a token whose probability at T is below
        m times the most likely one's is removed (-inf): logit < max + T * log(m)

A verify step holds a request's rows 0..k: row j follows its tokens and then drafts 0..j-1, so row j
counts those drafts too (and samples output position num_output_tokens + j). Each row thus gets the logits
plain decoding samples that position from: greedy speculative output stays identical to plain output, and
verification (the rejection test and the residual a rejected draft is resampled from, or target_match's
sample) uses the processed target. A grammar's mask comes first (engine/llm_engine.py),
so min_p measures against the most likely allowed token. Logprobs are those of the processed logits.
"""

from __future__ import annotations

import numpy as np

from engine.serving.protocol import SamplingParams


def processing_field(params: SamplingParams) -> str | None:
    """The first parameter that has a request's logits rows processed here; None: they need nothing."""
    asks = (("repetition_penalty", params.repetition_penalty != 1.0), ("presence_penalty", params.presence_penalty),
            ("frequency_penalty", params.frequency_penalty), ("logit_bias", params.logit_bias),
            ("min_p", params.min_p and params.temperature > 0), ("min_tokens", params.min_tokens > 0),
            ("allowed_token_ids", params.allowed_token_ids), ("bad_words", params.bad_words))
    return next((name for name, asked in asks if asked), None)


class RequestArrays:
    """What a request's rows need as arrays, built once per request: its logit_bias as (ids, float32 values),
    the stop tokens min_tokens holds back, the allowed_token_ids as a mask and the bad_words' token runs."""

    __slots__ = ("bias_ids", "bias_values", "stop_ids", "allowed", "bad")

    def __init__(self, params: SamplingParams, eos_ids, vocab_size: int, encode=None):
        bias = params.logit_bias
        self.bias_ids = np.fromiter(bias.keys(), np.int64, len(bias))  # [B]
        self.bias_values = np.fromiter(bias.values(), np.float32, len(bias))  # [B]
        # [S] the stop tokens min_tokens holds back (None: no min_tokens)
        self.stop_ids = np.array(sorted(params.stop_ids(eos_ids)), np.int64) if params.min_tokens else None
        self.allowed = None  # [vocab] bool
        if params.allowed_token_ids:
            self.allowed = np.zeros(vocab_size, np.bool_)
            self.allowed[params.allowed_token_ids] = True
        self.bad = bad_word_runs(params.bad_words, encode) if params.bad_words else []  # [(prefix, last token)]


def bad_word_runs(words: list[str], encode) -> list[tuple[tuple[int, ...], int]]:
    """Each bad word's token run as (the tokens before its last, its last token), encoded alone and after a
    space (a word at the start of the text and inside it), without duplicates."""
    runs = set()
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = [int(t) for t in encode(text)]
            if ids:
                runs.add((tuple(ids[:-1]), ids[-1]))
    return sorted(runs)


def process_rows(logits: np.ndarray, runs, arrays: dict[str, RequestArrays]) -> None:
    """runs: (sequence, first row, drafts) of each sampling request that needs processing
    (StepBatch.sampling_runs); arrays: request id -> its RequestArrays."""
    for seq, first, drafts in runs:
        p = seq.params
        tokens = seq.token_ids[: seq.num_tokens]  # prompt + generated
        seen = np.unique(tokens) if p.repetition_penalty != 1.0 else None  # [distinct tokens]
        counted = np.unique(tokens[seq.num_prompt_tokens:], return_counts=True) \
            if p.presence_penalty or p.frequency_penalty else None  # (ids, counts) of the generated tokens
        a = arrays[seq.request_id]
        longest = max((len(prefix) for prefix, _ in a.bad), default=0)
        before = [int(t) for t in tokens[max(0, len(tokens) - longest):]] if longest else []  # for bad_words
        for j in range(1 + len(drafts)):
            if j:  # row j also follows draft j - 1
                seen = None if seen is None else np.union1d(seen, drafts[j - 1 : j])
                counted = None if counted is None else _count_one(*counted, int(drafts[j - 1]))
                before.append(int(drafts[j - 1]))
            _process(logits[first + j], seen, counted, p, a, seq.num_output_tokens + j, before)


def _ban_bad_words(row: np.ndarray, bad, before: list[int]) -> None:
    """Remove the last token of each bad word whose other tokens end `before` (unless nothing would be left)."""
    banned = [last for prefix, last in bad if not prefix or tuple(before[len(before) - len(prefix):]) == prefix]
    if banned:
        _remove_unless_empty(row, banned)


def _remove_unless_empty(row: np.ndarray, ids) -> None:
    """Set row[ids] to -inf, unless no finite logit would be left (then the row keeps them)."""
    held = row[ids]
    row[ids] = -np.inf
    if not np.isfinite(row).any():
        row[ids] = held


def _count_one(ids: np.ndarray, counts: np.ndarray, token: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids, counts) with one more `token` (ids sorted, as np.unique gives them)."""
    k = int(np.searchsorted(ids, token))
    if k < len(ids) and ids[k] == token:
        counts = counts.copy()
        counts[k] += 1
        return ids, counts
    return np.insert(ids, k, token), np.insert(counts, k, 1)


def _process(row: np.ndarray, seen, counted, p: SamplingParams, arrays: RequestArrays, position: int,
             before: list[int]) -> None:
    """One row [vocab] that samples output `position`: seen, the distinct tokens before it (for the repetition
    penalty); counted, the generated ones with their counts (for the frequency and presence penalties); before,
    the last tokens before it (for bad_words)."""
    if arrays.allowed is not None:
        row[~arrays.allowed] = -np.inf
    if arrays.stop_ids is not None and position < p.min_tokens:
        _remove_unless_empty(row, arrays.stop_ids)  # if only a stop was possible here, the request may stop
    if arrays.bad:
        _ban_bad_words(row, arrays.bad, before)
    if seen is not None:
        values = row[seen]
        r = np.float32(p.repetition_penalty)
        row[seen] = np.where(values > 0, values / r, values * r)
    if counted is not None:
        ids, counts = counted
        row[ids] -= np.float32(p.frequency_penalty) * counts.astype(np.float32) + np.float32(p.presence_penalty)
    if len(arrays.bias_ids):
        row[arrays.bias_ids] += arrays.bias_values
    if p.min_p and p.temperature > 0:
        row[row < row.max() + np.float32(p.temperature * np.log(p.min_p))] = -np.inf
