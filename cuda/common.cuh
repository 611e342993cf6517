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

// Running sums over threads in thread order, in parallel (warp scans, then the warp totals added
// one by one): thread t gets lo = own_0 + ... + own_{t-1} and hi = lo + own_t as computed, where
// t's hi is bitwise the lo of thread t + 1. Rounding may differ from a sequential sum, but the
// chain of [lo, hi) intervals has no gap or overlap, so "the first thread whose hi crosses x" is
// well defined and its lo does not cross. `scratch`: shared, >= 33 elements; blockDim % 32 == 0.
template <typename V> __device__ void block_scan(V own, V* scratch, V* lo, V* hi) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = (blockDim.x + 31) >> 5;
    V incl = own;
    for (int d = 1; d < 32; d <<= 1) {
        const V up = __shfl_up_sync(FULL_MASK, incl, d);
        if (lane >= d) incl += up;
    }
    V excl = __shfl_up_sync(FULL_MASK, incl, 1);
    if (lane == 0) excl = V(0);
    if (lane == 31) scratch[warp] = incl;
    __syncthreads();
    if (threadIdx.x == 0) {  // warp bases: base_{w+1} = base_w + total_w, the same op as a lane-31 hi
        V run = V(0);
        for (int w = 0; w < num_warps; ++w) {
            const V total = scratch[w];
            scratch[w] = run;
            run = run + total;
        }
    }
    __syncthreads();
    *lo = scratch[warp] + excl;
    *hi = scratch[warp] + incl;
    __syncthreads();  // scratch may be reused right away
}

// Orders floats as unsigned ints: a > b  <=>  float_key(a) > float_key(b) (NaN aside).
__device__ __forceinline__ unsigned float_key(float x) {
    unsigned u = __float_as_uint(x);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
