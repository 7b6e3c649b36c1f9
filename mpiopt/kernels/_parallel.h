/* A parallel for over [0, n) on POSIX threads, shared by the C kernels.
 *
 * The loops it serves are memory-bound: one thread does not reach the
 * memory bandwidth a socket has (torch's fused CPU optimizers use all their
 * intra-op threads for the same reason).  The caller passes the thread count
 * (mpiopt.kernels.threads).  The range is cut into chunks (contiguous, their
 * bounds multiples of `align` elements, so chunks of a packed-bit loop own
 * whole bytes or words) that the threads take in turn from a shared counter:
 * a thread slowed down by another process on its core (torch's OpenMP
 * threads spin for a while after each parallel region) takes fewer chunks
 * instead of holding everyone up.  Vectors too short to be worth a thread
 * start (tens of microseconds) run in the calling thread alone, as one
 * chunk.  Elementwise loops give the same bits whatever the split;
 * reductions combine per-chunk results that the caller keeps in its
 * context, indexed by chunk, in chunk order.  Loops whose elements cost more
 * than a streamed pass (random accesses at sparse indices) ask for smaller
 * parts.
 *
 * The helpers are static inline so that a source file using only some of
 * them (each of _sparsec's files uses a different few) compiles without
 * unused-function warnings.
 */
#ifndef MPIOPT_PARALLEL_H
#define MPIOPT_PARALLEL_H

#include <pthread.h>
#include <stdint.h>

/* The first position of the sorted int32 list a (n entries) holding value or more: where a part of a
 * loop over sorted indices starts. */
static inline Py_ssize_t mpiopt_lower_bound(const int32_t *a, Py_ssize_t n, Py_ssize_t value) {
    Py_ssize_t lo = 0, hi = n;
    while (lo < hi) {
        const Py_ssize_t mid = lo + (hi - lo) / 2;
        if (a[mid] < value) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

/* The most chunks (and threads) of one call: per-chunk results fit arrays of this length. */
#define MPIOPT_MAX_PARTS 64
/* Elements a thread's share must have at least (a quarter of a millisecond of memory traffic or more). */
#define MPIOPT_MIN_PART (1 << 18)

typedef void (*mpiopt_part_fn)(void *ctx, Py_ssize_t lo, Py_ssize_t hi, int chunk);

typedef struct {
    mpiopt_part_fn fn;
    void *ctx;
    Py_ssize_t n, align, units;
    int chunks;
    int next; /* the next chunk to take */
} mpiopt_work;

static inline void *mpiopt_worker(void *arg) {
    mpiopt_work *w = (mpiopt_work *)arg;
    for (;;) {
        const int c = __atomic_fetch_add(&w->next, 1, __ATOMIC_RELAXED);
        if (c >= w->chunks) return NULL;
        const Py_ssize_t lo = w->units * c / w->chunks * w->align, hi = w->units * (c + 1) / w->chunks * w->align;
        w->fn(w->ctx, lo < w->n ? lo : w->n, hi < w->n ? hi : w->n, c);
    }
}

/* Threads for n elements: at least min_part elements each, at most `threads` (and MPIOPT_MAX_PARTS). */
static inline int mpiopt_parts(int threads, Py_ssize_t n, Py_ssize_t min_part) {
    Py_ssize_t parts = n / min_part;
    if (parts > threads) parts = threads;
    if (parts > MPIOPT_MAX_PARTS) parts = MPIOPT_MAX_PARTS;
    return parts < 1 ? 1 : (int)parts;
}

/* Run fn(ctx, lo, hi, chunk) over chunks covering [0, n) in order (chunk c before chunk c + 1), on
 * mpiopt_parts(threads, n, min_part) threads, the calling one included; returns the number of chunks
 * (1, the whole range, when one thread runs).  A thread that cannot be started leaves its chunks to
 * the others.  Call without the GIL. */
static inline int mpiopt_parallel_for_min(int threads, Py_ssize_t n, Py_ssize_t align, Py_ssize_t min_part,
                                          mpiopt_part_fn fn, void *ctx) {
    const int parts = mpiopt_parts(threads, n, min_part);
    if (parts == 1) {
        fn(ctx, 0, n, 0);
        return 1;
    }
    const Py_ssize_t units = (n + align - 1) / align;
    /* chunks of at least an eighth of a thread's minimum share, at most MPIOPT_MAX_PARTS */
    Py_ssize_t chunks = n / (min_part / 8 > 0 ? min_part / 8 : 1);
    if (chunks > MPIOPT_MAX_PARTS) chunks = MPIOPT_MAX_PARTS;
    if (chunks < parts) chunks = parts;
    if (chunks > units) chunks = units;
    mpiopt_work work = {fn, ctx, n, align, units, (int)chunks, 0};
    pthread_t ids[MPIOPT_MAX_PARTS];
    int started[MPIOPT_MAX_PARTS] = {0};
    for (int p = 1; p < parts; ++p) started[p] = pthread_create(&ids[p], NULL, mpiopt_worker, &work) == 0;
    mpiopt_worker(&work);
    for (int p = 1; p < parts; ++p)
        if (started[p]) pthread_join(ids[p], NULL);
    return (int)chunks;
}

/* mpiopt_parallel_for_min with threads' shares of at least MPIOPT_MIN_PART elements (streaming loops). */
static inline int mpiopt_parallel_for(int threads, Py_ssize_t n, Py_ssize_t align, mpiopt_part_fn fn, void *ctx) {
    return mpiopt_parallel_for_min(threads, n, align, MPIOPT_MIN_PART, fn, ctx);
}

#endif
