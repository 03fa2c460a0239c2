// CUDA on the host: enough of CUDA C for g++ (-std=c++20) to compile gpu/cuda/*.cu unchanged
// and run them on the CPU (tests/test_cuda_host.py). Each thread of a block is a fiber (its own
// stack, switched by ucontext on one OS thread), so __syncthreads() and warp shuffles really
// synchronize: a fiber that waits yields to the next runnable one. Why not OS threads: a block
// of 128 threads was 128 thread creations, and every shuffle 32 futex wake-ups on a 2-core
// machine (the host tests spent more system time than user time); a fiber switch is a
// function call's worth of registers. Fibers also run in one fixed order, so a result does not
// depend on the OS scheduler, and a barrier nobody can pass is reported as a deadlock instead
// of hanging. Blocks run one after another, so one static copy of each __shared__ array is the
// block's shared memory. Launches are serialized.
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <math.h>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#include <sys/mman.h>
#include <ucontext.h>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...)
#define __restrict__ __restrict
// One copy per .so in a section of its own, so the launcher can fill it with NaN bytes before
// each block: a read of shared memory the block did not write shows up in the results.
#define __shared__ static __attribute__((section("cuda_host_shared")))

struct uint3 { unsigned x, y, z; };
struct dim3 { unsigned x = 1, y = 1, z = 1; };
struct float2 { float x, y; };
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
constexpr int warpSize = 32;

// ---- fp16: IEEE binary16 bits; conversions through _Float16 round to nearest even.
struct __half { uint16_t bits; };
struct alignas(4) __half2 { __half x, y; };

__forceinline__ float __half2float(__half h) { return (float)std::bit_cast<_Float16>(h.bits); }
__forceinline__ __half __float2half(float f) { return {std::bit_cast<uint16_t>((_Float16)f)}; }
__forceinline__ float2 __half22float2(__half2 h) { return {__half2float(h.x), __half2float(h.y)}; }
__forceinline__ __half2 __floats2half2_rn(float a, float b) { return {__float2half(a), __float2half(b)}; }
__forceinline__ __half __ushort_as_half(unsigned short bits) { return {bits}; }

// ---- bf16: the upper half of a float32's bits; narrowing rounds to nearest even (a NaN stays a
// NaN), as cuda_bf16.h's __float2bfloat16.
struct __nv_bfloat16 { uint16_t bits; };
struct alignas(4) __nv_bfloat162 { __nv_bfloat16 x, y; };

__forceinline__ float __bfloat162float(__nv_bfloat16 h) { return std::bit_cast<float>((uint32_t)h.bits << 16); }
__forceinline__ __nv_bfloat16 __float2bfloat16(float f) {
    const uint32_t u = std::bit_cast<uint32_t>(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return {(uint16_t)((u >> 16) | 0x40u)};
    return {(uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16)};
}
__forceinline__ float2 __bfloat1622float2(__nv_bfloat162 h) { return {__bfloat162float(h.x), __bfloat162float(h.y)}; }
__forceinline__ __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
    return {__float2bfloat16(a), __float2bfloat16(b)};
}

// ---- math intrinsics (host libm: at least as accurate as the device's fast versions)
__forceinline__ float __expf(float x) { return expf(x); }
__forceinline__ float rsqrtf(float x) { return 1.0f / sqrtf(x); }
__forceinline__ float __int_as_float(int x) { return std::bit_cast<float>(x); }
__forceinline__ int __float_as_int(float x) { return std::bit_cast<int>(x); }
__forceinline__ float __uint_as_float(unsigned x) { return std::bit_cast<float>(x); }
__forceinline__ int min(int a, int b) { return a < b ? a : b; }
__forceinline__ int max(int a, int b) { return a > b ? a : b; }
__forceinline__ unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
__forceinline__ unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }

