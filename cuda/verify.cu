// Fused verification + sampling of drafts for the whole batch: one launch, one block per request.
// Same semantics, inputs and outputs as engine/verify.py (read its docstring for the maths):
//   GREEDY        accept while draft == argmax; first mismatch -> argmax (recovered).
//   TARGET_MATCH  accept while draft == a sample of p (inverse CDF with the row's sampling uniform).
//   TOPP          accept while the draft is among the max_candidate_len most probable tokens of p
//                 (and within mass verify_top_p); otherwise a sample of p.
//   REJECTION     accept x iff u * q(x) < p(x); on rejection sample max(0, p - q) normalised.
//   All accepted -> bonus from the last row. ACCEPT_ALL / REJECT_ALL are the debug policies.
// p = softmax(logits / T) cut to the top_k logits, then to the nucleus top_p (ties -> lowest id).
// The block never materialises p: a row's p is (peak, T, top-k cut, nucleus cut, Z), and each
// pass over the vocabulary recomputes the mass exp((logit - peak) / T) in double precision. Cuts
// are found by bisecting on the float's order key (32 deterministic block sums), so no sort and
// no vocabulary-sized scratch. Thread t owns the contiguous ids [t * chunk, (t + 1) * chunk), so
// id order is thread order and inverse-CDF sampling is a prefix over threads plus one walk.
#include "common.cuh"

#define GREEDY 0
#define TARGET_MATCH 1
#define TOPP 2
#define REJECTION 3
#define NORMAL 0
#define ACCEPT_ALL 1
#define REJECT_ALL 2
#define VERIFY_THREADS 512
#define NO_OWNER 0x7fffffff

struct Scratch {
    double red[33];
    float arg_val[32];
    int arg_id[32];
    int pick, owner;  // broadcast slots
};

struct Chunk {
    int begin, end;
    __device__ Chunk(int vocab) {
        const int chunk = (vocab + blockDim.x - 1) / blockDim.x;
        begin = min(vocab, (int)threadIdx.x * chunk);
        end = min(vocab, begin + chunk);
    }
};

template <class F> __device__ double sum_over_vocab(F w, int vocab, Scratch& s) {
    const Chunk c(vocab);
    double acc = 0.0;
    for (int v = c.begin; v < c.end; ++v) acc += w(v);
    return block_sum(acc, s.red);
}

// The first id v (in id order) where base + w(0) + ... + w(v) crosses target (> if strict, else >=);
// if rounding leaves nothing crossing, the last id with w > 0 (-1 if none). w must be >= 0.
template <class F>
__device__ int first_crossing(F w, int vocab, double base, double target, bool strict, Scratch& s) {
    const Chunk c(vocab);
    double own = 0.0;
    int last = -1;
    for (int v = c.begin; v < c.end; ++v) {
        const double x = w(v);
        own += x;
        if (x > 0.0) last = v;
    }
    if (threadIdx.x == 0) s.owner = NO_OWNER;
    double lo, hi;
    block_scan(own, s.red, &lo, &hi);  // syncs
    lo += base;
    hi += base;
    if (strict ? hi > target : hi >= target) atomicMin(&s.owner, (int)threadIdx.x);
    __syncthreads();
    const int owner = s.owner;
    if ((int)threadIdx.x == owner) {  // the first thread whose running sum crosses: walk its ids
        double cum = lo;
        int found = last;
        for (int v = c.begin; v < c.end; ++v) {
            cum += w(v);
            if (strict ? cum > target : cum >= target) { found = v; break; }
        }
        s.pick = found;
    }
    if (owner == NO_OWNER && threadIdx.x == 0) s.pick = -1;
    __syncthreads();
    int result = s.pick;
    __syncthreads();  // everyone has read s.pick before anyone changes it
    if (result < 0) {  // nothing crossed (rounding): fall back to the last positive id, a block max
        for (int m = 16; m > 0; m >>= 1) last = max(last, __shfl_xor_sync(FULL_MASK, last, m));
        if ((threadIdx.x & 31) == 0) atomicMax(&s.pick, last);
        __syncthreads();
        result = s.pick;
        __syncthreads();
    }
    return result;
}

// argmax with ties -> lowest id (as engine.verify_kernels.argmax).
__device__ __noinline__ int block_argmax(const float* row, int vocab, Scratch& s) {
    const Chunk c(vocab);
    float best = 0.0f;
    int best_id = -1;
    for (int v = c.begin; v < c.end; ++v)
        if (best_id < 0 || row[v] > best) { best = row[v]; best_id = v; }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
    for (int pass = 0; pass < 2; ++pass) {
        for (int m = 16; m > 0; m >>= 1) {
            const float ov = __shfl_xor_sync(FULL_MASK, best, m);
            const int oid = __shfl_xor_sync(FULL_MASK, best_id, m);
            if (oid >= 0 && (best_id < 0 || ov > best || (ov == best && oid < best_id))) { best = ov; best_id = oid; }
        }
        if (pass == 1) break;
        if (lane == 0) { s.arg_val[warp] = best; s.arg_id[warp] = best_id; }
        __syncthreads();
        best = lane < num_warps ? s.arg_val[lane] : 0.0f;
        best_id = lane < num_warps ? s.arg_id[lane] : -1;
    }
    if (threadIdx.x == 0) s.pick = best_id;
    __syncthreads();
    const int result = s.pick;
    __syncthreads();
    return result;
}

