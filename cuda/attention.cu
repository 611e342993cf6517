// Append attention over the paged KV cache for a ragged batch, with a split-KV path.
//
// Each request appends a run of tokens on top of its cached prefix; a query at absolute position
// p attends to keys 0..p of its own request (the cached prefix and the run up to itself). The
// keys are cut into fixed partitions of `partition_size` positions; block (tile, kv_head, split)
// scores the queries of one tile (up to q_tile tokens x the `group` q heads that share kv_head,
// i.e. GQA) against one partition, with an online softmax over 32-key tiles staged in shared
// memory. A query whose keys fit in one partition writes its output directly; longer ones write
// (acc, max, sum) partials that attention_merge combines. The partitioning depends only on the
// query's own position, so its result never depends on the batch, the tile it sits in or the
// number of splits launched: speculative verification reproduces plain decoding bit for bit.
#include "common.cuh"

#define KEY_TILE 32
#define ATTN_WARPS 4
#define ROWS_PER_WARP 4
#define MAX_ROWS (ATTN_WARPS * ROWS_PER_WARP)  // query vectors per block: q_tile * group <= 16

// VEC cache elements (16 aligned bytes: head_dim * sizeof(KV) is a multiple of 16) -> float.
template <typename KV, int VEC>
__device__ __forceinline__ void load_vec(const KV* __restrict__ src, float (&dst)[VEC]) {
    const uint4 raw = *reinterpret_cast<const uint4*>(src);
    const KV* e = reinterpret_cast<const KV*>(&raw);
#pragma unroll
    for (int i = 0; i < VEC; ++i) dst[i] = to_f32(e[i]);
}

template <int HD, typename T, typename KV>
__device__ void append_attention(
    const float* __restrict__ qkv,        // [B, (num_heads + 2 * num_kv_heads) * HD], q rotated
    const KV* __restrict__ k_cache,       // [num_blocks, block_size, num_kv_heads, HD] (one layer)
    const KV* __restrict__ v_cache,
    const int* __restrict__ block_tables, const int* __restrict__ positions, const int* __restrict__ sizes,
    const int* __restrict__ tile_req, const int* __restrict__ tile_tok0, const int* __restrict__ tile_ntok,
    int max_blocks_per_seq, int num_heads, int num_kv_heads, int block_size, int partition_size,
    int max_splits, float scale,
    T* __restrict__ out,                  // [B, num_heads * HD]
    float* __restrict__ part_acc,         // [B, num_heads, max_splits, HD]
    float* __restrict__ part_ml)          // [B, num_heads, max_splits, 2] (max, sum)
{
    constexpr int DPL = HD / 32;              // output dims per lane
    constexpr int VEC = 16 / (int)sizeof(KV);  // cache elements per 16-byte load
    __shared__ float q_s[MAX_ROWS][HD];
    __shared__ float k_s[KEY_TILE][HD + 1];  // +1: lane j reads row j without bank conflicts
    __shared__ float v_s[KEY_TILE][HD];
    const int tile = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z;
    if (tile >= sizes[2]) return;
    const int r = tile_req[tile], tok0 = tile_tok0[tile], ntok = tile_ntok[tile];
    const int group = num_heads / num_kv_heads, num_rows = ntok * group;
    const int last_pos = positions[tok0 + ntok - 1];
    const int k_begin = split * partition_size;
    if (k_begin > last_pos) return;
    const int k_end = min(k_begin + partition_size, last_pos + 1);
    const size_t qkv_dim = (size_t)(num_heads + 2 * num_kv_heads) * HD;
    for (int idx = threadIdx.x; idx < num_rows * HD; idx += blockDim.x) {
        const int i = idx / HD, d = idx % HD;  // row i: token tok0 + i / group, head kvh * group + i % group
        q_s[i][d] = qkv[(size_t)(tok0 + i / group) * qkv_dim + (kvh * group + i % group) * HD + d];
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float acc[ROWS_PER_WARP][DPL], m[ROWS_PER_WARP], l[ROWS_PER_WARP];
    int pos[ROWS_PER_WARP];
#pragma unroll
    for (int rr = 0; rr < ROWS_PER_WARP; ++rr) {
        const int row = warp + rr * ATTN_WARPS;
        pos[rr] = row < num_rows ? positions[tok0 + row / group] : -1;
        m[rr] = NEG_INF;
        l[rr] = 0.0f;
#pragma unroll
        for (int c = 0; c < DPL; ++c) acc[rr][c] = 0.0f;
    }
    const int* table = block_tables + (size_t)r * max_blocks_per_seq;
    const size_t slot_stride = (size_t)num_kv_heads * HD;
    for (int k0 = k_begin; k0 < k_end; k0 += KEY_TILE) {
        __syncthreads();  // q_s written / the previous key tile consumed
        for (int idx = threadIdx.x; idx < KEY_TILE * HD / VEC; idx += blockDim.x) {  // 16-byte loads
            const int j = idx / (HD / VEC), d0 = (idx % (HD / VEC)) * VEC, key = k0 + j;
            float kf[VEC], vf[VEC];
            if (key < k_end) {
                const size_t slot = (size_t)table[key / block_size] * block_size + key % block_size;
                const size_t off = slot * slot_stride + kvh * HD + d0;
                load_vec<KV, VEC>(k_cache + off, kf);
                load_vec<KV, VEC>(v_cache + off, vf);
            } else {
#pragma unroll
                for (int e = 0; e < VEC; ++e) kf[e] = vf[e] = 0.0f;
            }
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
                k_s[j][d0 + e] = kf[e];
                v_s[j][d0 + e] = vf[e];
            }
        }
        __syncthreads();
#pragma unroll
        for (int rr = 0; rr < ROWS_PER_WARP; ++rr) {
            const int row = warp + rr * ATTN_WARPS;
            if (row >= num_rows) break;  // warp-uniform
            const bool valid = k0 + lane <= pos[rr];  // causal; partition_size % 32 == 0 keeps it < k_end
            float s = NEG_INF;
            if (valid) {
                float dot = 0.0f;
#pragma unroll 16
                for (int d = 0; d < HD; ++d) dot += q_s[row][d] * k_s[lane][d];
                s = dot * scale;
            }
            const float tile_max = warp_max(s);
            if (tile_max == NEG_INF) continue;  // no key of this tile is visible to the row
            const float new_m = fmaxf(m[rr], tile_max);
            const float corr = expf(m[rr] - new_m);
            const float p = valid ? expf(s - new_m) : 0.0f;
            l[rr] = l[rr] * corr + p;  // per-lane partial sum, reduced once at the end
#pragma unroll
            for (int c = 0; c < DPL; ++c) acc[rr][c] *= corr;
            for (int j = 0; j < KEY_TILE; ++j) {
                const float pj = __shfl_sync(FULL_MASK, p, j);
#pragma unroll
                for (int c = 0; c < DPL; ++c) acc[rr][c] += pj * v_s[j][lane + 32 * c];
            }
            m[rr] = new_m;
        }
    }
#pragma unroll
    for (int rr = 0; rr < ROWS_PER_WARP; ++rr) {
        const int row = warp + rr * ATTN_WARPS;
        if (row >= num_rows) break;
        const float lsum = warp_sum(l[rr]);
        if (pos[rr] < k_begin) continue;  // this partition lies beyond the row's position
        const size_t t = (size_t)(tok0 + row / group);
        const int h = kvh * group + row % group;
        if (pos[rr] / partition_size == 0) {  // one partition: final output
            const float inv = 1.0f / lsum;
#pragma unroll
            for (int c = 0; c < DPL; ++c)
                out[t * num_heads * HD + h * HD + lane + 32 * c] = from_f32<T>(acc[rr][c] * inv);
        } else {
            const size_t base = (t * num_heads + h) * max_splits + split;
#pragma unroll
            for (int c = 0; c < DPL; ++c) part_acc[base * HD + lane + 32 * c] = acc[rr][c];
            if (lane == 0) {
                part_ml[base * 2] = m[rr];
                part_ml[base * 2 + 1] = lsum;
            }
        }
    }
}