namespace cuda_host {

// A barrier of fibers: they all run on one OS thread, so plain counters. A fiber that waits
// is skipped by the scheduler until the generation it waits on has passed.
struct Barrier {
    explicit Barrier(int n) : expected(n) {}
    int expected, arrived = 0;
    unsigned generation = 0;
    void arrive_and_wait();
    void arrive_and_drop();  // an exited thread no longer holds back the others
    void release() {
        arrived = 0;
        ++generation;
    }
};

// Per-block state every emulated thread of the block points at.
struct Warp {
    explicit Warp(int n) : size(n), bar(n) {}
    int size;
    Barrier bar;
    uint64_t slots[2][32];  // double-buffered: one barrier per shuffle suffices
    // mma_m16n8k16: every lane's fragments, gathered (one buffer: two barriers an mma), the
    // lanes that posted them (a bit each; double-buffered by each lane's mma count), and
    // each lane's count of mmas (its buffer's parity).
    uint32_t mma_a[32][4], mma_b[32][2];
    uint32_t mma_lanes[2] = {0, 0};  // plain: every fiber runs on the launching thread
    unsigned mma_count[32] = {};
};
struct Block {
    explicit Block(int n) : sync(n) {
        for (int w = 0; w < (n + 31) / 32; ++w) warps.push_back(std::make_unique<Warp>(std::min(32, n - 32 * w)));
    }
    Barrier sync;
    std::vector<std::unique_ptr<Warp>> warps;
};

inline std::mutex error_mutex;
inline std::string first_error;
inline void fail(const std::string& what) {
    std::lock_guard<std::mutex> lock(error_mutex);
    if (first_error.empty()) first_error = what;
}

inline Block* tl_block;  // NOTE: plain globals, not thread_local: every fiber runs on the launching thread
inline Warp* tl_warp;
inline int tl_lane, tl_phase;

}  // namespace cuda_host

inline uint3 threadIdx, blockIdx;  // the running fiber's (swapped in by run_block)
inline dim3 blockDim, gridDim;  // the same for every thread of a launch

__forceinline__ void __syncthreads() { cuda_host::tl_block->sync.arrive_and_wait(); }
// Launches and their blocks run one after another on one OS thread: an atomic is a plain
// read-modify-write, a fence orders nothing that is not already ordered, an L2 load is a load.
__forceinline__ int atomicAdd(int* p, int v) { const int old = *p; *p = old + v; return old; }
__forceinline__ void __threadfence() {}
__forceinline__ float __ldcg(const float* p) { return *p; }

// Lane i gets v from lane i ^ lane_mask. All lanes of the warp call it together (full mask).
template <class T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = warpSize) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>);
    using namespace cuda_host;
    Warp& w = *tl_warp;
    const unsigned want = w.size == 32 ? 0xffffffffu : (1u << w.size) - 1;
    if (mask != want) fail("__shfl_xor_sync: mask " + std::to_string(mask) + " is not the warp's lanes");
    if (width != warpSize) fail("__shfl_xor_sync: only width 32 is emulated");
    const int src = tl_lane ^ lane_mask;
    if (src >= w.size) fail("__shfl_xor_sync: source lane " + std::to_string(src) + " is not in the warp");
    uint64_t* slot = w.slots[tl_phase];
    tl_phase ^= 1;
    std::memcpy(&slot[tl_lane], &v, sizeof(T));
    w.bar.arrive_and_wait();
    T r = v;
    if (src < w.size) std::memcpy(&r, &slot[src], sizeof(T));
    return r;
}

// mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 (c += A B, A 16 x 16 and B 16 x 8 fp16,
// C 16 x 8 float32), warp-collective as on the device: each lane posts its fragments, a
// barrier, each lane computes its own four outputs from the gathered tiles, a barrier before
// the buffer is reused. Fragment layout: the PTX ISA's for m16n8k16 .f16 A/B, .f32 C/D
// (g = lane >> 2, t = lane & 3): a[0] A[g][2t, 2t+1], a[1] A[g+8][2t, 2t+1], a[2] A[g][2t+8, 2t+9],
// a[3] A[g+8][2t+8, 2t+9] (low half first); b[0] B[2t, 2t+1][g], b[1] B[2t+8, 2t+9][g];
// c[0], c[1] C[g][2t, 2t+1], c[2], c[3] C[g+8][2t, 2t+1]. fp16 products are exact in float;
// summed in float in k order (the device's order is its own: tests allow for fp32 sums).
// BF16: the fragments hold bf16 (mma...bf16.bf16.f32, mma_m16n8k16_bf16 below), else fp16.
template <bool BF16>
inline void mma_m16n8k16_of(const unsigned (&a)[4], const unsigned (&b)[2], float (&c)[4]) {
    using namespace cuda_host;
    Warp& w = *tl_warp;
    const int lane = tl_lane, parity = w.mma_count[lane]++ & 1;
    std::memcpy(w.mma_a[lane], a, sizeof a);
    std::memcpy(w.mma_b[lane], b, sizeof b);
    w.mma_lanes[parity] |= 1u << lane;
    w.bar.arrive_and_wait();
    if (w.mma_lanes[parity] != 0xffffffffu)
        fail("mma_m16n8k16: not all 32 lanes of the warp are present");
    if (lane == 0) w.mma_lanes[parity ^ 1] = 0;  // the next mma's: nobody reads it now
    // element e (0, 1) of 32-bit word `reg` of lane `src`
    auto half_at = [&](const uint32_t* words, int e) {
        const uint16_t bits = (uint16_t)(words[0] >> (16 * e));
        return BF16 ? __bfloat162float(__nv_bfloat16{bits}) : __half2float(__half{bits});
    };
    auto A = [&](int row, int k) {  // row 0..15, k 0..15
        const int src = 4 * (row & 7) + ((k & 7) >> 1), reg = (row >> 3) + 2 * (k >> 3);
        return half_at(&w.mma_a[src][reg], k & 1);
    };
    auto B = [&](int k, int col) {  // k 0..15, col 0..7
        const int src = 4 * col + ((k & 7) >> 1), reg = k >> 3;
        return half_at(&w.mma_b[src][reg], k & 1);
    };
    const int g = lane >> 2, t = lane & 3;
    float d[4];
    for (int e = 0; e < 4; ++e) {
        const int row = g + 8 * (e >> 1), col = 2 * t + (e & 1);
        float sum = c[e];
        for (int k = 0; k < 16; ++k) sum += A(row, k) * B(k, col);
        d[e] = sum;
    }
    w.bar.arrive_and_wait();  // every lane has read the fragments before any posts its next
    for (int e = 0; e < 4; ++e) c[e] = d[e];
}
inline void mma_m16n8k16(const unsigned (&a)[4], const unsigned (&b)[2], float (&c)[4]) {
    mma_m16n8k16_of<false>(a, b, c);
}
inline void mma_m16n8k16_bf16(const unsigned (&a)[4], const unsigned (&b)[2], float (&c)[4]) {
    mma_m16n8k16_of<true>(a, b, c);
}

extern "C" __attribute__((weak)) char __start_cuda_host_shared[], __stop_cuda_host_shared[];

