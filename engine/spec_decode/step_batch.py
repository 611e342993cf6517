"""Lay one step out as arrays: the ragged forward batch and the verification inputs.

For request r the forward appends its new tokens (a prefill chunk, or its last
token followed by its drafts). Requests that sample this step own a contiguous run
of logits rows, cu_rows[r]:cu_rows[r+1] = 1 + num_drafts rows: the target's
distribution after the last token and after each draft.
"""

from __future__ import annotations

import numpy as np

from engine.model.cpu_runner import CacheConfig, ForwardBatch
from engine.spec_decode.verify import GREEDY, NORMAL, POLICY_IDS, STRATEGY_IDS, TARGET_MATCH, verify


class StepBatch:
    def __init__(self, cache: CacheConfig, vocab_size: int):
        n, s = cache.max_num_batched_tokens, cache.max_num_seqs
        self.forward = ForwardBatch(cache)
        self.vocab_size = vocab_size
        self.cu_rows = np.zeros(s + 1, np.int32)  # [num_sampling + 1]
        self.draft_ids = np.zeros(n, np.int32)  # [num_rows - num_sampling]
        self.has_draft_probs = np.zeros(s, np.bool_)
        self.temperature = np.zeros(s, np.float32)
        self.top_p = np.ones(s, np.float32)
        self.top_k = np.zeros(s, np.int32)
        self.strategy = np.zeros(s, np.int32)
        self.uniforms = np.zeros((n, 2), np.float64)  # [num_rows, 2]
        self.out_token_ids = np.zeros(n, np.int32)  # [num_rows]
        self.out_num_accepted = np.zeros(s, np.int32)  # [num_sampling]
        self.no_probs = np.zeros((0, vocab_size), np.float32)
        self.slot_of_item: list[int] = []  # scheduled item -> sampling slot (-1 = partial prefill)
        self.draft_probs = None

    def build(self, sched, draft_of: dict) -> "StepBatch":
        """draft_of: request id -> (draft token ids, draft probs q or None) for the requests that drafted."""
        fb = self.forward
        fb.clear()
        self.slot_of_item = []
        probs = []  # (q rows or None, num drafts) of the sampling requests with drafts
        num_sampling = 0
        for item in sched:
            seq = item.seq
            start = seq.num_computed_tokens
            d_ids, d_probs = draft_of.get(seq.request_id, (None, None))
            num_d = 0 if d_ids is None else len(d_ids)
            run = seq.token_ids[start : start + item.num_new_tokens]
            samples = start + item.num_new_tokens == seq.num_tokens
            fb.add(run, start, seq.block_table, 1 + num_d if samples else 0, d_ids if num_d else None)
            if not samples:
                self.slot_of_item.append(-1)
                continue
            self._add_sampling(num_sampling, seq, d_ids, num_d, d_probs, probs)
            self.slot_of_item.append(num_sampling)
            num_sampling += 1
        self.num_sampling = num_sampling
        self.draft_probs = self._stack_probs(probs) if any(p is not None for p, _ in probs) else None
        return self

    def _add_sampling(self, r, seq, d_ids, num_d, d_probs, probs) -> None:
        params = seq.params
        lo = self.cu_rows[r]
        self.cu_rows[r + 1] = lo + 1 + num_d
        if num_d:
            self.draft_ids[lo - r : lo - r + num_d] = d_ids
        self.has_draft_probs[r] = d_probs is not None
        if num_d:
            probs.append((d_probs, num_d))  # materialised only if some request has real draft probs
        self.temperature[r] = params.temperature
        self.top_p[r] = params.top_p
        self.top_k[r] = params.top_k
        if params.temperature > 0:  # greedy rows never read theirs
            self.uniforms[lo : lo + 1 + num_d] = seq.row_uniforms(1 + num_d)

    def _stack_probs(self, probs) -> np.ndarray:
        """[num_drafts, vocab] q rows; one-hot (model-free) requests get zero rows the kernel ignores."""
        return np.concatenate([p if p is not None else np.zeros((n, self.vocab_size), np.float32) for p, n in probs])

    def verify(self, logits: np.ndarray, spec) -> None:
        """Run the batched verification kernel over every sampling request at once."""
        n = self.num_sampling
        if n == 0:
            return
        for r in range(n):
            self.strategy[r] = self._strategy(spec, self.temperature[r], self.has_draft_probs[r])
        policy = POLICY_IDS[spec.accept_policy] if spec else NORMAL
        topp = {"max_candidate_len": spec.max_candidate_len, "verify_top_p": spec.verify_top_p} if spec else {}
        num_rows = int(self.cu_rows[n])
        verify(
            logits, self.cu_rows[: n + 1], self.draft_ids[: num_rows - n],
            self.draft_probs if self.draft_probs is not None else self.no_probs,
            self.has_draft_probs[:n], self.temperature[:n], self.top_p[:n], self.top_k[:n],
            self.strategy[:n], policy, self.uniforms[:num_rows], self.out_token_ids[:num_rows],
            self.out_num_accepted[:n], **topp, own_buffers=self.draft_probs is None,  # q rows: a proposer's arrays
        )

    @staticmethod
    def _strategy(spec, temperature: float, has_q: bool) -> int:
        if spec is not None:
            return STRATEGY_IDS[spec.strategy_for(temperature, has_q)]
        return GREEDY if temperature == 0 else TARGET_MATCH

    def sampling_runs(self, sched, wanted) -> list[tuple]:
        """(sequence, first logits row, its drafts) of the sampling requests for which wanted(sequence)."""
        runs = []
        for i, item in enumerate(sched):
            r = self.slot_of_item[i]
            if r >= 0 and wanted(item.seq):
                lo, hi = int(self.cu_rows[r]), int(self.cu_rows[r + 1])
                runs.append((item.seq, lo, self.draft_ids[lo - r : hi - r - 1]))
        return runs

    def result(self, item_index: int):
        """(output token ids, num drafts, num accepted, logits rows) of a scheduled item, or None."""
        r = self.slot_of_item[item_index]
        if r < 0:
            return None
        lo, hi = int(self.cu_rows[r]), int(self.cu_rows[r + 1])
        a = int(self.out_num_accepted[r])
        return self.out_token_ids[lo : lo + a + 1].copy(), hi - lo - 1, a, range(lo, lo + a + 1)
