// CPU emulation of the CUDA subset our kernels use, for CI without a GPU (engine/gpu/emulator.py).
//
// Every CUDA thread of a block is a std::thread; __syncthreads is a std::barrier over the block,
// warp shuffles exchange through a per-warp buffer between two warp barriers, __shared__ becomes
// `static` (blocks run one after another). Slow, exact about the kernel's arithmetic order, and
// strict about synchronisation: a race in a kernel shows up here as a wrong result or a hang.
#pragma once
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static

struct dim3 { unsigned x = 1, y = 1, z = 1; };
struct EmuThread { dim3 tid, bid, bdim, gdim; int lane = 0, warp = 0; };
inline thread_local EmuThread emu_self;
#define threadIdx (emu_self.tid)
#define blockIdx (emu_self.bid)
#define blockDim (emu_self.bdim)
#define gridDim (emu_self.gdim)

struct EmuBlock {
    std::unique_ptr<std::barrier<>> block;
    std::vector<std::unique_ptr<std::barrier<>>> warps;
    std::vector<uint64_t> buf;  // [num_warps * 32] shuffle exchange
};
inline EmuBlock* emu_block = nullptr;

inline void __syncthreads() { emu_block->block->arrive_and_wait(); }

template <typename T> inline T emu_shfl(T v, int src_lane) {
    static_assert(sizeof(T) <= 8, "shuffle of a type wider than 8 bytes");
    uint64_t bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    const int w = emu_self.warp;
    emu_block->buf[w * 32 + emu_self.lane] = bits;
    emu_block->warps[w]->arrive_and_wait();
    const uint64_t got = emu_block->buf[w * 32 + (src_lane & 31)];
    emu_block->warps[w]->arrive_and_wait();
    T r;
    std::memcpy(&r, &got, sizeof(T));
    return r;
}
template <typename T> inline T __shfl_xor_sync(unsigned, T v, int m) { return emu_shfl(v, emu_self.lane ^ m); }
template <typename T> inline T __shfl_sync(unsigned, T v, int src) { return emu_shfl(v, src); }
template <typename T> inline T __shfl_up_sync(unsigned, T v, int d) {
    return emu_shfl(v, emu_self.lane >= d ? emu_self.lane - d : emu_self.lane);
}

inline int atomicMax(int* addr, int v) {
    int old = __atomic_load_n(addr, __ATOMIC_SEQ_CST);
    while (old < v && !__atomic_compare_exchange_n(addr, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
    }
    return old;
}

inline float __int_as_float(int x) { float f; std::memcpy(&f, &x, 4); return f; }
inline unsigned __float_as_uint(float x) { unsigned u; std::memcpy(&u, &x, 4); return u; }
template <typename T> inline T __ldg(const T* p) { return *p; }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }

struct alignas(16) uint4 { unsigned x, y, z, w; };

// Runs kernel<<<grid, block>>>(args...) block by block.
template <typename... P, typename... A>
void emu_launch(void (*kernel)(P...), dim3 grid, dim3 block, A... args) {
    const int num_threads = (int)(block.x * block.y * block.z);
    const int num_warps = (num_threads + 31) / 32;
    for (unsigned bz = 0; bz < grid.z; ++bz)
        for (unsigned by = 0; by < grid.y; ++by)
            for (unsigned bx = 0; bx < grid.x; ++bx) {
                EmuBlock state;
                state.block = std::make_unique<std::barrier<>>(num_threads);
                for (int w = 0; w < num_warps; ++w)
                    state.warps.push_back(std::make_unique<std::barrier<>>(std::min(32, num_threads - 32 * w)));
                state.buf.assign(num_warps * 32, 0);
                emu_block = &state;
                std::vector<std::thread> threads;
                for (int t = 0; t < num_threads; ++t)
                    threads.emplace_back([&, t] {
                        emu_self.tid = dim3{t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
                        emu_self.bid = dim3{bx, by, bz};
                        emu_self.bdim = block;
                        emu_self.gdim = grid;
                        emu_self.lane = t % 32;
                        emu_self.warp = t / 32;
                        kernel(args...);
                        state.warps[t / 32]->arrive_and_drop();  // an exited thread no longer syncs
                        state.block->arrive_and_drop();
                    });
                for (auto& th : threads) th.join();
                emu_block = nullptr;
            }
}
