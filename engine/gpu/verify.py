"""Verification on the device: engine.spec_decode.verify.verify's arguments and results, one kernel launch.

The logits stay where the forward pass left them; only the small per-request inputs go up (and
draft probabilities, when a proposer has them) and the emitted token ids and accept lengths come
back, through pinned buffers allocated once. Inputs are checked by the CPU verifier's own checks,
so a bad argument is the same ValueError on either backend.
"""

from __future__ import annotations

import numpy as np

from engine.spec_decode.verify import NORMAL, _check_inputs


class _Staged:
    """A pinned host array and its device twin, both at the maximum size."""

    def __init__(self, shape, dtype):
        import cupy as cp
        import cupyx

        self.host = cupyx.zeros_pinned(shape, dtype)
        self.dev = cp.zeros(shape, dtype)

    def upload(self, src: np.ndarray, n: int, stream):
        if n > 0:
            self.host[:n] = src[:n]
            self.dev[:n].set(self.host[:n], stream=stream)
        return self.dev[:n]


class DeviceVerifier:
    def __init__(self, kernels, vocab: int, max_rows: int, max_reqs: int, stream):
        import cupy as cp

        self.kernels, self.vocab, self.stream = kernels, vocab, stream
        self.max_rows, self.max_reqs = max_rows, max_reqs
        self.cu_rows = _Staged(max_reqs + 1, np.int32)
        self.draft_ids = _Staged(max_rows, np.int32)
        self.draft_probs = _Staged((max_rows, vocab), np.float32)
        self.has_q = _Staged(max_reqs, np.uint8)
        self.temperature = _Staged(max_reqs, np.float32)
        self.top_p = _Staged(max_reqs, np.float32)
        self.top_k = _Staged(max_reqs, np.int32)
        self.strategy = _Staged(max_reqs, np.int32)
        self.uniforms = _Staged((max_rows, 2), np.float64)
        self.out_token_ids = _Staged(max_rows, np.int32)
        self.out_num_accepted = _Staged(max_reqs, np.int32)
        self._no_probs = cp.zeros((1, vocab), np.float32)
        self._shape_proxy = np.empty(max_rows * vocab, np.float32)  # never touched: shape checks only

    def verify(self, logits, cu_rows, draft_ids, draft_probs, has_draft_probs, temperature, top_p, top_k,
               strategy, policy: int, uniforms, out_token_ids, out_num_accepted,
               max_candidate_len: int = 5, verify_top_p: float = 1.0) -> None:
        """As engine.spec_decode.verify.verify, with `logits` a CuPy float32 [num_rows, vocab] device array."""
        num_rows, num_reqs = self._check(logits, cu_rows)
        proxy = self._shape_proxy[: num_rows * self.vocab].reshape(num_rows, self.vocab)
        _check_inputs(proxy, cu_rows, draft_ids, draft_probs, has_draft_probs, temperature, top_p, top_k,
                      strategy, policy, uniforms, out_token_ids, out_num_accepted)
        if max_candidate_len < 1:
            raise ValueError("max_candidate_len: must be >= 1")
        if not 0.0 < verify_top_p <= 1.0:
            raise ValueError("verify_top_p: must be in (0, 1]")
        s, num_drafts = self.stream, num_rows - num_reqs  # the last call synchronized: pinned arrays are free
        has_q = bool(has_draft_probs.any()) and policy == NORMAL
        probs = self.draft_probs.upload(draft_probs, num_drafts, s) if has_q and num_drafts else self._no_probs
        args = (
            self.cu_rows.upload(cu_rows, num_reqs + 1, s), self.draft_ids.upload(draft_ids, num_drafts, s), probs,
            self.has_q.upload(has_draft_probs, num_reqs, s), self.temperature.upload(temperature, num_reqs, s),
            self.top_p.upload(top_p, num_reqs, s), self.top_k.upload(top_k, num_reqs, s),
            self.strategy.upload(strategy, num_reqs, s),
        )
        with s:
            self.kernels.verify(logits, *args, int(policy), self.uniforms.upload(uniforms, num_rows, s),
                                int(max_candidate_len), float(verify_top_p), self.out_token_ids.dev,
                                self.out_num_accepted.dev, num_reqs)
        self.out_token_ids.dev[:num_rows].get(stream=s, out=self.out_token_ids.host[:num_rows], blocking=False)
        self.out_num_accepted.dev[:num_reqs].get(stream=s, out=self.out_num_accepted.host[:num_reqs], blocking=False)
        s.synchronize()
        # Only rows up to each request's accept length + 1 are written, as on the CPU.
        for r in range(num_reqs):
            lo, a = int(cu_rows[r]), int(self.out_num_accepted.host[r])
            out_token_ids[lo : lo + a + 1] = self.out_token_ids.host[lo : lo + a + 1]
        out_num_accepted[:] = self.out_num_accepted.host[:num_reqs]

    def _check(self, logits, cu_rows) -> tuple[int, int]:
        shape = getattr(logits, "shape", ())
        if len(shape) != 2 or shape[1] != self.vocab or logits.dtype != np.float32 or not logits.flags.c_contiguous:
            raise ValueError(f"logits: expected a C-contiguous float32 device array [num_rows, {self.vocab}]")
        if not isinstance(cu_rows, np.ndarray) or cu_rows.ndim != 1 or cu_rows.shape[0] < 2:
            raise ValueError("cu_rows: expected a [num_reqs + 1] array with num_reqs >= 1")
        num_rows, num_reqs = shape[0], cu_rows.shape[0] - 1
        if num_rows > self.max_rows or num_reqs > self.max_reqs:
            raise ValueError(f"logits / cu_rows: {num_rows} rows, {num_reqs} requests exceed this verifier's "
                             f"{self.max_rows} rows, {self.max_reqs} requests")
        return num_rows, num_reqs
