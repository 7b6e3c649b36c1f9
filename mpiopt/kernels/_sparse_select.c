/* mpiopt.kernels._sparsec's selection and error feedback: scan and compress_marked find the top-k
 * candidates (error feedback's a = e + g and the candidates in one pass), indexed does the element
 * operations at int32 indices (error feedback's take-and-zero, gather, scatter), written into the
 * caller's workspaces (numpy's fancy indexing converts int32 indices to a k-element intp copy per
 * call).
 *
 * Threads (_parallel.h): scan splits on blocks of 64 entries (with an exact second pass when the
 * candidates cluster), indexed its indices in parts of 2**15 (unique within a call, so parts touch
 * disjoint entries).
 */
#include "_sparsec.h"

#include <math.h>

/* 64 entries at x (x += g first, when g is given): bit j set where the score of x[j], |x[j]|
 * (absolute) or x[j], is >= t (never for NaN); *nonfinite gets a non-zero bit where g has NaN or
 * +-inf (the gradient's finite check, in the pass that reads it anyway).  SSE2 where the compiler targets it (every x86-64):
 * a compare and movemask per vector, where gcc's own vectorization of the scalar loop below spends
 * more on folding each block's flags than the pass costs. */
#if defined(__SSE2__)
#include <emmintrin.h>
static inline uint64_t mask64_float(float *restrict x, const float *restrict g, int absolute, float t, int *nonfinite) {
    const __m128 T = _mm_set1_ps(t), magnitude = _mm_castsi128_ps(_mm_set1_epi32(0x7fffffff)), largest = _mm_set1_ps(FLT_MAX);
    __m128 bad = _mm_setzero_ps();
    uint64_t mask = 0;
    for (int q = 0; q < 16; ++q) {
        __m128 v = _mm_loadu_ps(x + 4 * q);
        if (g) {
            const __m128 gv = _mm_loadu_ps(g + 4 * q);
            bad = _mm_or_ps(bad, _mm_cmpnle_ps(_mm_and_ps(gv, magnitude), largest)); /* NaN or +-inf */
            v = _mm_add_ps(v, gv);
            _mm_storeu_ps(x + 4 * q, v);
        }
        if (absolute) v = _mm_and_ps(v, magnitude);
        mask |= (uint64_t)_mm_movemask_ps(_mm_cmpge_ps(v, T)) << (4 * q);
    }
    *nonfinite |= _mm_movemask_ps(bad);
    return mask;
}
static inline uint64_t mask64_double(double *restrict x, const double *restrict g, int absolute, double t, int *nonfinite) {
    const __m128d T = _mm_set1_pd(t), magnitude = _mm_castsi128_pd(_mm_set1_epi64x(0x7fffffffffffffffLL));
    const __m128d largest = _mm_set1_pd(DBL_MAX);
    __m128d bad = _mm_setzero_pd();
    uint64_t mask = 0;
    for (int q = 0; q < 32; ++q) {
        __m128d v = _mm_loadu_pd(x + 2 * q);
        if (g) {
            const __m128d gv = _mm_loadu_pd(g + 2 * q);
            bad = _mm_or_pd(bad, _mm_cmpnle_pd(_mm_and_pd(gv, magnitude), largest)); /* NaN or +-inf */
            v = _mm_add_pd(v, gv);
            _mm_storeu_pd(x + 2 * q, v);
        }
        if (absolute) v = _mm_and_pd(v, magnitude);
        mask |= (uint64_t)_mm_movemask_pd(_mm_cmpge_pd(v, T)) << (2 * q);
    }
    *nonfinite |= _mm_movemask_pd(bad);
    return mask;
}
#else
#define MASK64(T, ABS, MAX)                                                                            \
    static inline uint64_t mask64_##T(T *restrict x, const T *restrict g, int absolute, T t, int *nonfinite) { \
        uint64_t mask = 0;                                                                             \
        for (int j = 0; j < 64; ++j) {                                                                 \
            if (g) *nonfinite |= !(ABS(g[j]) <= MAX);                                                  \
            const T v = g ? x[j] + g[j] : x[j];                                                        \
            if (g) x[j] = v;                                                                           \
            mask |= (uint64_t)((absolute ? ABS(v) : v) >= t) << j;                                     \
        }                                                                                              \
        return mask;                                                                                   \
    }
