"""What one forward is asked to do: the cache's shape (CacheConfig) and a ragged batch of appended token runs in
arrays allocated once (ForwardBatch), filled by the engine each step and read by a model runner."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class CacheConfig:
    block_size: int
    num_blocks: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)


class ForwardBatch:
    """Batch description in preallocated arrays; `num_reqs`/`num_tokens`/`num_logits` say how much is live."""

    def __init__(self, cache: CacheConfig):
        self.token_ids = np.zeros(cache.max_num_batched_tokens, np.int32)  # [num_tokens]
        self.cu_q = np.zeros(cache.max_num_seqs + 1, np.int32)  # [num_reqs + 1]
        self.seq_lens = np.zeros(cache.max_num_seqs, np.int32)  # [num_reqs] context length after the append
        self.block_tables = np.zeros((cache.max_num_seqs, cache.max_blocks_per_seq), np.int32)
        self.logits_indices = np.zeros(cache.max_num_batched_tokens, np.int32)  # [num_logits]
        self.num_reqs = 0
        self.num_tokens = 0
        self.num_logits = 0

    def clear(self) -> None:
        self.num_reqs = self.num_tokens = self.num_logits = 0

    def add(self, token_ids, num_cached: int, block_table, num_logits_rows: int, drafts=None) -> None:
        """Append a request's run of tokens, then its drafts if any; its last `num_logits_rows` rows get logits."""
        r, t0, n = self.num_reqs, self.num_tokens, len(token_ids)
        self.token_ids[t0 : t0 + n] = token_ids
        if drafts is not None:
            self.token_ids[t0 + n : t0 + n + len(drafts)] = drafts
            n += len(drafts)
        self.cu_q[r + 1] = t0 + n
        self.seq_lens[r] = num_cached + n
        self.block_tables[r, : len(block_table)] = block_table
        for j in range(num_logits_rows):
            self.logits_indices[self.num_logits + j] = t0 + n - num_logits_rows + j
        self.num_logits += num_logits_rows
        self.num_reqs, self.num_tokens = r + 1, t0 + n