namespace cuda_host {

// One emulated thread: its context, its stack, and the per-thread state the scheduler swaps in.
struct Fiber {
    ucontext_t context;
    uint3 thread;
    Warp* warp;
    int lane, phase;
    Barrier* waits_on = nullptr;  // with the generation it waits to see pass
    unsigned waits_for = 0;
    bool done = false;
};

constexpr size_t STACK_BYTES = 256 << 10;  // kernels keep their arrays in registers on the GPU
constexpr size_t GUARD_BYTES = 4096;       // an overflow faults instead of writing a neighbour

// Stacks are mapped once and reused by every block of every launch (pages are committed only
// as they are touched: a few KiB each).
inline std::vector<char*> stacks;
inline char* stack(size_t i) {
    while (stacks.size() <= i) {
        void* p = mmap(nullptr, STACK_BYTES + GUARD_BYTES, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p == MAP_FAILED) return nullptr;
        mprotect(p, GUARD_BYTES, PROT_NONE);  // stacks grow down, towards the guard
        stacks.push_back(static_cast<char*>(p) + GUARD_BYTES);
    }
    return stacks[i];
}

inline ucontext_t scheduler;
inline Fiber* running;
inline const std::function<void()>* running_kernel;

inline void Barrier::arrive_and_wait() {
    if (++arrived == expected) return release();
    running->waits_on = this;
    running->waits_for = generation;
    swapcontext(&running->context, &scheduler);
}

inline void Barrier::arrive_and_drop() {
    if (--expected > 0 && arrived == expected) release();
}

inline void fiber_main() {
    (*running_kernel)();
    running->warp->bar.arrive_and_drop();
    tl_block->sync.arrive_and_drop();
    running->done = true;  // returning resumes the scheduler (uc_link)
}

// Runs the block's fibers in index order, each until it waits or ends, until all have ended.
// Returns false if some wait on a barrier that none of the others can reach (a deadlock).
inline bool run_block(std::vector<Fiber>& fibers) {
    size_t left = fibers.size();
    while (left) {
        bool progressed = false;
        for (Fiber& f : fibers) {
            if (f.done || (f.waits_on && f.waits_on->generation == f.waits_for)) continue;
            f.waits_on = nullptr;
            running = &f;
            threadIdx = f.thread;
            tl_warp = f.warp;
            tl_lane = f.lane;
            tl_phase = f.phase;
            swapcontext(&scheduler, &f.context);
            f.phase = tl_phase;
            left -= f.done;
            progressed = true;
        }
        if (!progressed) return false;
    }
    return true;
}

inline std::mutex launch_mutex;

// Runs kernel() over grid x block like a CUDA launch; max_threads is the kernel's
// __launch_bounds__ (else the device's 1024). Returns 0, or 1 with the reason in first_error.
inline int launch(const unsigned* dims, unsigned max_threads, const std::function<void()>& kernel) {
    std::lock_guard<std::mutex> lock(launch_mutex);
    first_error.clear();
    const dim3 grid{dims[0], dims[1], dims[2]}, block{dims[3], dims[4], dims[5]};
    const unsigned long long threads = 1ull * block.x * block.y * block.z;
    if (!grid.x || !grid.y || !grid.z || grid.x > 0x7fffffffu || grid.y > 65535 || grid.z > 65535)
        fail("invalid grid");
    if (!threads || threads > max_threads || block.x > 1024 || block.y > 1024 || block.z > 64)
        fail("invalid block: " + std::to_string(threads) + " threads, at most " + std::to_string(max_threads));
    if (!first_error.empty()) return 1;
    if (!stack(threads - 1)) return fail("cannot map the fibers' stacks"), 1;
    gridDim = grid;
    blockDim = block;
    running_kernel = &kernel;
    std::vector<Fiber> fibers(threads);
    for (unsigned bz = 0; bz < grid.z; ++bz)
        for (unsigned by = 0; by < grid.y; ++by)
            for (unsigned bx = 0; bx < grid.x; ++bx) {
                if (__start_cuda_host_shared)
                    std::memset(__start_cuda_host_shared, 0xff, __stop_cuda_host_shared - __start_cuda_host_shared);
                Block state((int)threads);
                tl_block = &state;
                blockIdx = {bx, by, bz};
                for (unsigned i = 0; i < threads; ++i) {
                    Fiber& f = fibers[i];
                    f = Fiber{};
                    f.thread = {i % block.x, i / block.x % block.y, i / (block.x * block.y)};
                    f.warp = state.warps[i / 32].get();
                    f.lane = i % 32;
                    getcontext(&f.context);
                    f.context.uc_stack = {stacks[i], 0, STACK_BYTES};
                    f.context.uc_link = &scheduler;
                    makecontext(&f.context, fiber_main, 0);
                }
                if (!run_block(fibers)) {
                    // NOTE: the waiting fibers are abandoned where they stand; their stacks are
                    // reused by the next launch (kernels hold no resources to release).
                    fail("deadlock: block (" + std::to_string(bx) + ", " + std::to_string(by) + ", " +
                         std::to_string(bz) + ") waits on a barrier that some of its threads never reach");
                    return 1;
                }
            }
    return first_error.empty() ? 0 : 1;
}

}  // namespace cuda_host

extern "C" const char* cuda_host_error() { return cuda_host::first_error.c_str(); }