MASK64(float, fabsf, FLT_MAX)
MASK64(double, fabs, DBL_MAX)
#endif

/* Top-k candidates: the positions (ascending) and scores of the entries of [lo, hi) whose score is
 * >= t (NaN never is), as many as the outputs hold; returns how many there are.  With g, x[i] +=
 * g[i] first, in the same pass (error feedback's a = e + g).  A score is |x[i]| (absolute) or x[i],
 * except at the override positions (ascending; `over` points at the first one >= lo), whose score
 * is that times a given factor (RegTop-k's entries sent last step: their regularizer).  Blocks of
 * 64 entries give a bit mask of their hits (rare), corrected at the block's overrides, and only the
 * set bits are visited. */
#define SCAN(T, ABS, MAX)                                                                              \
    static Py_ssize_t scan_##T(T *restrict x, const T *restrict g, Py_ssize_t lo, Py_ssize_t hi, T t,  \
                               int absolute, const int32_t *over, const T *over_factors, Py_ssize_t n_over, \
                               int32_t *idx, T *scores, Py_ssize_t capacity, int *nonfinite) {         \
        Py_ssize_t count = 0, p = 0, i = lo;                                                           \
        Py_ssize_t next = n_over ? over[0] : hi;                                                       \
        for (; i + 64 <= hi; i += 64) {                                                                \
            uint64_t mask = mask64_##T(x + i, g ? g + i : NULL, absolute, t, nonfinite);               \
            /* the block's overrides (x += g done): their factors times their scores decide their bits */ \
            uint64_t overridden = 0;                                                                   \
            const Py_ssize_t first = p;                                                                \
            for (; next < i + 64; next = ++p < n_over ? over[p] : hi) {                                \
                const T v = over_factors[p] * (absolute ? ABS(x[next]) : x[next]);                     \
                overridden |= (uint64_t)1 << (next - i);                                               \
                mask = (mask & ~((uint64_t)1 << (next - i))) | ((uint64_t)(v >= t) << (next - i));     \
            }                                                                                          \
            for (Py_ssize_t q = first; mask; mask &= mask - 1) {                                       \
                const int b = __builtin_ctzll(mask);                                                   \
                T v;                                                                                   \
                if ((overridden >> b) & 1) {                                                           \
                    while (over[q] != i + b) ++q;                                                      \
                    v = over_factors[q] * (absolute ? ABS(x[i + b]) : x[i + b]);                       \
                } else {                                                                               \
                    v = absolute ? ABS(x[i + b]) : x[i + b];                                           \
                }                                                                                      \
                if (count < capacity) { idx[count] = (int32_t)(i + b); scores[count] = v; }            \
                ++count;                                                                               \
            }                                                                                          \
        }                                                                                              \
        for (Py_ssize_t j = i; j < hi; ++j) { /* the last entries, one at a time */                     \
            if (g) {                                                                                   \
                *nonfinite |= !(ABS(g[j]) <= MAX);                                                     \
                x[j] = x[j] + g[j];                                                                    \
            }                                                                                          \
            T v;                                                                                       \
            if (j == next) {                                                                           \
                v = over_factors[p++] * (absolute ? ABS(x[j]) : x[j]);                                 \
                next = p < n_over ? over[p] : hi;                                                      \
            } else {                                                                                   \
                v = absolute ? ABS(x[j]) : x[j];                                                       \
            }                                                                                          \
            if (v >= t) {                                                                              \
                if (count < capacity) { idx[count] = (int32_t)j; scores[count] = v; }                 \
                ++count;                                                                               \
            }                                                                                          \
        }                                                                                              \
        return count;                                                                                  \
    }
SCAN(float, fabsf, FLT_MAX)
SCAN(double, fabs, DBL_MAX)

