// Shared device helpers: activation types, conversions, deterministic warp/block reductions.
//
// Included textually by engine/gpu/build.py (read_source), so CuPy's source-hash cache sees
// every change to this header. Every reduction here combines values in a fixed order that
// depends only on blockDim, never on timing: results are bit-reproducible run to run.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#define FULL_MASK 0xffffffffu
#define NEG_INF (-__int_as_float(0x7f800000))

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

// Butterfly (xor) reductions: every lane ends with the same bits, because each level adds the
// same two partials (a + b == b + a exactly).
template <typename V> __device__ __forceinline__ V warp_sum(V v) {
    for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(FULL_MASK, v, m);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int m = 16; m > 0; m >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, m));
    return v;
}

// Sum over the block; `red` is shared scratch of >= 33 elements. Every thread gets the total.
template <typename V> __device__ V block_sum(V v, V* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    if (lane == 0) red[warp] = v;
    __syncthreads();
    if (warp == 0) {
        V w = lane < num_warps ? red[lane] : V(0);
        w = warp_sum(w);
        if (lane == 0) red[32] = w;
    }
    __syncthreads();
    V total = red[32];
    __syncthreads();  // red may be reused right away
    return total;
}

// Running sums over threads in thread order: prefix[t] = own_0 + ... + own_{t-1}, added one by
// one by a single thread, so prefix[] is exactly monotone for non-negative parts (a parallel scan
// adds in a different tree per lane and can be off by an ulp either way). `prefix` is shared
// scratch of blockDim.x + 1 elements; prefix[blockDim.x] is the block total.
template <typename V> __device__ void block_prefix(V own, V* prefix) {
    prefix[threadIdx.x + 1] = own;
    __syncthreads();
    if (threadIdx.x == 0) {
        V run = V(0);
        prefix[0] = run;
        for (int t = 1; t <= (int)blockDim.x; ++t) {
            run += prefix[t];
            prefix[t] = run;
        }
    }
    __syncthreads();
}

// Orders floats as unsigned ints: a > b  <=>  float_key(a) > float_key(b) (NaN aside).
__device__ __forceinline__ unsigned float_key(float x) {
    unsigned u = __float_as_uint(x);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
