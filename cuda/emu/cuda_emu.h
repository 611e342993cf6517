// CPU emulation of the CUDA subset our kernels use, for CI without a GPU (engine/gpu/emulator.py).
//
// The threads of a block are fibers (ucontext) on one OS thread, scheduled round robin; a fiber
// runs until it waits at a barrier. __syncthreads is a barrier over the block, a warp shuffle
// exchanges values through a per-warp buffer between two warp barriers, and __shared__ becomes
// `static` (blocks run one after another). Exact about each thread's arithmetic order, and strict
// about synchronisation: a kernel that syncs in divergent code deadlocks here, which is reported
// and aborts instead of hanging.
#pragma once
#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __shared__ static

struct dim3 { unsigned x = 1, y = 1, z = 1; };
struct EmuThread { dim3 tid, bid, bdim, gdim; int lane = 0, warp = 0; };
struct EmuBarrier { int expected = 0, arrived = 0; unsigned phase = 0; };
struct EmuBlock { EmuBarrier block; std::vector<EmuBarrier> warps; std::vector<uint64_t> buf; };

inline EmuThread* emu_cur = nullptr;       // the running fiber's thread/block indices
inline EmuBlock* emu_block = nullptr;
inline ucontext_t emu_main_ctx;
inline ucontext_t* emu_fiber_ctx = nullptr;
inline unsigned long emu_progress = 0;     // bumped by every arrival, phase change and exit
inline std::function<void(int)>* emu_body = nullptr;

#define threadIdx (emu_cur->tid)
#define blockIdx (emu_cur->bid)
#define blockDim (emu_cur->bdim)
#define gridDim (emu_cur->gdim)

inline void emu_arrive_and_wait(EmuBarrier& b) {
    ++emu_progress;
    if (++b.arrived == b.expected) {
        b.arrived = 0;
        ++b.phase;
        return;
    }
    const unsigned phase = b.phase;
    while (b.phase == phase) swapcontext(emu_fiber_ctx, &emu_main_ctx);  // yield
}

inline void emu_drop(EmuBarrier& b) {  // an exited thread no longer takes part
    ++emu_progress;
    --b.expected;
    if (b.arrived > 0 && b.arrived == b.expected) {
        b.arrived = 0;
        ++b.phase;
    }
}

inline void __syncthreads() { emu_arrive_and_wait(emu_block->block); }

template <typename T> inline T emu_shfl(T v, int src_lane) {
    static_assert(sizeof(T) <= 8, "shuffle of a type wider than 8 bytes");
    uint64_t bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    const int w = emu_cur->warp;
    emu_block->buf[w * 32 + emu_cur->lane] = bits;
    emu_arrive_and_wait(emu_block->warps[w]);
    const uint64_t got = emu_block->buf[w * 32 + (src_lane & 31)];
    emu_arrive_and_wait(emu_block->warps[w]);
    T r;
    std::memcpy(&r, &got, sizeof(T));
    return r;
}
template <typename T> inline T __shfl_xor_sync(unsigned, T v, int m) { return emu_shfl(v, emu_cur->lane ^ m); }
template <typename T> inline T __shfl_sync(unsigned, T v, int src) { return emu_shfl(v, src); }
template <typename T> inline T __shfl_up_sync(unsigned, T v, int d) {
    return emu_shfl(v, emu_cur->lane >= d ? emu_cur->lane - d : emu_cur->lane);
}

inline int atomicMax(int* addr, int v) {  // fibers never preempt each other
    const int old = *addr;
    *addr = old > v ? old : v;
    return old;
}

inline int atomicMin(int* addr, int v) {
    const int old = *addr;
    *addr = old < v ? old : v;
    return old;
}

inline float __int_as_float(int x) { float f; std::memcpy(&f, &x, 4); return f; }
inline unsigned __float_as_uint(float x) { unsigned u; std::memcpy(&u, &x, 4); return u; }
template <typename T> inline T __ldg(const T* p) { return *p; }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }

struct alignas(16) uint4 { unsigned x, y, z, w; };

inline void emu_entry(int t) { (*emu_body)(t); }

// Runs kernel<<<grid, block>>>(args...): blocks one after another, each block's threads as fibers.
template <typename... P, typename... A>
void emu_launch(void (*kernel)(P...), dim3 grid, dim3 block, A... args) {
    constexpr size_t kStack = 256 * 1024;
    const int n = (int)(block.x * block.y * block.z), num_warps = (n + 31) / 32;
    std::vector<EmuThread> selves(n);
    std::vector<ucontext_t> ctxs(n);
    std::vector<std::vector<char>> stacks(n, std::vector<char>(kStack));
    std::vector<char> done(n);
    std::function<void(int)> body = [&](int t) {
        kernel(args...);
        emu_drop(emu_block->warps[t / 32]);
        emu_drop(emu_block->block);
        done[t] = 1;
    };
    emu_body = &body;
    for (unsigned b = 0; b < grid.x * grid.y * grid.z; ++b) {
        EmuBlock state;
        state.block.expected = n;
        for (int w = 0; w < num_warps; ++w) state.warps.push_back(EmuBarrier{std::min(32, n - 32 * w), 0, 0});
        state.buf.assign(num_warps * 32, 0);
        emu_block = &state;
        for (int t = 0; t < n; ++t) {
            selves[t] = EmuThread{dim3{t % block.x, (t / block.x) % block.y, t / (block.x * block.y)},
                                  dim3{b % grid.x, (b / grid.x) % grid.y, b / (grid.x * grid.y)}, block, grid,
                                  t % 32, t / 32};
            getcontext(&ctxs[t]);
            ctxs[t].uc_stack.ss_sp = stacks[t].data();
            ctxs[t].uc_stack.ss_size = kStack;
            ctxs[t].uc_link = &emu_main_ctx;
            makecontext(&ctxs[t], (void (*)())emu_entry, 1, t);
            done[t] = 0;
        }
        for (int remaining = n; remaining > 0;) {
            const unsigned long before = emu_progress;
            for (int t = 0; t < n; ++t) {
                if (done[t]) continue;
                emu_cur = &selves[t];
                emu_fiber_ctx = &ctxs[t];
                swapcontext(&emu_main_ctx, &ctxs[t]);
                remaining -= done[t];
            }
            if (remaining > 0 && emu_progress == before) {
                std::fprintf(stderr, "cuda_emu: deadlock in block %u: every live thread waits at a barrier\n", b);
                std::abort();
            }
        }
    }
    emu_block = nullptr;
    emu_cur = nullptr;
}
