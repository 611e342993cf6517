"""Batched verification of drafts against the target model: one Numba kernel for the ragged batch.

Glossary (vLLM's): per request, the output of a step is
    accepted drafts  +  one recovered token (the first draft was rejected: a replacement)
                     or one bonus token (every draft was accepted: a free extra token).
So a request with n drafts emits 1..n+1 tokens, and never zero.

The target distribution p at a row:
    p = softmax(logits / T), restricted to the top_k logits, then to the nucleus (the smallest
    set, by descending probability, with mass >= top_p), renormalised. T == 0 means greedy:
    p is one-hot at argmax (ties -> lowest id), and every strategy reduces to `greedy`.

Strategies (per request):
  GREEDY        accept while draft == argmax; on the first mismatch emit argmax (recovered);
                all accepted -> bonus = argmax of the last row. Ignores T, top_k, top_p.
  TARGET_MATCH  at each row sample x ~ p with the row's sampling uniform; accept while draft == x;
                the first non-matching x is the recovered token. Lossless: every emitted token
                is a plain sample of p at its position, as without speculation.
  TOPP          FastDeploy's rule: accept while the draft is among the `max_candidate_len` most
                probable tokens of p's support (optionally also within mass `verify_top_p`);
                recovered = a sample of p. NOT distribution-preserving: a draft in the top few is
                accepted with probability 1 whatever p gives it, so outputs drift toward the drafts.
  REJECTION     speculative rejection sampling (Leviathan et al., Chen et al.): accept draft x with
                probability min(1, p(x) / q(x)) using the row's accept uniform; on rejection sample
                the normalised residual max(0, p - q). For model-free drafts q is one-hot at x, so
                accept w.p. p(x) and the residual is p without x. Lossless.
Accept policies (debugging): ACCEPT_ALL accepts every draft (bonus from the last row); REJECT_ALL
accepts none and emits what decoding without speculation would emit at the first row (argmax, or a
sample of p with that row's sampling uniform).

Sampling is by inverse CDF over token ids with a given uniform, so results are a pure function of
the inputs. The engine keys each row's uniforms by the request's seed and the row's output position
(Sequence.row_uniforms), so a request's output depends neither on what else is in the batch nor, with
GREEDY or TARGET_MATCH, on its drafts: a seeded sampled request emits what plain decoding emits.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from engine.spec_decode.verify_kernels import (
    ACCEPT_ALL,
    GREEDY,
    NORMAL,
    REJECT_ALL,
    REJECTION,
    TARGET_MATCH,
    TOPP,
    argmax,
    target_mass,
    verify_parallel,
    verify_serial,
)

STRATEGY_IDS = {"greedy": GREEDY, "target_match": TARGET_MATCH, "topp": TOPP, "rejection": REJECTION}
POLICY_IDS = {"normal": NORMAL, "accept_all": ACCEPT_ALL, "reject_all": REJECT_ALL}
_PARALLEL_MIN_WORK = 1 << 20  # rows * vocab: ~20 rows of a 49k vocabulary, a millisecond or more


def verify(
    logits: np.ndarray,  # [num_rows, vocab] float32: rows cu_rows[r]:cu_rows[r+1] belong to request r
    cu_rows: np.ndarray,  # [num_reqs + 1] int32
    draft_ids: np.ndarray,  # [num_rows - num_reqs] int32; request r's at cu_rows[r]-r : cu_rows[r+1]-r-1
    draft_probs: np.ndarray,  # [num_rows - num_reqs, vocab] float32, or [0, vocab] when nobody has q
    has_draft_probs: np.ndarray,  # [num_reqs] bool; False = one-hot q (model-free drafts)
    temperature: np.ndarray,  # [num_reqs] float32
    top_p: np.ndarray,  # [num_reqs] float32
    top_k: np.ndarray,  # [num_reqs] int32, 0 = off
    strategy: np.ndarray,  # [num_reqs] int32, GREEDY..REJECTION
    policy: int,  # NORMAL | ACCEPT_ALL | REJECT_ALL
    uniforms: np.ndarray,  # [num_rows, 2] float64 in [0, 1): (accept test, sampling) per row
    out_token_ids: np.ndarray,  # [num_rows] int32 out: request r's tokens at cu_rows[r] : +num_accepted[r]+1
    out_num_accepted: np.ndarray,  # [num_reqs] int32 out
    max_candidate_len: int = 5,  # TOPP only
    verify_top_p: float = 1.0,  # TOPP only: candidates must also lie within this mass of p
    own_buffers: bool = False,  # the arrays' dtypes and shapes are the caller's fixed buffers' (StepBatch)
) -> None:
    """Verify every request's drafts in one call; see the module docstring for the maths.

    Every value that could make the kernel read out of bounds (cu_rows, draft ids) or sample
    nonsense is checked whatever the caller; `own_buffers` skips only the dtype and shape checks,
    which cost ~25 us a step with the caches cold after a forward (one compiled pass checks the rest).
    """
    if own_buffers:
        _check_values(logits.shape[0], logits.shape[1], cu_rows, draft_ids, temperature, top_p, top_k, strategy,
                      policy)
    else:
        _check_inputs(logits, cu_rows, draft_ids, draft_probs, has_draft_probs, temperature, top_p,
                      top_k, strategy, policy, uniforms, out_token_ids, out_num_accepted)
    if max_candidate_len < 1:
        raise ValueError("max_candidate_len: must be >= 1")
    if not 0.0 < verify_top_p <= 1.0:
        raise ValueError("verify_top_p: must be in (0, 1]")
    is_big = logits.size >= _PARALLEL_MIN_WORK and cu_rows.shape[0] > 2
    kernel = verify_parallel if is_big else verify_serial
    kernel(logits, cu_rows, draft_ids, draft_probs, has_draft_probs, temperature, top_p, top_k,
           strategy, int(policy), uniforms, int(max_candidate_len), float(verify_top_p),
           out_token_ids, out_num_accepted)


def compile_kernels() -> None:
    """Compile (or load from the cache) both kernels on a tiny batch of the engine's argument types.

    `verify` picks verify_parallel only for big batches (several requests with drafts), which one
    short warm-up request never reaches; compiled on a first big batch it stalled that step ~4 s.
    """
    vocab, cu_rows = 4, np.array([0, 2, 3], np.int32)  # two requests: 1 draft + 0 drafts
    logits = np.zeros((3, vocab), np.float32)  # [num_rows, vocab]
    for kernel in (verify_serial, verify_parallel):
        kernel(logits, cu_rows, np.zeros(1, np.int32), np.zeros((0, vocab), np.float32), np.zeros(2, np.bool_),
               np.zeros(2, np.float32), np.ones(2, np.float32), np.zeros(2, np.int32), np.full(2, GREEDY, np.int32),
               int(NORMAL), np.zeros((3, 2)), 5, 1.0, np.zeros(3, np.int32), np.zeros(2, np.int32))


def _expect(name: str, array: np.ndarray, dtype, shape: tuple) -> None:
    if not isinstance(array, np.ndarray) or array.dtype != dtype:
        raise ValueError(f"{name}: expected a {np.dtype(dtype).name} ndarray")
    if array.shape != shape or not array.flags.c_contiguous:
        raise ValueError(f"{name}: expected a C-contiguous array of shape {shape}, got {array.shape}")


_VALUE_ERRORS = (
    None,
    "draft_ids: token id outside the vocabulary",
    "temperature: must be finite and >= 0",
    "top_p: must be in (0, 1]",
    "top_k / strategy: top_k must be >= 0 and strategy one of GREEDY..REJECTION",
    "cu_rows: must start at 0, end at num_rows and give every request >= 1 row",
    "draft_ids: expected num_rows - num_reqs of them",
)


@nb.njit(cache=True)
def _cu_rows_ok(cu_rows, num_rows) -> bool:
    if cu_rows[0] != 0 or cu_rows[-1] != num_rows:
        return False
    for r in range(cu_rows.shape[0] - 1):
        if cu_rows[r + 1] - cu_rows[r] < 1:
            return False
    return True


@nb.njit(cache=True)
def _bad_value(num_rows, vocab, cu_rows, draft_ids, temperature, top_p, top_k, strategy) -> int:
    """Index into _VALUE_ERRORS of the first bad value (0: none), in one compiled pass: a dozen NumPy
    reductions on these tiny arrays cost ~0.2 ms a step, a few percent of a decode step."""
    if not _cu_rows_ok(cu_rows, num_rows):
        return 5
    if draft_ids.shape[0] != num_rows - (cu_rows.shape[0] - 1):
        return 6
    for t in draft_ids:
        if t < 0 or t >= vocab:
            return 1
    for r in range(temperature.shape[0]):
        if not (temperature[r] >= 0 and np.isfinite(temperature[r])):
            return 2
        if not (0 < top_p[r] <= 1):
            return 3
        if top_k[r] < 0 or strategy[r] < GREEDY or strategy[r] > REJECTION:
            return 4
    return 0


def _check_inputs(logits, cu_rows, draft_ids, draft_probs, has_draft_probs, temperature, top_p,
                  top_k, strategy, policy, uniforms, out_token_ids, out_num_accepted) -> None:
    """Cheap O(num_reqs) checks, so a caller's bug is a ValueError and not a wild read in Numba."""
    if not isinstance(logits, np.ndarray) or logits.ndim != 2:
        raise ValueError("logits: expected a [num_rows, vocab] array")
    num_rows, vocab = logits.shape
    _expect("logits", logits, np.float32, (num_rows, vocab))
    if not isinstance(cu_rows, np.ndarray) or cu_rows.ndim != 1 or cu_rows.shape[0] < 1:
        raise ValueError("cu_rows: expected a [num_reqs + 1] array")
    num_reqs = cu_rows.shape[0] - 1
    _expect("cu_rows", cu_rows, np.int32, (num_reqs + 1,))
    if not _cu_rows_ok(cu_rows, num_rows):
        raise ValueError(_VALUE_ERRORS[5])
    num_drafts = num_rows - num_reqs
    _expect("draft_ids", draft_ids, np.int32, (num_drafts,))
    _expect("has_draft_probs", has_draft_probs, np.bool_, (num_reqs,))
    probs_rows = num_drafts if has_draft_probs.any() else draft_probs.shape[0]
    if probs_rows not in (0, num_drafts):
        raise ValueError("draft_probs: expected [num_rows - num_reqs, vocab] or [0, vocab]")
    _expect("draft_probs", draft_probs, np.float32, (probs_rows, vocab))
    for name, array, dtype in (("temperature", temperature, np.float32), ("top_p", top_p, np.float32),
                               ("top_k", top_k, np.int32), ("strategy", strategy, np.int32),
                               ("out_num_accepted", out_num_accepted, np.int32)):
        _expect(name, array, dtype, (num_reqs,))
    _expect("uniforms", uniforms, np.float64, (num_rows, 2))
    _expect("out_token_ids", out_token_ids, np.int32, (num_rows,))
    _check_values(num_rows, vocab, cu_rows, draft_ids, temperature, top_p, top_k, strategy, policy)


def _check_values(num_rows, vocab, cu_rows, draft_ids, temperature, top_p, top_k, strategy, policy) -> None:
    """The values every caller is checked on: those a bad proposer or request could get wrong."""
    error = _VALUE_ERRORS[_bad_value(num_rows, vocab, cu_rows, draft_ids, temperature, top_p, top_k, strategy)]
    if error is not None:
        raise ValueError(error)
    if policy not in (NORMAL, ACCEPT_ALL, REJECT_ALL):
        raise ValueError("policy: must be NORMAL, ACCEPT_ALL or REJECT_ALL")


def target_probs(logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """p for each row of `logits` [num_rows, vocab] -> [num_rows, vocab] float64 (T == 0: one-hot)."""
    logits = np.ascontiguousarray(logits, dtype=np.float32)
    probs = np.zeros(logits.shape, dtype=np.float64)
    for i in range(logits.shape[0]):
        if temperature == 0:
            probs[i, argmax(logits[i])] = 1.0
        else:
            total = target_mass(logits[i], float(temperature), int(top_k), float(top_p), probs[i])
            probs[i] /= total
    return probs
