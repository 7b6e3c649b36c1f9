/* A parallel for over [0, n) on POSIX threads, shared by the C kernels.
 *
 * The loops it serves are memory-bound: one thread does not reach the
 * memory bandwidth a socket has (torch's fused CPU optimizers use all their
 * intra-op threads for the same reason).  The caller passes the thread count
 * (mpiopt.kernels.threads); each part is a contiguous range whose bounds are
 * multiples of `align` elements (so parts of a packed-bit loop own whole
 * bytes or words), and vectors too short to be worth a thread start (tens of
 * microseconds) run in the calling thread alone.  Loops whose elements cost
 * more than a streamed pass (random accesses at sparse indices) ask for
 * smaller parts.  Elementwise loops give the
 * same bits whatever the split; reductions combine per-part results that the
 * caller keeps in its context, indexed by part, in part order.
 */
#ifndef MPIOPT_PARALLEL_H
#define MPIOPT_PARALLEL_H

#include <pthread.h>

#define MPIOPT_MAX_PARTS 64
/* Elements a part must have at least (a quarter of a millisecond of memory traffic or more). */
#define MPIOPT_MIN_PART (1 << 18)

typedef void (*mpiopt_part_fn)(void *ctx, Py_ssize_t lo, Py_ssize_t hi, int part);

typedef struct {
    mpiopt_part_fn fn;
    void *ctx;
    Py_ssize_t lo, hi;
    int part;
} mpiopt_part;

static void *mpiopt_run_part(void *arg) {
    const mpiopt_part *p = (const mpiopt_part *)arg;
    p->fn(p->ctx, p->lo, p->hi, p->part);
    return NULL;
}

/* How many parts of at least min_part elements n elements split into (at least 1, at most threads). */
static int mpiopt_parts(int threads, Py_ssize_t n, Py_ssize_t min_part) {
    Py_ssize_t parts = n / min_part;
    if (parts > threads) parts = threads;
    if (parts > MPIOPT_MAX_PARTS) parts = MPIOPT_MAX_PARTS;
    return parts < 1 ? 1 : (int)parts;
}

/* Run fn(ctx, lo, hi, part) over mpiopt_parts(threads, n, min_part) contiguous parts covering [0, n),
 * part 0 in the calling thread; returns the number of parts.  A thread that cannot be started runs
 * its part here instead.  Call without the GIL. */
static int mpiopt_parallel_for_min(int threads, Py_ssize_t n, Py_ssize_t align, Py_ssize_t min_part, mpiopt_part_fn fn,
                                   void *ctx) {
    const int parts = mpiopt_parts(threads, n, min_part);
    mpiopt_part work[MPIOPT_MAX_PARTS];
    pthread_t ids[MPIOPT_MAX_PARTS];
    int started[MPIOPT_MAX_PARTS] = {0};
    const Py_ssize_t units = (n + align - 1) / align;
    for (int p = 0; p < parts; ++p) {
        Py_ssize_t lo = units * p / parts * align, hi = units * (p + 1) / parts * align;
        work[p] = (mpiopt_part){fn, ctx, lo < n ? lo : n, hi < n ? hi : n, p};
    }
    for (int p = 1; p < parts; ++p) started[p] = pthread_create(&ids[p], NULL, mpiopt_run_part, &work[p]) == 0;
    mpiopt_run_part(&work[0]);
    for (int p = 1; p < parts; ++p) {
        if (started[p]) pthread_join(ids[p], NULL);
        else mpiopt_run_part(&work[p]);
    }
    return parts;
}

/* mpiopt_parallel_for_min with parts of at least MPIOPT_MIN_PART elements (streaming loops). */
static int mpiopt_parallel_for(int threads, Py_ssize_t n, Py_ssize_t align, mpiopt_part_fn fn, void *ctx) {
    return mpiopt_parallel_for_min(threads, n, align, MPIOPT_MIN_PART, fn, ctx);
}

#endif