// A row's target distribution p, implicitly: mass(v) = kept(v) ? exp((logit - peak) / T) : 0.
struct Dist {
    const float* row;
    double peak, temperature, total;
    bool topk_on, topp_on;
    unsigned k_key, p_key;  // cut keys; ties at a cut are kept up to id k_id / p_id
    int k_id, p_id;

    __device__ double exp_mass(int v) const {
        const double z = ((double)row[v] - peak) / temperature;
        return z > -745.0 ? exp(z) : 0.0;  // exp underflows to 0 below -745 anyway
    }
    __device__ bool in_top_k(int v, unsigned key) const {
        return !topk_on || key > k_key || (key == k_key && v <= k_id);
    }
    __device__ bool in_nucleus(int v, unsigned key) const {
        return !topp_on || key > p_key || (key == p_key && v <= p_id);
    }
    __device__ double mass_top_k(int v) const { return in_top_k(v, float_key(row[v])) ? exp_mass(v) : 0.0; }
    __device__ double mass(int v) const {
        const unsigned key = float_key(row[v]);
        return in_top_k(v, key) && in_nucleus(v, key) ? exp_mass(v) : 0.0;
    }
};

// Largest key k with sum_{key(v) >= k} w(v) >= target (that sum is non-increasing in k).
template <class F>
__device__ unsigned bisect_key(F w, const float* row, int vocab, double target, Scratch& s) {
    unsigned k = 0;
    for (int bit = 31; bit >= 0; --bit) {
        const unsigned cand = k | (1u << bit);
        const double above = sum_over_vocab([&](int v) { return float_key(row[v]) >= cand ? w(v) : 0.0; }, vocab, s);
        if (above >= target) k = cand;
    }
    return k;
}

// Cut at `target` of weight w in (key desc, id asc) order: sets *key and *id of the last kept token.
template <class F>
__device__ void find_cut(F w, const float* row, int vocab, double target, unsigned* key, int* id, Scratch& s) {
    const unsigned k = bisect_key(w, row, vocab, target, s);
    const double above = k == 0xffffffffu ? 0.0
        : sum_over_vocab([&](int v) { return float_key(row[v]) > k ? w(v) : 0.0; }, vocab, s);
    const int tie = first_crossing([&](int v) { return float_key(row[v]) == k ? w(v) : 0.0; },
                                   vocab, above, target, false, s);
    *key = k;
    *id = tie >= 0 ? tie : vocab;
}

__device__ __noinline__ void make_dist(Dist& d, const float* row, int vocab, double temperature, int top_k, double top_p,
                          Scratch& s) {
    d.row = row;
    d.peak = (double)row[block_argmax(row, vocab, s)];
    d.temperature = temperature;
    d.topk_on = d.topp_on = false;
    if (0 < top_k && top_k < vocab) {
        find_cut([](int) { return 1.0; }, row, vocab, (double)top_k, &d.k_key, &d.k_id, s);
        d.topk_on = true;
    }
    if (top_p < 1.0) {
        const double z_top_k = sum_over_vocab([&](int v) { return d.mass_top_k(v); }, vocab, s);
        find_cut([&](int v) { return d.mass_top_k(v); }, row, vocab, top_p * z_top_k, &d.p_key, &d.p_id, s);
        d.topp_on = true;
    }
    d.total = sum_over_vocab([&](int v) { return d.mass(v); }, vocab, s);
}

__device__ __noinline__ int sample(const Dist& d, int vocab, double u, Scratch& s) {
    return first_crossing([&](int v) { return d.mass(v); }, vocab, 0.0, u * d.total, true, s);
}

// Residual r = max(0, p - q) normalised; q one-hot at the draft when the proposer gave no q.
__device__ __noinline__ int sample_residual(const Dist& d, int vocab, const float* q_row, int draft_id, double u, Scratch& s) {
    auto r = [&](int v) {
        const double q = q_row != nullptr ? (double)q_row[v] : (v == draft_id ? 1.0 : 0.0);
        const double x = d.mass(v) / d.total - q;
        return x > 0.0 ? x : 0.0;
    };
    const double r_total = sum_over_vocab(r, vocab, s);
    if (r_total <= 0.0) return sample(d, vocab, u, s);  // p == q up to rounding
    return first_crossing(r, vocab, 0.0, u * r_total, true, s);
}

