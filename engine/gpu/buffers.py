"""Every per-step buffer of the GPU runner, allocated once at its maximum size and sliced per step.

Host inputs go through one pinned int32 staging array laid out like its device twin:
    [sizes 4 | cu_q S+1 | seq_lens S | token_ids N | logits_indices N | block_tables S*MB]
so a step is two async copies (the small fields, then the live rows of the block tables) on
the runner's stream. Logits come back through a pinned float32 array. Activations stay on the
device; CUDA graphs captured over these buffers replay against whatever a step staged.
"""

from __future__ import annotations

import numpy as np

from engine.gpu.kernels import TokenMeta
from engine.gpu.weights import storage_numpy_dtype


class StepBuffers:
    def __init__(self, cfg, cache, dtype: str, partition_size: int):
        import cupy as cp
        import cupyx

        n, s, mb = cache.max_num_batched_tokens, cache.max_num_seqs, cache.max_blocks_per_seq
        self.max_tokens, self.max_reqs, self.max_blocks_per_seq = n, s, mb
        self.max_model_len = cache.max_model_len
        self.max_splits = -(-cache.max_model_len // partition_size)
        sizes = {"sizes": 4, "cu_q": s + 1, "seq_lens": s, "token_ids": n, "logits_indices": n, "block_tables": s * mb}
        self._offsets, off = {}, 0
        for name, size in sizes.items():
            self._offsets[name] = (off, off + size)
            off += size
        self._small_end = self._offsets["block_tables"][0]
        self.h_ints = cupyx.zeros_pinned(off, np.int32)
        self.d_ints = cp.zeros(off, np.int32)
        self.iota = np.arange(n, dtype=np.int32)
        meta = cp.zeros(s + 1 + 6 * n, np.int32)
        self.meta = TokenMeta(self.dev("sizes"), meta[: s + 1], *(meta[s + 1 + i * n : s + 1 + (i + 1) * n] for i in range(6)))
        act = storage_numpy_dtype(dtype)
        self.x = cp.zeros((n, cfg.hidden_size), np.float32)  # residual stream
        self.delta = cp.zeros((n, cfg.hidden_size), np.float32)  # sublayer output
        self.h = cp.zeros((n, cfg.hidden_size), act)  # normed sublayer input
        self.qkv = cp.zeros((n, cfg.q_size + 2 * cfg.kv_size), np.float32)
        self.attn = cp.zeros((n, cfg.q_size), act)
        self.gate_up = cp.zeros((n, 2 * cfg.intermediate_size), np.float32)
        self.act = cp.zeros((n, cfg.intermediate_size), act)
        self.normed = cp.zeros((n, cfg.hidden_size), act)  # final norm of the logits rows
        self.logits = cp.zeros((n, cfg.vocab_size), np.float32)
        self.part_acc = cp.zeros((n, cfg.num_heads, self.max_splits, cfg.head_dim), np.float32)
        self.part_ml = cp.zeros((n, cfg.num_heads, self.max_splits, 2), np.float32)
        self.h_logits = cupyx.zeros_pinned((n, cfg.vocab_size), np.float32)
        self.staged = cp.cuda.Event(disable_timing=True)  # when the pinned inputs may be rewritten
        self.staged.record()

    def _span(self, name: str) -> slice:
        lo, hi = self._offsets[name]
        return slice(lo, hi)

    def host(self, name: str) -> np.ndarray:
        return self.h_ints[self._span(name)]

    def dev(self, name: str):
        return self.d_ints[self._span(name)]

    @property
    def block_tables(self):
        return self.dev("block_tables").reshape(self.max_reqs, self.max_blocks_per_seq)  # [S, MB]

    def check(self, batch) -> None:
        """A batch this runner cannot hold is a ValueError, never an out-of-bounds write."""
        R, T, L = batch.num_reqs, batch.num_tokens, batch.num_logits
        if not 1 <= R <= self.max_reqs:
            raise ValueError(f"num_reqs: {R} outside [1, max_num_seqs={self.max_reqs}]")
        if not R <= T <= self.max_tokens:
            raise ValueError(f"num_tokens: {T} outside [num_reqs, max_num_batched_tokens={self.max_tokens}]")
        if not 0 <= L <= T:
            raise ValueError(f"num_logits: {L} outside [0, num_tokens={T}]")
        if batch.block_tables.shape[1] != self.max_blocks_per_seq:
            raise ValueError("block_tables: built for another CacheConfig (max_blocks_per_seq differs)")
        if int(batch.seq_lens[:R].max()) > self.max_model_len:
            raise ValueError(f"seq_lens: a context exceeds max_model_len={self.max_model_len}")

    def stage(self, batch, capacity: int, num_logits_cap: int, stream) -> None:
        """Copy the batch's inputs to the device, padded to `capacity` tokens / `num_logits_cap` rows."""
        R, T, L = batch.num_reqs, batch.num_tokens, batch.num_logits
        self.staged.synchronize()  # the previous step's copies have read the pinned array
        self.host("sizes")[:] = (R, T, 0, L)
        self.host("cu_q")[: R + 1] = batch.cu_q[: R + 1]
        self.host("seq_lens")[:R] = batch.seq_lens[:R]
        token_ids = self.host("token_ids")
        token_ids[:T] = batch.token_ids[:T]
        token_ids[T:capacity] = 0  # padding tokens: finite activations, no KV write
        logits_indices = self.host("logits_indices")
        logits_indices[:L] = batch.logits_indices[:L]
        logits_indices[L:num_logits_cap] = self.iota[L:num_logits_cap]
        tables = self.host("block_tables").reshape(self.max_reqs, self.max_blocks_per_seq)
        tables[:R] = batch.block_tables[:R]
        bt0 = self._offsets["block_tables"][0]
        self.d_ints[: self._small_end].set(self.h_ints[: self._small_end], stream=stream)
        self.d_ints[bt0 : bt0 + R * self.max_blocks_per_seq].set(
            self.h_ints[bt0 : bt0 + R * self.max_blocks_per_seq], stream=stream)
        self.staged.record(stream)
