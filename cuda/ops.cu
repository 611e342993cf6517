// Small per-row kernels of the forward pass: token metadata, embedding gather, RMSNorm (+residual),
// RoPE on adjacent pairs fused with the paged KV write, SwiGLU.
//
// Shapes use B = the launch capacity (the token count, padded up to a CUDA-graph size); the live
// counts come from device memory (`sizes`), so one captured graph serves every batch up to B.
// Each row is computed by one block with a fixed reduction order, so a row's result never
// depends on B or on the other rows (batch invariance). `T` is the activation type that feeds
// the weight products: float, __half or __nv_bfloat16; the residual stream stays float32.
#include "common.cuh"

// sizes: [0] num_reqs, [1] num_tokens (inputs); [2] num_tiles (written here).
// A tile is up to q_tile consecutive tokens of one request: the unit of append attention.
extern "C" __global__ void build_meta(
    const int* __restrict__ cu_q,          // [num_reqs + 1]
    const int* __restrict__ seq_lens,      // [num_reqs] context length after the append
    const int* __restrict__ block_tables,  // [num_reqs, max_blocks_per_seq]
    int max_blocks_per_seq, int block_size, int q_tile, int capacity,
    int* __restrict__ sizes,               // [4]
    int* __restrict__ cu_tiles,            // [max_num_seqs + 1] scratch
    int* __restrict__ req_of_token,        // [B] (-1 = padding)
    int* __restrict__ positions,           // [B] (-1 = padding)
    int* __restrict__ slot_mapping,        // [B] (-1 = padding: no KV write)
    int* __restrict__ tile_req, int* __restrict__ tile_tok0, int* __restrict__ tile_ntok)  // [B]
{
    const int num_reqs = sizes[0];
    if (threadIdx.x == 0) {
        int run = 0;
        for (int r = 0; r < num_reqs; ++r) {
            cu_tiles[r] = run;
            run += (cu_q[r + 1] - cu_q[r] + q_tile - 1) / q_tile;
        }
        cu_tiles[num_reqs] = run;
        sizes[2] = run;
    }
    __syncthreads();
    const int num_tokens = cu_q[num_reqs];
    for (int t = num_tokens + threadIdx.x; t < capacity; t += blockDim.x) {
        req_of_token[t] = -1;
        positions[t] = -1;
        slot_mapping[t] = -1;
    }
    for (int r = 0; r < num_reqs; ++r) {
        const int t0 = cu_q[r], n = cu_q[r + 1] - t0, start = seq_lens[r] - n;
        const int* table = block_tables + (size_t)r * max_blocks_per_seq;
        for (int j = threadIdx.x; j < n; j += blockDim.x) {
            const int pos = start + j;
            req_of_token[t0 + j] = r;
            positions[t0 + j] = pos;
            slot_mapping[t0 + j] = table[pos / block_size] * block_size + pos % block_size;
        }
        const int tile0 = cu_tiles[r], num_tiles = cu_tiles[r + 1] - tile0;
        for (int k = threadIdx.x; k < num_tiles; k += blockDim.x) {
            tile_req[tile0 + k] = r;
            tile_tok0[tile0 + k] = t0 + k * q_tile;
            tile_ntok[tile0 + k] = min(q_tile, n - k * q_tile);
        }
    }
}

// x[t] = table[token_ids[t]]; padding rows (t >= num_tokens) embed token 0 so they stay finite.
template <typename T>
__device__ void embed_rows(const T* __restrict__ table, const int* __restrict__ token_ids,
                           const int* __restrict__ sizes, float* __restrict__ x, int hidden) {
    const int t = blockIdx.x;
    const size_t id = t < sizes[1] ? (size_t)token_ids[t] : 0;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x)
        x[(size_t)t * hidden + i] = to_f32(table[id * hidden + i]);
}

// out[row] = x[row] / rms(x[row]) * weight; with `delta`, first x[row] += delta[row] (residual).
template <typename T>
__device__ void add_rms_norm(float* __restrict__ x, const float* __restrict__ delta,
                             const float* __restrict__ weight, float eps, T* __restrict__ out, int hidden) {
    __shared__ float red[33];
    float* xr = x + (size_t)blockIdx.x * hidden;
    float acc = 0.0f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        float v = xr[i];
        if (delta != nullptr) {
            v += delta[(size_t)blockIdx.x * hidden + i];
            xr[i] = v;
        }
        acc += v * v;
    }
    const float inv = 1.0f / sqrtf(block_sum(acc, red) / (float)hidden + eps);
    for (int i = threadIdx.x; i < hidden; i += blockDim.x)
        out[(size_t)blockIdx.x * hidden + i] = from_f32<T>(xr[i] * inv * weight[i]);
}

// Final norm of the rows that get logits: out[i] = rms_norm(x[src] + delta[src]), src = logits_indices[i].
template <typename T>
__device__ void final_norm(const float* __restrict__ x, const float* __restrict__ delta,
                           const int* __restrict__ logits_indices, const float* __restrict__ weight,
                           float eps, T* __restrict__ out, int hidden) {
    __shared__ float red[33];
    const size_t src = (size_t)logits_indices[blockIdx.x] * hidden;
    float acc = 0.0f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        const float v = x[src + i] + delta[src + i];
        acc += v * v;
    }
    const float inv = 1.0f / sqrtf(block_sum(acc, red) / (float)hidden + eps);
    for (int i = threadIdx.x; i < hidden; i += blockDim.x)
        out[(size_t)blockIdx.x * hidden + i] = from_f32<T>((x[src + i] + delta[src + i]) * inv * weight[i]);
}