/* One scan call, split into chunks; chunk c writes its candidates into its share of the outputs
 * (proportional to its length, or, when `exact`, the room start[c] / room[c] that a first pass's
 * counts give) and counts them in counts[c]. */
typedef struct {
    int exact;
    Py_ssize_t itemsize, n, capacity, n_over;
    char *x;
    const char *g;
    double threshold;
    int absolute;
    const int32_t *over;
    const char *over_factors;
    int32_t *idx;
    char *scores;
    Py_ssize_t start[MPIOPT_MAX_PARTS], counts[MPIOPT_MAX_PARTS], room[MPIOPT_MAX_PARTS];
    int nonfinite[MPIOPT_MAX_PARTS]; /* the pass with g: whether chunk c's g has NaN or +-inf */
} scan_job;

static void scan_part(void *ctx, Py_ssize_t lo, Py_ssize_t hi, int part) {
    scan_job *j = (scan_job *)ctx;
    const Py_ssize_t s = j->itemsize;
    const Py_ssize_t begin = j->exact ? j->start[part] : (j->n ? j->capacity * lo / j->n : 0);
    const Py_ssize_t end = j->exact ? begin + j->room[part] : (j->n ? j->capacity * hi / j->n : 0);
    /* the part's overrides */
    const Py_ssize_t a = mpiopt_lower_bound(j->over, j->n_over, lo);
    const Py_ssize_t n_over = mpiopt_lower_bound(j->over, j->n_over, hi) - a;
    int nonfinite = 0;
    j->start[part] = begin;
    j->room[part] = end - begin;
    if (s == 4)
        j->counts[part] = scan_float((float *)j->x, (const float *)j->g, lo, hi, (float)j->threshold, j->absolute,
                                     j->over + a, (const float *)j->over_factors + a, n_over, j->idx + begin,
                                     (float *)j->scores + begin, end - begin, &nonfinite);
    else
        j->counts[part] = scan_double((double *)j->x, (const double *)j->g, lo, hi, j->threshold, j->absolute,
                                      j->over + a, (const double *)j->over_factors + a, n_over, j->idx + begin,
                                      (double *)j->scores + begin, end - begin, &nonfinite);
    if (j->g) j->nonfinite[part] = nonfinite; /* the exact second pass reads no g: the first pass's flags stay */
}