// TOPP: the draft's rank in p (ties -> lowest id first) and the mass ranked above it.
__device__ __noinline__ bool in_candidates(const Dist& d, int vocab, int x, int max_candidate_len, double verify_top_p,
                              Scratch& s) {
    const double p_x = d.mass(x);
    if (p_x <= 0.0) return false;
    auto ranked_above = [&](int v, double m) { return m > p_x || (m == p_x && v < x); };
    const double rank = sum_over_vocab([&](int v) { return ranked_above(v, d.mass(v)) ? 1.0 : 0.0; }, vocab, s);
    const double above = sum_over_vocab([&](int v) { const double m = d.mass(v); return ranked_above(v, m) ? m : 0.0; },
                                        vocab, s);
    return rank < (double)max_candidate_len && above < verify_top_p * d.total;
}

// The token plain decoding would emit at this row: the bonus, or REJECT_ALL's token.
__device__ __noinline__ int plain_token(const float* row, int vocab, bool greedy, double temperature, int top_k, double top_p,
                           double u, Scratch& s) {
    if (greedy) return block_argmax(row, vocab, s);
    Dist d;
    make_dist(d, row, vocab, temperature, top_k, top_p, s);
    return sample(d, vocab, u, s);
}

extern "C" __global__ void __launch_bounds__(VERIFY_THREADS) verify_drafts(
    const float* __restrict__ logits,            // [num_rows, vocab]
    int vocab,
    const int* __restrict__ cu_rows,             // [num_reqs + 1]
    const int* __restrict__ draft_ids,           // [num_rows - num_reqs]
    const float* __restrict__ draft_probs,       // [num_rows - num_reqs, vocab] (or unused)
    const unsigned char* __restrict__ has_draft_probs,  // [num_reqs]
    const float* __restrict__ temperature, const float* __restrict__ top_p, const int* __restrict__ top_k,
    const int* __restrict__ strategy,            // [num_reqs]
    int policy,
    const double* __restrict__ uniforms,         // [num_rows, 2]: (accept test, sampling)
    int max_candidate_len, double verify_top_p,
    int* __restrict__ out_token_ids,             // [num_rows]
    int* __restrict__ out_num_accepted)          // [num_reqs]
{
    __shared__ Scratch s;
    const int r = blockIdx.x, row0 = cu_rows[r], num_drafts = cu_rows[r + 1] - row0 - 1, draft0 = row0 - r;
    const double temp = temperature[r], p_top = top_p[r];
    const int k_top = top_k[r], strat = strategy[r];
    const bool greedy = strat == GREEDY || temp == 0.0;
    int num_accepted = num_drafts;
    for (int i = 0; i < num_drafts; ++i) {
        const int row = row0 + i, x = draft_ids[draft0 + i];
        const float* lrow = logits + (size_t)row * vocab;
        const double u_accept = uniforms[2 * row], u_sample = uniforms[2 * row + 1];
        int emit = x;
        bool rejected = false;
        if (policy == REJECT_ALL) {
            emit = plain_token(lrow, vocab, greedy, temp, k_top, p_top, u_sample, s);
            rejected = true;
        } else if (policy == NORMAL && greedy) {
            const int y = block_argmax(lrow, vocab, s);
            rejected = y != x;
            emit = y;
        } else if (policy == NORMAL) {
            Dist d;
            make_dist(d, lrow, vocab, temp, k_top, p_top, s);
            if (strat == TARGET_MATCH) {
                emit = sample(d, vocab, u_sample, s);
                rejected = emit != x;
            } else if (strat == TOPP) {
                rejected = !in_candidates(d, vocab, x, max_candidate_len, verify_top_p, s);
                if (rejected) emit = sample(d, vocab, u_sample, s);
            } else {  // REJECTION: accept with probability min(1, p(x) / q(x))
                const float* q_row = has_draft_probs[r] ? draft_probs + (size_t)(draft0 + i) * vocab : nullptr;
                const double q_x = q_row != nullptr ? (double)q_row[x] : 1.0;
                rejected = !(u_accept * q_x < d.mass(x) / d.total);
                if (rejected) emit = sample_residual(d, vocab, q_row, x, u_sample, s);
            }
        }
        if (threadIdx.x == 0) out_token_ids[row] = emit;
        if (rejected) {
            num_accepted = i;
            break;
        }
    }
    if (num_accepted == num_drafts) {  // every draft accepted: the bonus comes from the last row
        const int row = row0 + num_drafts;
        const int bonus = plain_token(logits + (size_t)row * vocab, vocab, greedy, temp, k_top, p_top,
                                      uniforms[2 * row + 1], s);
        if (threadIdx.x == 0) out_token_ids[row] = bonus;
    }
    if (threadIdx.x == 0) out_num_accepted[r] = num_accepted;
}
