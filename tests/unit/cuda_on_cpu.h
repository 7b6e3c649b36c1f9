/* CUDA's execution model on the CPU, as much of it as mpiopt's kernels use, so that the CPU suite runs their
 * source (tests/unit/test_cuda_on_cpu.py): a block's threads are fibers on one OS thread, switched at
 * __syncthreads and at a warp's shuffle; a thread waiting at a barrier resumes only when every live thread of
 * its block (its warp, for a shuffle) waits at one, and a barrier some threads never reach is reported, not
 * hung on.  __shared__ variables are statics (one block runs at a time); atomics are plain (one OS thread).
 * What it cannot show: the GPU's arithmetic beyond its canonical NaN (-ftz, FMA contraction: _cuda.ROUNDING's
 * instructions are replaced by the CPU's), its memory model, or its speed.
 */
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <ucontext.h>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static

/* CUDA's vector types that the kernels load wide. */
struct alignas(16) float4 {
    float x, y, z, w;
};
struct alignas(16) double2 {
    double x, y;
};

struct dim3_ {
    unsigned x = 0, y = 0, z = 0;
};
inline dim3_ threadIdx, blockIdx, blockDim, gridDim;

using std::fabs;
using std::max;
using std::min;

namespace emu {
enum Wait { RUNNING, BLOCK, WARP, DONE };
struct Thread {
    ucontext_t context;
    std::vector<char> stack;
    Wait wait = RUNNING;
};
inline std::vector<Thread> threads;
inline ucontext_t scheduler;
inline unsigned current;
inline std::function<void()> body;
inline unsigned long long shuffled[1024];  /* a warp's values in a shuffle, by thread */

inline void yield(Wait why) {
    threads[current].wait = why;
    swapcontext(&threads[current].context, &scheduler);
}

inline void start() {
    body();
    threads[current].wait = DONE;
    swapcontext(&threads[current].context, &scheduler);
}

inline void fail(const char *what) {
    std::fprintf(stderr, "cuda_on_cpu: %s (block %u)\n", what, blockIdx.x);
    std::abort();
}

/* Resume `t` until it waits again (or ends). */
inline void resume(unsigned t) {
    current = t;
    threadIdx.x = t;
    threads[t].wait = RUNNING;
    swapcontext(&scheduler, &threads[t].context);
}

/* One block: every thread from the start, then, round after round, the warps whose every live thread waits
 * at a shuffle, or else, when every live thread waits at __syncthreads, all of them. */
inline void run_block(unsigned n) {
    for (unsigned t = 0; t < n; ++t) {
        getcontext(&threads[t].context);
        threads[t].context.uc_stack.ss_sp = threads[t].stack.data();
        threads[t].context.uc_stack.ss_size = threads[t].stack.size();
        threads[t].context.uc_link = nullptr;
        makecontext(&threads[t].context, start, 0);
        resume(t);
    }
    for (;;) {
        bool progress = false, live = false, all_at_block = true;
        for (unsigned w = 0; w < n; w += 32) {
            bool whole = true, any = false;
            for (unsigned t = w; t < w + 32 && t < n; ++t) {
                if (threads[t].wait == DONE) continue;
                any = true;
                whole &= threads[t].wait == WARP;
            }
            if (any && whole) {
                for (unsigned t = w; t < w + 32 && t < n; ++t)
                    if (threads[t].wait == WARP) resume(t);
                progress = true;
            }
        }
        if (progress) continue;
        for (unsigned t = 0; t < n; ++t) {
            if (threads[t].wait == DONE) continue;
            live = true;
            all_at_block &= threads[t].wait == BLOCK;
        }
        if (!live) return;
        if (!all_at_block) fail("threads wait at different barriers (a shuffle or __syncthreads not every thread reaches)");
        for (unsigned t = 0; t < n; ++t)
            if (threads[t].wait == BLOCK) resume(t);
    }
}

/* kernel<<<blocks, n>>>: each block in turn. */
inline void launch(unsigned blocks, unsigned n, std::function<void()> kernel) {
    if (n % 32 || n > 1024) fail("block sizes are multiples of 32, at most 1024, here");
    threads.resize(n);
    for (auto &t : threads)
        if (t.stack.empty()) t.stack.resize(256 * 1024);
    body = std::move(kernel);
    gridDim.x = blocks;
    blockDim.x = n;
    for (unsigned b = 0; b < blocks; ++b) {
        blockIdx.x = b;
        run_block(n);
    }
}
}  // namespace emu

