// Batch-invariant weight product: out[M, N] (float32) = x[M, K] @ w[N, K]^T, fp32 accumulation.
//
// cuBLAS picks its algorithm (split-K, tile shape) from M, so a row's result can change in the
// last bits with the batch size; that breaks "speculative output == plain output" on near-ties.
// Here one warp computes column n for up to LIN_ROWS rows: lane l reads 16-byte vectors
// l, l + 32, ... of the K axis and adds them in that order, then a butterfly sum over lanes.
// out[m, n] therefore depends only on x[m], w[n] and K: never on M or the other rows.
// Opt-in (GpuRunner(batch_invariant=True)); cuBLAS is faster for large M.
#include "common.cuh"

#define LIN_WARPS 8  // columns per block
#define LIN_ROWS 8   // rows per block

template <typename T, int VEC>
__device__ __forceinline__ void unpack(const uint4& raw, float (&f)[VEC]) {
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < VEC; ++i) f[i] = to_f32(e[i]);
}

// grid (ceil(N / LIN_WARPS), ceil(M / LIN_ROWS)), block LIN_WARPS * 32; K % (16 / sizeof(T)) == 0.
template <typename T>
__device__ void linear_rows(const T* __restrict__ x, const T* __restrict__ w, float* __restrict__ out,
                            int M, int N, int K) {
    constexpr int VEC = 16 / sizeof(T);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int n = blockIdx.x * LIN_WARPS + warp;
    if (n >= N) return;
    const int m0 = blockIdx.y * LIN_ROWS, rows = min(LIN_ROWS, M - m0);
    const int num_vec = K / VEC;
    const uint4* w_vec = reinterpret_cast<const uint4*>(w + (size_t)n * K);
    float acc[LIN_ROWS];
#pragma unroll
    for (int mm = 0; mm < LIN_ROWS; ++mm) acc[mm] = 0.0f;
    for (int v = lane; v < num_vec; v += 32) {
        float wf[VEC];
        unpack<T, VEC>(__ldg(w_vec + v), wf);
#pragma unroll
        for (int mm = 0; mm < LIN_ROWS; ++mm) {
            if (mm < rows) {
                float xf[VEC];
                unpack<T, VEC>(__ldg(reinterpret_cast<const uint4*>(x + (size_t)(m0 + mm) * K) + v), xf);
                float s = acc[mm];
#pragma unroll
                for (int e = 0; e < VEC; ++e) s += wf[e] * xf[e];
                acc[mm] = s;
            }
        }
    }
#pragma unroll
    for (int mm = 0; mm < LIN_ROWS; ++mm) {
        const float s = warp_sum(acc[mm]);
        if (lane == 0 && mm < rows) out[(size_t)(m0 + mm) * N + n] = s;
    }
}

extern "C" __global__ void __launch_bounds__(LIN_WARPS * 32)
linear_rows_f32(const float* x, const float* w, float* out, int M, int N, int K) {
    linear_rows<float>(x, w, out, M, N, K);
}
extern "C" __global__ void __launch_bounds__(LIN_WARPS * 32)
linear_rows_f16(const __half* x, const __half* w, float* out, int M, int N, int K) {
    linear_rows<__half>(x, w, out, M, N, K);
}
extern "C" __global__ void __launch_bounds__(LIN_WARPS * 32)
linear_rows_bf16(const __nv_bfloat16* x, const __nv_bfloat16* w, float* out, int M, int N, int K) {
    linear_rows<__nv_bfloat16>(x, w, out, M, N, K);
}
