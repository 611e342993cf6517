"""Numba kernels behind `engine.spec_decode.verify`: the target distribution p of a row, sampling, and the
per-request verification loop. See engine/spec_decode/verify.py for the maths.

All of them live in this one file on purpose: Numba's on-disk cache is invalidated only when the
file defining a cached function changes, not when a jitted function it calls from another file
does, so splitting these kernels across files would let stale machine code survive an edit.

p = softmax(logits / T), restricted to the top_k logits, then to the nucleus (the smallest set, by
descending probability, with mass >= top_p), renormalised; ties -> lowest id first. The kernels
work on unnormalised mass (float64) and its sum Z, so p = mass / Z: one O(vocab) pass of exp per
row. top_k and top_p stay O(vocab): tokens are bucketed by logit and only the bucket where the
cut falls is sorted.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from engine.kernels.simd import f32_hmax, f32_max, f32_mul, f32_splat, row_f32

GREEDY, TARGET_MATCH, TOPP, REJECTION = 0, 1, 2, 3
NORMAL, ACCEPT_ALL, REJECT_ALL = 0, 1, 2
_ACCEPT, _SAMPLE = 0, 1  # columns of `uniforms`


@njit(cache=True)
def argmax(row):
    """The first index of the row's largest value: ties keep the lowest id, a NaN never wins (but a NaN at
    index 0 gives 0, as a scan from index 0 with a strict comparison would). The maximum comes from
    vector lanes (_extreme), then the first 16-element chunk holding it is found with vector compares:
    7 against 52 us for a 49,152-logit row by a scalar scan (Xeon, avx512), once per verified row."""
    if not row[0] == row[0]:
        return 0
    top = np.float32(_extreme(row, np.float32(1.0)))
    n = row.shape[0]
    c = 0
    while c + 16 <= n and not _holds(row, c, top):
        c += 16
    for v in range(c, n):
        if row[v] == top:
            return v
    return 0  # unreachable: row[0] is a number, so the maximum is one of the row's values


@njit(cache=True, inline="always")
def _holds(row, c, top):
    """Whether row[c : c + 16] holds `top` (one vector compare and an or-reduction)."""
    hit = False
    for j in range(16):
        hit |= row[c + j] == top
    return hit


_NUM_BUCKETS = 1024


@njit(cache=True)
def _bucket_by_logit(row, mass, peak, low, bucket):
    # bucket[v]: 0 for the highest logits .. _NUM_BUCKETS - 1 just above `low`; -1 below `low` or
    # already excluded. Monotone in the logit, so a lower bucket never holds a higher logit: only
    # the one bucket where a cut falls has to be sorted.
    per_width = _NUM_BUCKETS / (peak - low) if peak > low else 0.0  # a product by a positive constant is monotone
    for v in range(row.shape[0]):
        x = np.float64(row[v])
        if x < low or mass[v] == 0.0:
            bucket[v] = -1
        else:
            bucket[v] = min(int((peak - x) * per_width), _NUM_BUCKETS - 1)


@njit(cache=True)
def _sorted_bucket(bucket, b, key):
    # Ids in bucket b by descending key; a stable sort keeps ties in ascending id order.
    ids = np.empty(bucket.shape[0], dtype=np.int64)
    n = 0
    for v in range(bucket.shape[0]):
        if bucket[v] == b:
            ids[n] = v
            n += 1
    ids = ids[:n]
    return ids[np.argsort(-key[ids], kind="mergesort")]


@njit(cache=True)
def _keep_top_k(row, mass, top_k, peak, bucket):
    # Zero the mass outside the top_k logits; ties at the cut keep the lowest ids.
    _bucket_by_logit(row, mass, peak, _extreme(row, np.float32(-1.0)), bucket)
    counts = np.zeros(_NUM_BUCKETS, dtype=np.int64)
    for v in range(row.shape[0]):
        counts[bucket[v]] += 1
    before, cut = 0, 0
    for cut in range(_NUM_BUCKETS):
        if before + counts[cut] >= top_k:
            break
        before += counts[cut]
    order = _sorted_bucket(bucket, cut, row)  # float32 logits sort as their float64 values do
    for v in range(row.shape[0]):
        if bucket[v] > cut:
            mass[v] = 0.0
    for i in range(top_k - before, order.shape[0]):
        mass[order[i]] = 0.0


@njit(cache=True)
def _keep_nucleus(row, mass, total, top_p, peak, temperature, bucket):
    # Keep the shortest prefix, by descending p (ties -> lowest id), whose mass reaches top_p.
    # Every kept token has p > (1 - top_p) / vocab (the ranks after the last kept one hold mass
    # > 1 - top_p in <= vocab tokens), i.e. a logit above `low`: the rest are dropped unsorted.
    vocab = row.shape[0]
    low = peak + temperature * np.log((1.0 - top_p) / vocab * total) - 1e-9 * temperature
    _bucket_by_logit(row, mass, peak, low, bucket)
    bucket_mass = np.zeros(_NUM_BUCKETS)
    for v in range(vocab):
        if bucket[v] >= 0:
            bucket_mass[bucket[v]] += mass[v]
    target = top_p * total
    cum, cut = 0.0, 0
    for cut in range(_NUM_BUCKETS):
        if cum + bucket_mass[cut] >= target:
            break
        cum += bucket_mass[cut]
    order = _sorted_bucket(bucket, cut, mass)
    num_kept = order.shape[0]
    for i in range(order.shape[0]):
        cum += mass[order[i]]
        if cum >= target:
            num_kept = i + 1
            break
    for i in range(num_kept, order.shape[0]):
        mass[order[i]] = 0.0
    for v in range(vocab):
        if bucket[v] < 0 or bucket[v] > cut:
            mass[v] = 0.0
    return _sum8(mass)


# exp(z) for z <= 0 in float64 without a libm call, so that the loop over the vocabulary runs as vector code
# (np.exp there is a scalar call: target_mass took 237 us for a 49,152-logit row on the Xeon, 105 us with
# this): z = n ln2 + r, |r| <= ln2 / 2, e**r by its Taylor series to r**13
# (truncation < 1e-16), times 2**n built from its bits. Below _EXP_MIN (e**-708 ~ 3e-308) the mass is 0.
_LOG2E, _LN2_HI, _LN2_LO = 1.4426950408889634, 6.93147180369123816490e-01, 1.90821492927058770002e-10
_EXP_MIN = -708.0
_C2, _C3, _C4, _C5, _C6, _C7, _C8, _C9, _C10, _C11, _C12, _C13 = (1.0 / math.factorial(k) for k in range(2, 14))
_CHUNK = 256  # elements whose 2**n bits wait in a small buffer (L1) before the multiply


@njit(cache=True)
def _extreme(row, sign):
    """The largest (sign 1) or smallest (sign -1) logit, NaN ignored (a NaN never compares larger), in 4 x 16
    vector lanes (simd intrinsics; the same value in any order: 6 against 26 us for a 49,152-logit row by 8
    scalar lanes, Xeon, avx512). `row` is a contiguous float32 row."""
    s = f32_splat(sign, 1)
    a = f32_splat(np.float32(-np.inf), 1)
    b, c, d = a, a, a
    n = row.shape[0]
    n64 = n - n % 64
    for v in range(0, n64, 64):  # f32_max(x, acc): x only where x > acc, so a NaN x leaves acc as it was
        a = f32_max(f32_mul(row_f32(row, v), s), a)
        b = f32_max(f32_mul(row_f32(row, v + 16), s), b)
        c = f32_max(f32_mul(row_f32(row, v + 32), s), c)
        d = f32_max(f32_mul(row_f32(row, v + 48), s), d)
    best = f32_hmax(f32_max(f32_max(a, b), f32_max(c, d)))
    for v in range(n64, n):
        x = row[v] * sign  # exact
        best = x if x > best else best
    return np.float64(best * sign)


@njit(cache=True)
def _exp_into(row, peak, inv_t, mass, bits):
    """mass[v] = e**((row[v] - peak) * inv_t) for every v of row (len(row) <= len(bits); loops from 0, so
    the indices are known not to wrap around and the loop runs as vector code)."""
    for v in range(row.shape[0]):
        z = (np.float64(row[v]) - peak) * inv_t
        zc = z if z > _EXP_MIN else _EXP_MIN
        n = np.rint(zc * _LOG2E)
        r = (zc - n * _LN2_HI) - n * _LN2_LO
        p = ((((_C13 * r + _C12) * r + _C11) * r + _C10) * r + _C9) * r + _C8
        p = (((((p * r + _C7) * r + _C6) * r + _C5) * r + _C4) * r + _C3) * r + _C2
        mass[v] = ((p * r * r + r) + 1.0) if z > _EXP_MIN else 0.0
        bits[v] = np.int64(np.int32(n) + 1023) << 52  # 2**n: n in -1021..0
    scale = bits.view(np.float64)
    for v in range(row.shape[0]):
        mass[v] *= scale[v]


@njit(cache=True)
def _sum8(mass):
    """Sum in 8 interleaved partial sums (independent chains; a fixed order, so the same bits on every CPU)."""
    parts = np.zeros(8)
    n8 = mass.shape[0] // 8 * 8
    for v in range(0, n8, 8):
        for j in range(8):
            parts[j] += mass[v + j]
    total = parts.sum()
    for v in range(n8, mass.shape[0]):
        total += mass[v]
    return total


@njit(cache=True)
def target_mass(row, temperature, top_k, top_p, mass):
    """Unnormalised p into mass[:] (float64); returns its sum Z, so p = mass / Z."""
    vocab = row.shape[0]
    peak = _extreme(row, np.float32(1.0))
    inv_t = 1.0 / temperature
    bits = np.empty(_CHUNK, dtype=np.int64)
    for lo in range(0, vocab, _CHUNK):
        _exp_into(row[lo : lo + _CHUNK], peak, inv_t, mass[lo : lo + _CHUNK], bits)
    total = _sum8(mass)
    if (0 < top_k < vocab) or top_p < 1.0:
        bucket = np.empty(vocab, dtype=np.int64)
        if 0 < top_k < vocab:
            _keep_top_k(row, mass, top_k, peak, bucket)
            total = _sum8(mass)
        if top_p < 1.0:
            total = _keep_nucleus(row, mass, total, top_p, peak, temperature, bucket)
    return total


@njit(cache=True)
def sample(mass, total, u):
    # Inverse CDF over ids: the first id whose cumulative mass exceeds u * Z.
    target = u * total
    cum = 0.0
    last = 0
    for v in range(mass.shape[0]):
        if mass[v] > 0.0:
            cum += mass[v]
            last = v
            if cum > target:
                return v
    return last  # u * Z rounded past the end


@njit(cache=True)
def _sample_residual(mass, total, q_row, has_q, draft_id, u):
    # Residual r = max(0, p - q), normalised; for one-hot q it is p with the draft removed.
    vocab = mass.shape[0]
    if not has_q:  # p without the draft: two vector-friendly passes instead of a division per id
        p_draft, mass[draft_id] = mass[draft_id], 0.0
        rest = _sum8(mass)
        token = sample(mass, rest, u) if rest > 0.0 else -1
        mass[draft_id] = p_draft
        return token if token >= 0 else sample(mass, total, u)
    r_total = 0.0
    for v in range(vocab):
        r = mass[v] / total - q_row[v]
        if r > 0.0:
            r_total += r
    if r_total <= 0.0:  # p == q up to rounding: rejection was (almost) impossible
        return sample(mass, total, u)
    target = u * r_total
    cum = 0.0
    last = 0
    for v in range(vocab):
        r = mass[v] / total - q_row[v]
        if r > 0.0:
            cum += r
            last = v
            if cum > target:
                return v
    return last


@njit(cache=True)
def _in_candidates(mass, total, draft_id, max_candidate_len, verify_top_p):
    # Rank of the draft in p (ties -> lowest id first) and the mass ranked above it; O(vocab).
    p_draft = mass[draft_id]
    if p_draft <= 0.0:
        return False
    rank = 0
    above = 0.0
    for v in range(mass.shape[0]):
        if mass[v] > p_draft or (mass[v] == p_draft and v < draft_id):
            rank += 1
            above += mass[v]
    return rank < max_candidate_len and above < verify_top_p * total


@njit(cache=True)
def _plain_token(row, is_greedy, temperature, top_k, top_p, mass, u):
    # The token decoding without speculation would emit here: the bonus, or REJECT_ALL's token.
    if is_greedy:
        return argmax(row)
    return sample(mass, target_mass(row, temperature, top_k, top_p, mass), u)


@njit(cache=True)
def _verify_request(logits, row0, num_drafts, draft_ids, draft0, draft_probs, has_q, temperature,
                    top_p, top_k, strategy, policy, uniforms, max_candidate_len, verify_top_p,
                    out_token_ids):
    """Verify one request's drafts (rows row0 .. row0 + num_drafts); returns num_accepted."""
    vocab = logits.shape[1]
    mass = np.empty(vocab, dtype=np.float64)  # unnormalised p of the current row
    no_q = np.zeros(1, dtype=np.float32)
    is_greedy = strategy == GREEDY or temperature == 0.0
    for i in range(num_drafts):
        row = row0 + i
        x = draft_ids[draft0 + i]
        if policy == ACCEPT_ALL:
            out_token_ids[row] = x
            continue
        if policy == REJECT_ALL:
            out_token_ids[row] = _plain_token(logits[row], is_greedy, temperature, top_k, top_p,
                                              mass, uniforms[row, _SAMPLE])
            return 0
        if is_greedy:
            y = argmax(logits[row])
            if y != x:
                out_token_ids[row] = y  # recovered
                return i
            out_token_ids[row] = x
            continue
        total = target_mass(logits[row], temperature, top_k, top_p, mass)
        u_sample = uniforms[row, _SAMPLE]
        if strategy == TARGET_MATCH:
            y = sample(mass, total, u_sample)
            if y != x:
                out_token_ids[row] = y  # recovered: a plain sample of p
                return i
        elif strategy == TOPP:
            if not _in_candidates(mass, total, x, max_candidate_len, verify_top_p):
                out_token_ids[row] = sample(mass, total, u_sample)
                return i
        else:  # REJECTION: accept iff u * q(x) < p(x), i.e. with probability min(1, p(x)/q(x))
            q_row = draft_probs[draft0 + i] if has_q else no_q
            q_x = q_row[x] if has_q else 1.0
            if not uniforms[row, _ACCEPT] * q_x < mass[x] / total:
                out_token_ids[row] = _sample_residual(mass, total, q_row, has_q, x, u_sample)
                return i
        out_token_ids[row] = x
    row = row0 + num_drafts  # every draft accepted: the bonus comes from the last row
    out_token_ids[row] = _plain_token(logits[row], is_greedy, temperature, top_k, top_p, mass,
                                      uniforms[row, _SAMPLE])
    return num_drafts


@njit(cache=True)
def _verify_slot(r, logits, cu_rows, draft_ids, draft_probs, has_draft_probs, temperature, top_p,
                 top_k, strategy, policy, uniforms, max_candidate_len, verify_top_p,
                 out_token_ids, out_num_accepted):
    row0 = cu_rows[r]
    num_drafts = cu_rows[r + 1] - row0 - 1
    draft0 = row0 - r  # request r's drafts start after the r earlier requests' drafts
    out_num_accepted[r] = _verify_request(
        logits, row0, num_drafts, draft_ids, draft0, draft_probs, has_draft_probs[r],
        np.float64(temperature[r]), np.float64(top_p[r]), top_k[r], strategy[r], policy,
        uniforms, max_candidate_len, verify_top_p, out_token_ids)


# Each request owns its rows, drafts and outputs, so requests run independently. A parallel
# region costs tens of microseconds to start (milliseconds when another process holds a core),
# so small batches run serially.
@njit(cache=True)
def verify_serial(*args):
    for r in range(args[1].shape[0] - 1):
        _verify_slot(r, *args)


@njit(parallel=True, cache=True)
def verify_parallel(*args):
    for r in prange(args[1].shape[0] - 1):
        _verify_slot(r, *args)
