"""A request's prompt sent back on its first Output: completions' `echo`, and vLLM's `prompt_logprobs`.

With echo and `logprobs`, or with `prompt_logprobs`, prompt token p (p >= 1) gets the logprob the model gives it
after tokens 0..p-1, its rank and the top alternatives, from the raw logits of row p - 1 of the forward that
computed that position (as an evaluation harness scores a text); token 0 gets None. Such a request never reuses
cached prefix blocks (the scheduler skips the lookup), so every prompt position is computed by some forward; a
preempted request that computes them again overwrites the same entries.
"""

from __future__ import annotations

import msgspec
import numpy as np

from engine.core.output_processor import OutputState
from engine.core.request_input import prompt_top, scores_prompt
from engine.core.sequence import Sequence
from engine.serving.protocol import Output, TokenLogprob

# rows whose logits are made at a time: a prefill chunk of 512 rows over Gemma 3's 262k-token vocabulary would
# otherwise hold 0.5 GB of float32 logits at once
ROWS_PER_PASS = 64


class PromptEchoes:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.pending: dict[str, list[TokenLogprob | None]] = {}  # request -> an entry per prompt token

    def start(self, seq: Sequence) -> None:
        if seq.params.echo or seq.params.prompt_logprobs is not None:
            first = int(seq.token_ids[0])
            self.pending[seq.request_id] = [TokenLogprob(first, self.tokenizer.id_to_piece(first), None)] + \
                [None] * (seq.num_prompt_tokens - 1)

    def stop(self, request_id: str) -> None:
        self.pending.pop(request_id, None)

    def observe(self, sched, batch, runner, states: dict[str, OutputState]) -> None:
        """After a forward, before the step's accepted tokens count: score the prompt positions it computed.
        batch: the step's ForwardBatch (request i's rows start at cu_q[i])."""
        for i, item in enumerate(sched):
            seq = item.seq
            entries = self.pending.get(seq.request_id)
            start = seq.num_computed_tokens
            if entries is None or not scores_prompt(seq.params) or start >= seq.num_prompt_tokens - 1:
                continue
            num = min(item.num_new_tokens, seq.num_prompt_tokens - 1 - start)  # rows that predict prompt tokens
            for a in range(0, num, ROWS_PER_PASS):
                b = min(num, a + ROWS_PER_PASS)
                logits = runner.row_logits(int(batch.cu_q[i]) + np.arange(a, b))  # [b - a, vocab]
                targets = seq.token_ids[start + 1 + a : start + 1 + b]
                entries[start + 1 + a : start + 1 + b] = states[seq.request_id].logprobs(logits, targets,
                                                                                         prompt_top(seq.params))

    def attach(self, seq: Sequence, out: Output) -> Output:
        """The request's first Output with the prompt added (later ones as they are)."""
        entries = self.pending.pop(seq.request_id, None)
        if entries is None:
            return out
        text = self.tokenizer.decode(seq.token_ids[: seq.num_prompt_tokens].tolist()) if seq.params.echo else None
        logprobs = list(entries) if scores_prompt(seq.params) else None
        return msgspec.structs.replace(out, prompt_text=text, prompt_logprobs=logprobs)