/* scan(x, g, n, itemsize, threshold, absolute, over, over_factors, idx, scores, threads) -> (int, bool) */
PyObject *mpiopt_sparse_scan(PyObject *self, PyObject *args) {
    Py_buffer x = {0}, g = {0}, over = {0}, over_factors = {0}, idx = {0}, scores = {0};
    PyObject *go, *overo, *over_factorso;
    Py_ssize_t n, itemsize;
    double threshold;
    int absolute, threads;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*OnndpOOw*w*i", &x, &go, &n, &itemsize, &threshold, &absolute, &overo, &over_factorso,
                          &idx, &scores, &threads))
        return NULL;
    PyObject *result = NULL;
    if (go != Py_None && PyObject_GetBuffer(go, &g, PyBUF_C_CONTIGUOUS) < 0) goto done;
    if (overo != Py_None && PyObject_GetBuffer(overo, &over, PyBUF_C_CONTIGUOUS) < 0) goto done;
    if (over_factorso != Py_None && PyObject_GetBuffer(over_factorso, &over_factors, PyBUF_C_CONTIGUOUS) < 0) goto done;
    const Py_ssize_t n_over = over.obj ? over.len / 4 : 0;
    if (n < 0 || (itemsize != 4 && itemsize != 8) || x.len < n * itemsize || (g.obj && g.len < n * itemsize) ||
        (over.obj == NULL) != (over_factors.obj == NULL) || (over.obj && over_factors.len < n_over * itemsize)) {
        PyErr_Format(PyExc_ValueError, "scan: bad n=%zd itemsize=%zd or buffers too small", n, itemsize);
        goto done;
    }
    for (Py_ssize_t i = 0; i < n_over; ++i) {
        const int32_t at = ((const int32_t *)over.buf)[i];
        if (at < 0 || at >= n || (i && at <= ((const int32_t *)over.buf)[i - 1])) {
            PyErr_SetString(PyExc_ValueError, "scan: override positions must be unique, ascending and in [0, n)");
            goto done;
        }
    }
    scan_job *job = PyMem_Malloc(sizeof(scan_job));
    if (job == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    job->exact = 0;
    job->itemsize = itemsize;
    job->n = n;
    job->capacity = idx.len / 4 < scores.len / itemsize ? idx.len / 4 : scores.len / itemsize;
    job->n_over = n_over;
    job->x = (char *)x.buf;
    job->g = g.obj ? (const char *)g.buf : NULL;
    job->threshold = threshold;
    job->absolute = absolute;
    job->over = (const int32_t *)over.buf;
    job->over_factors = (const char *)over_factors.buf;
    job->idx = (int32_t *)idx.buf;
    job->scores = (char *)scores.buf;
    int parts;
    Py_ssize_t total = 0, fits = 1;
    int nonfinite = 0;
    Py_BEGIN_ALLOW_THREADS
    parts = mpiopt_parallel_for(threads, n, 64, scan_part, job);
    if (job->g)
        for (int p = 0; p < parts; ++p) nonfinite |= job->nonfinite[p];
    /* Move each chunk's candidates down after the previous chunk's, in order. */
    for (int p = 0; p < parts; ++p) {
        fits &= job->counts[p] <= job->room[p];
        if (fits && job->start[p] != total) {
            memmove(job->idx + total, job->idx + job->start[p], job->counts[p] * 4);
            memmove(job->scores + total * itemsize, job->scores + job->start[p] * itemsize, job->counts[p] * itemsize);
        }
        total += job->counts[p];
    }
    if (!fits && total <= job->capacity) {
        /* A chunk's share overflowed (its candidates are many: the large entries of a vector cluster)
         * although all fit: scan again, x += g done, each chunk writing exactly where its count says. */
        Py_ssize_t at = 0;
        for (int p = 0; p < parts; ++p) {
            job->start[p] = at;
            job->room[p] = job->counts[p];
            at += job->counts[p];
        }
        job->exact = 1;
        job->g = NULL;
        mpiopt_parallel_for(threads, n, 64, scan_part, job);
    }
    Py_END_ALLOW_THREADS
    /* More candidates than the outputs hold: report their number, the outputs partial. */
    result = Py_BuildValue("(nO)", total, nonfinite ? Py_False : Py_True);
    PyMem_Free(job);
done:
    PyBuffer_Release(&x);
    if (g.obj) PyBuffer_Release(&g);
    if (over.obj) PyBuffer_Release(&over);
    if (over_factors.obj) PyBuffer_Release(&over_factors);
    PyBuffer_Release(&idx);
    PyBuffer_Release(&scores);
    return result;
}

PyObject *mpiopt_sparse_compress_marked(PyObject *self, PyObject *args) {
    Py_buffer src, mask, out;
    Py_ssize_t n;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*nw*", &src, &mask, &n, &out)) return NULL;
    PyObject *result = NULL;
    if (n < 0 || src.len < 4 * n || mask.len < n) {
        PyErr_Format(PyExc_ValueError, "compress_marked: bad n=%zd or buffers too small", n);
    } else {
        const int32_t *in = (const int32_t *)src.buf;
        const unsigned char *keep = (const unsigned char *)mask.buf;
        int32_t *dst = (int32_t *)out.buf;
        const Py_ssize_t capacity = out.len / 4;
        Py_ssize_t count = 0;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; ++i) {
            if (keep[i]) {
                if (count < capacity) dst[count] = in[i];
                ++count;
            }
        }
        Py_END_ALLOW_THREADS
        result = PyLong_FromSsize_t(count);
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&mask);
    PyBuffer_Release(&out);
    return result;
}