// out = sum_s e^(m_s - m) acc_s / sum_s e^(m_s - m) l_s over the row's partitions (m = max m_s).
// grid (B, num_heads), block HD threads: one output dim each.
template <int HD, typename T>
__device__ void attention_merge(const int* __restrict__ positions, const int* __restrict__ sizes,
                                const float* __restrict__ part_acc, const float* __restrict__ part_ml,
                                int num_heads, int partition_size, int max_splits, T* __restrict__ out) {
    const int t = blockIdx.x, h = blockIdx.y, d = threadIdx.x;
    if (t >= sizes[1] || d >= HD) return;
    const int pos = positions[t];
    const int num_splits = pos / partition_size + 1;
    if (pos < 0 || num_splits == 1) return;  // padding, or written by append_attention
    const size_t base = ((size_t)t * num_heads + h) * max_splits;
    float m = NEG_INF;
    for (int s = 0; s < num_splits; ++s) m = fmaxf(m, part_ml[(base + s) * 2]);
    float denom = 0.0f, acc = 0.0f;
    for (int s = 0; s < num_splits; ++s) {
        const float w = expf(part_ml[(base + s) * 2] - m);
        denom += w * part_ml[(base + s) * 2 + 1];
        acc += w * part_acc[(base + s) * HD + d];
    }
    out[(size_t)t * num_heads * HD + h * HD + d] = from_f32<T>(acc / denom);
}

// KV is the cache type: float in the float32 build (so it matches the CPU runner), fp16 otherwise.
#define STAMP_ATTENTION(HD, SUFFIX, T, KV)                                                           \
    extern "C" __global__ void __launch_bounds__(ATTN_WARPS * 32) append_attention_hd##HD##_##SUFFIX( \
        const float* qkv, const KV* k_cache, const KV* v_cache, const int* block_tables,             \
        const int* positions, const int* sizes, const int* tile_req, const int* tile_tok0,           \
        const int* tile_ntok, int max_blocks_per_seq, int num_heads, int num_kv_heads,               \
        int block_size, int partition_size, int max_splits, float scale, T* out, float* part_acc,    \
        float* part_ml) {                                                                            \
        append_attention<HD, T, KV>(qkv, k_cache, v_cache, block_tables, positions, sizes, tile_req, \
                                    tile_tok0, tile_ntok, max_blocks_per_seq, num_heads,             \
                                    num_kv_heads, block_size, partition_size, max_splits, scale,     \
                                    out, part_acc, part_ml);                                         \
    }                                                                                                \
    extern "C" __global__ void attention_merge_hd##HD##_##SUFFIX(                                    \
        const int* positions, const int* sizes, const float* part_acc, const float* part_ml,         \
        int num_heads, int partition_size, int max_splits, T* out) {                                 \
        attention_merge<HD, T>(positions, sizes, part_acc, part_ml, num_heads, partition_size,       \
                               max_splits, out);                                                     \
    }

STAMP_ATTENTION(64, f32, float, float)
STAMP_ATTENTION(64, f16, __half, __half)
STAMP_ATTENTION(64, bf16, __nv_bfloat16, __half)
STAMP_ATTENTION(128, f32, float, float)
STAMP_ATTENTION(128, f16, __half, __half)
STAMP_ATTENTION(128, bf16, __nv_bfloat16, __half)