inline void __syncthreads() { emu::yield(emu::BLOCK); }

template <typename T> T __shfl_up_sync(unsigned, T v, int delta) {
    static_assert(sizeof(T) <= 8, "a shuffle moves at most 8 bytes");
    const unsigned me = threadIdx.x, lane = me & 31;
    unsigned long long word = 0;
    std::memcpy(&word, &v, sizeof(T));
    emu::shuffled[me] = word;
    emu::yield(emu::WARP);  /* every lane has written */
    T r = v;
    if (lane >= (unsigned)delta) std::memcpy(&r, &emu::shuffled[me - delta], sizeof(T));
    emu::yield(emu::WARP);  /* every lane has read */
    return r;
}

inline int atomicAdd(int *p, int v) {
    const int old = *p;
    *p = old + v;
    return old;
}
inline unsigned atomicOr(unsigned *p, unsigned v) {
    const unsigned old = *p;
    *p = old | v;
    return old;
}
/* Bit l: lane l's predicate (every lane of the warp takes part, as in mpiopt's kernels). */
inline unsigned __ballot_sync(unsigned, int predicate) {
    const unsigned me = threadIdx.x, base = me & ~31u;
    emu::shuffled[me] = predicate != 0;
    emu::yield(emu::WARP);  /* every lane has written */
    unsigned word = 0;
    for (unsigned l = 0; l < 32 && base + l < blockDim.x; ++l) word |= (unsigned)(emu::shuffled[base + l] & 1u) << l;
    emu::yield(emu::WARP);  /* every lane has read */
    return word;
}

inline int atomicCAS(int *p, int compare, int v) {
    const int old = *p;
    if (old == compare) *p = v;
    return old;
}
inline int atomicMax(int *p, int v) {
    const int old = *p;
    *p = old > v ? old : v;
    return old;
}
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline unsigned __float_as_uint(float v) {
    unsigned u;
    std::memcpy(&u, &v, 4);
    return u;
}
inline float __uint_as_float(unsigned u) {
    float v;
    std::memcpy(&v, &u, 4);
    return v;
}
inline float __int_as_float(int u) {
    float v;
    std::memcpy(&v, &u, 4);
    return v;
}
inline long long __double_as_longlong(double v) {
    long long u;
    std::memcpy(&u, &v, 8);
    return u;
}
inline double __longlong_as_double(long long u) {
    double v;
    std::memcpy(&v, &u, 8);
    return v;
}

/* _cuda.ROUNDING's operations, the CPU's (SSE: rounded to nearest, subnormals kept; built with -ffp-contract=off),
 * with the GPU's canonical NaN as every float32 result that is NaN (x86 keeps an operand's, or makes a negative
 * one; PTX promises the canonical NaN for float32 only). */
inline float gpu_nan_(float r) { return r != r ? __uint_as_float(0x7fffffffu) : r; }
#define ROUNDING_ON_CPU                                                                     \
    inline float add_(float a, float b) { return gpu_nan_(a + b); }                         \
    inline float sub_(float a, float b) { return gpu_nan_(a - b); }                         \
    inline float mul_(float a, float b) { return gpu_nan_(a * b); }                         \
    inline float div_(float a, float b) { return gpu_nan_(a / b); }                         \
    inline double add_(double a, double b) { return a + b; }                                \
    inline double sub_(double a, double b) { return a - b; }                                \
    inline double mul_(double a, double b) { return a * b; }                                \
    inline double div_(double a, double b) { return a / b; }                                \
    inline double widen_(float v) { return (double)v; }                                     \
    inline float narrow_(double v) { return gpu_nan_((float)v); }                           \
    inline float abs_(float v) { return std::fabs(v); }                                     \
    inline double abs_(double v) { return std::fabs(v); }                                   \
    inline bool ge_(float a, float b) { return a >= b; }                                    \
    inline bool ge_(double a, double b) { return a >= b; }