/* x[idx[i]] op= ..., the k int32 indices in [0, n); each element rounded on its own, as numpy's loops. */
enum { TAKE_ZERO, ADD, ZERO, DIVIDE, SUB_SCALED, GATHER, SET };
#define INDEXED(T)                                                                                     \
    static void indexed_##T(int op, T *x, const int32_t *idx, Py_ssize_t k, T *other, double scalar) { \
        const T s = (T)scalar;                                                                         \
        for (Py_ssize_t i = 0; i < k; ++i) {                                                           \
            T *xi = x + idx[i];                                                                        \
            switch (op) {                                                                              \
            case TAKE_ZERO: other[i] = *xi; *xi = 0; break;                                            \
            case ADD: *xi += other[i]; break;                                                          \
            case ZERO: *xi = 0; break;                                                                 \
            case DIVIDE: *xi /= s; break;                                                              \
            case SUB_SCALED: { T product = s * other[idx[i]]; *xi -= product; } break;                 \
            case GATHER: other[i] = *xi; break;                                                        \
            default: *xi = other[i];                                                                   \
            }                                                                                          \
        }                                                                                              \
    }
INDEXED(float)
INDEXED(double)

/* One indexed call, split over the k indices (unique within a call, so parts touch disjoint elements). */
typedef struct {
    int op;
    Py_ssize_t itemsize;
    char *x;
    const int32_t *idx;
    char *other;
    double scalar;
} indexed_job;

static void indexed_part(void *ctx, Py_ssize_t lo, Py_ssize_t hi, int part) {
    const indexed_job *j = (const indexed_job *)ctx;
    /* other is indexed like idx, except for SUB_SCALED, which reads it at the indices */
    const Py_ssize_t at = j->op == SUB_SCALED ? 0 : lo * j->itemsize;
    (void)part;
    if (j->itemsize == 4) indexed_float(j->op, (float *)j->x, j->idx + lo, hi - lo, (float *)(j->other + at), j->scalar);
    else indexed_double(j->op, (double *)j->x, j->idx + lo, hi - lo, (double *)(j->other + at), j->scalar);
}

PyObject *mpiopt_sparse_indexed(PyObject *self, PyObject *args) {
    Py_buffer x, indices, other;
    int op, threads;
    Py_ssize_t k, itemsize;
    double scalar;
    (void)self;
    if (!PyArg_ParseTuple(args, "iw*y*nnw*di", &op, &x, &indices, &k, &itemsize, &other, &scalar, &threads)) return NULL;
    PyObject *result = NULL;
    const Py_ssize_t n = x.len / (itemsize ? itemsize : 1);
    const Py_ssize_t other_needed = op == SUB_SCALED ? n : (op == ZERO || op == DIVIDE ? 0 : k);
    const int32_t *idx = (const int32_t *)indices.buf;
    Py_ssize_t bad = -1;
    if (op < TAKE_ZERO || op > SET || k < 0 || (itemsize != 4 && itemsize != 8) || indices.len < 4 * k
        || other.len < other_needed * itemsize) {
        PyErr_Format(PyExc_ValueError, "indexed: bad op=%d k=%zd itemsize=%zd or buffers too small", op, k, itemsize);
    } else {
        for (Py_ssize_t i = 0; i < k && bad < 0; ++i)
            if (idx[i] < 0 || idx[i] >= n) bad = i;
        if (bad >= 0) {
            PyErr_Format(PyExc_ValueError, "indexed: index %zd is out of [0, %zd)", (Py_ssize_t)idx[bad], n);
        } else {
            indexed_job job = {op, itemsize, (char *)x.buf, idx, (char *)other.buf, scalar};
            Py_BEGIN_ALLOW_THREADS
            mpiopt_parallel_for_min(threads, k, 1, INDEXED_MIN_PART, indexed_part, &job);
            Py_END_ALLOW_THREADS
            Py_INCREF(Py_None);
            result = Py_None;
        }
    }
    PyBuffer_Release(&x);
    PyBuffer_Release(&indices);
    PyBuffer_Release(&other);
    return result;
}
