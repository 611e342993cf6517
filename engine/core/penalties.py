"""OpenAI's presence and frequency penalties and logit_bias, applied to the logits rows a step samples from.

For a row that follows the generated tokens o (the prompt does not count, as in OpenAI's and vLLM's
definition), with c[t] the number of times token t occurs in o:

    logits[t] -= frequency_penalty * c[t] + presence_penalty * (c[t] > 0)
    logits[t] += logit_bias[t]

in float32, in that order. A verify step holds a request's rows 0..k: row j follows its generated tokens
and then drafts 0..j-1, so row j counts those drafts too. Each row thus gets the logits plain decoding
samples that position from: greedy speculative output stays identical to plain output, and the
rejection test (and the residual a rejected draft is resampled from) uses the processed target.
Logprobs are those of the processed distribution, as with a grammar's mask.
"""

from __future__ import annotations

import numpy as np

from engine.serving.protocol import SamplingParams


def has_penalties(params: SamplingParams) -> bool:
    """Whether a request's logits rows need this module at all."""
    return bool(params.presence_penalty or params.frequency_penalty or params.logit_bias)


class LogitBias:
    """A request's logit_bias as (token ids, float32 biases), built once per request."""

    __slots__ = ("ids", "values")

    def __init__(self, bias: dict[int, float]):
        self.ids = np.fromiter(bias.keys(), np.int64, len(bias))  # [B]
        self.values = np.fromiter(bias.values(), np.float32, len(bias))  # [B]


def apply_penalties(logits: np.ndarray, runs, biases: dict[str, LogitBias]) -> None:
    """Process logits rows in place. runs: (sequence, first row, drafts) of each sampling request that
    has penalties or a bias (StepBatch.sampling_runs); biases: request id -> its LogitBias."""
    for seq, first, drafts in runs:
        p = seq.params
        generated = seq.token_ids[seq.num_prompt_tokens : seq.num_tokens]
        bias = biases.get(seq.request_id)
        for j in range(1 + len(drafts)):
            row = logits[first + j]  # [vocab]
            if p.presence_penalty or p.frequency_penalty:
                seen = np.concatenate([generated, drafts[:j]]) if j else generated
                ids, counts = np.unique(seen, return_counts=True)
                row[ids] -= np.float32(p.frequency_penalty) * counts.astype(np.float32) + np.float32(p.presence_penalty)
            if bias is not None:
                row[bias.ids] += bias.values