// out[t, i] = silu(gate[t, i]) * up[t, i]; gate_up: [B, 2 * inter] (gate | up), out: [B, inter].
template <typename T>
__device__ void swiglu(const float* __restrict__ gate_up, T* __restrict__ out, int inter) {
    const int t = blockIdx.x, i = blockIdx.y * blockDim.x + threadIdx.x;
    if (i >= inter) return;
    const float g = gate_up[(size_t)t * 2 * inter + i];
    out[(size_t)t * inter + i] = from_f32<T>(g / (1.0f + expf(-g)) * gate_up[(size_t)t * 2 * inter + inter + i]);
}

#define STAMP_OPS(SUFFIX, T)                                                                         \
    extern "C" __global__ void embed_rows_##SUFFIX(const T* table, const int* token_ids,             \
                                                   const int* sizes, float* x, int hidden) {         \
        embed_rows<T>(table, token_ids, sizes, x, hidden);                                           \
    }                                                                                                \
    extern "C" __global__ void rms_norm_##SUFFIX(float* x, const float* weight, float eps, T* out,   \
                                                 int hidden) {                                       \
        add_rms_norm<T>(x, nullptr, weight, eps, out, hidden);                                       \
    }                                                                                                \
    extern "C" __global__ void add_rms_norm_##SUFFIX(float* x, const float* delta, const float* weight, \
                                                     float eps, T* out, int hidden) {                \
        add_rms_norm<T>(x, delta, weight, eps, out, hidden);                                         \
    }                                                                                                \
    extern "C" __global__ void final_norm_##SUFFIX(const float* x, const float* delta,               \
                                                   const int* logits_indices, const float* weight,   \
                                                   float eps, T* out, int hidden) {                  \
        final_norm<T>(x, delta, logits_indices, weight, eps, out, hidden);                           \
    }                                                                                                \
    extern "C" __global__ void swiglu_##SUFFIX(const float* gate_up, T* out, int inter) {            \
        swiglu<T>(gate_up, out, inter);                                                              \
    }

STAMP_OPS(f32, float)
STAMP_OPS(f16, __half)
STAMP_OPS(bf16, __nv_bfloat16)

// RoPE on adjacent pairs (2i, 2i+1) of the q and k heads (GGUF's permuted Q/K rows), then the
// rotated k and the v of each token go to its cache slot. q is rotated in place in qkv (float32).
// qkv: [B, (num_heads + 2 * num_kv_heads) * head_dim]; cos/sin: [max_pos, rope_dim / 2];
// k_cache/v_cache (one layer): [num_blocks, block_size, num_kv_heads, head_dim] of KV.
template <typename KV>
__device__ void rope_write_kv(float* __restrict__ qkv, const int* __restrict__ positions,
                              const int* __restrict__ slot_mapping, const float* __restrict__ cos_table,
                              const float* __restrict__ sin_table, KV* __restrict__ k_cache,
                              KV* __restrict__ v_cache, int num_heads, int num_kv_heads, int head_dim, int rope_dim) {
    const int t = blockIdx.x, pos = positions[t];
    if (pos < 0) return;  // padding row
    const int half_hd = head_dim / 2, half_rope = rope_dim / 2;
    const int qkv_dim = (num_heads + 2 * num_kv_heads) * head_dim;
    const int num_pairs = (num_heads + 2 * num_kv_heads) * half_hd;
    const size_t slot = (size_t)slot_mapping[t];
    float* row = qkv + (size_t)t * qkv_dim;
    for (int p = threadIdx.x; p < num_pairs; p += blockDim.x) {
        const int h = p / half_hd, c = p % half_hd, idx = h * head_dim + 2 * c;
        float a = row[idx], b = row[idx + 1];
        if (h < num_heads + num_kv_heads && c < half_rope) {
            const float co = cos_table[(size_t)pos * half_rope + c], si = sin_table[(size_t)pos * half_rope + c];
            const float ra = a * co - b * si, rb = a * si + b * co;
            a = ra;
            b = rb;
        }
        if (h < num_heads) {
            row[idx] = a;
            row[idx + 1] = b;
        } else {
            const bool is_k = h < num_heads + num_kv_heads;
            const int kvh = is_k ? h - num_heads : h - num_heads - num_kv_heads;
            KV* dst = (is_k ? k_cache : v_cache) + (slot * num_kv_heads + kvh) * head_dim + 2 * c;
            dst[0] = from_f32<KV>(a);
            dst[1] = from_f32<KV>(b);
        }
    }
}

#define STAMP_ROPE(SUFFIX, KV)                                                                       \
    extern "C" __global__ void rope_write_kv_##SUFFIX(float* qkv, const int* positions,              \
                                                      const int* slot_mapping, const float* cos_table, \
                                                      const float* sin_table, KV* k_cache, KV* v_cache, \
                                                      int num_heads, int num_kv_heads, int head_dim, \
                                                      int rope_dim) {                                \
        rope_write_kv<KV>(qkv, positions, slot_mapping, cos_table, sin_table, k_cache, v_cache,      \
                          num_heads, num_kv_heads, head_dim, rope_dim);                              \
    }

STAMP_ROPE(f32, float)
STAMP_ROPE(f16, __half)
