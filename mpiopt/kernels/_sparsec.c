/* Fused CPU loops for Top-k and RegTop-k (optional): selection, payload bitmaps, aggregation.
 *
 * bitmap_set, bitmap_mark, bitmap_indices: the payload's and the union's
 * bitmaps (bit order of the packed signs), without numpy's d-sized mask and
 * unpacking.
 *
 * scan, compress_marked, scale_sampled, regtopk_ratio: the top-k selection
 * (error feedback's a = e + g and the candidates in one pass) and RegTop-k's
 * regularizer.
 *
 * indexed, merge_rows and settle: element operations at int32 indices and
 * the aggregation of the workers' sorted payloads, written into the caller's
 * workspaces (numpy's fancy indexing converts int32 indices to a k-element
 * intp copy per call, its masks and nonzero() allocate).
 *
 * Threads (_parallel.h): scan splits on blocks of 64 entries (with an exact
 * second pass when the candidates cluster), indexed its indices and settle
 * its union in parts of 2**15 (unique within a call, so parts touch disjoint
 * entries).
 *
 * The float loops (indexed, settle, regtopk_ratio) round every product and
 * sum on their own, as numpy does (_cloops.h).  Without a C compiler mpiopt
 * uses the numpy code, which gives the same bits.
 */
#include "_cloops.h"

#include <math.h>

/* Mark the k int32 indices in a bitmap of d bits (no clearing): 0, or 1 + the position of a bad index. */
static Py_ssize_t mark_bits(const int32_t *idx, Py_ssize_t k, Py_ssize_t d, unsigned char *bits) {
    for (Py_ssize_t i = 0; i < k; ++i) {
        int32_t j = idx[i];
        if (j < 0 || j >= d) return i + 1;
        bits[j >> 3] |= (unsigned char)(1u << (j & 7));
    }
    return 0;
}

static PyObject *bitmap_fill(PyObject *args, int clear, const char *name) {
    Py_buffer indices, out;
    Py_ssize_t k, d;
    if (!PyArg_ParseTuple(args, "y*nnw*", &indices, &k, &d, &out)) return NULL;
    PyObject *result = NULL;
    if (k < 0 || d < 0 || indices.len < 4 * k || out.len < (d + 7) / 8) {
        PyErr_Format(PyExc_ValueError, "%s: bad k=%zd d=%zd or buffers too small", name, k, d);
    } else {
        const int32_t *idx = (const int32_t *)indices.buf;
        Py_ssize_t bad;
        Py_BEGIN_ALLOW_THREADS
        if (clear) memset(out.buf, 0, (size_t)((d + 7) / 8));
        bad = mark_bits(idx, k, d, (unsigned char *)out.buf);
        Py_END_ALLOW_THREADS
        if (bad) {
            PyErr_Format(PyExc_ValueError, "%s: index %zd is out of [0, %zd)", name, (Py_ssize_t)idx[bad - 1], d);
        } else {
            Py_INCREF(Py_None);
            result = Py_None;
        }
    }
    PyBuffer_Release(&indices);
    PyBuffer_Release(&out);
    return result;
}

static PyObject *py_bitmap_set(PyObject *self, PyObject *args) {
    (void)self;
    return bitmap_fill(args, 1, "bitmap_set");
}

static PyObject *py_bitmap_mark(PyObject *self, PyObject *args) {
    (void)self;
    return bitmap_fill(args, 0, "bitmap_mark");
}

static PyObject *py_bitmap_indices(PyObject *self, PyObject *args) {
    Py_buffer bitmap, out;
    Py_ssize_t d;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*nw*", &bitmap, &d, &out)) return NULL;
    PyObject *result = NULL;
    if (d < 0 || bitmap.len < (d + 7) / 8) {
        PyErr_Format(PyExc_ValueError, "bitmap_indices: bad d=%zd or bitmap too small", d);
    } else {
        const unsigned char *bits = (const unsigned char *)bitmap.buf;
        int32_t *idx = (int32_t *)out.buf;
        const Py_ssize_t capacity = out.len / 4;
        Py_ssize_t count = 0;
        Py_BEGIN_ALLOW_THREADS
        const Py_ssize_t nbytes = (d + 7) / 8;
        /* 8 bytes at a time (little-endian words hold bit i of the bitmap as their bit i), then the rest */
        Py_ssize_t b = 0;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
        for (; b + 8 <= nbytes; b += 8) {
            uint64_t word = load64(bits + b);
            if (b + 8 == nbytes && d % 8) word &= ~(uint64_t)0 >> (8 - d % 8);  /* pad bits are ignored */
            while (word) {
                const int j = __builtin_ctzll(word);
                if (count < capacity) idx[count] = (int32_t)(8 * b + j);
                ++count;
                word &= word - 1;
            }
        }
#endif
        for (; b < nbytes; ++b) {
            unsigned byte = bits[b];
            if (b == nbytes - 1 && d % 8) byte &= (1u << (d % 8)) - 1;  /* pad bits are ignored */
            while (byte) {
                const int j = __builtin_ctz(byte);
                if (count < capacity) idx[count] = (int32_t)(8 * b + j);
                ++count;
                byte &= byte - 1;
            }
        }
        Py_END_ALLOW_THREADS
        result = PyLong_FromSsize_t(count);
    }
    PyBuffer_Release(&bitmap);
    PyBuffer_Release(&out);
    return result;
}

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
static PyObject *py_scan(PyObject *self, PyObject *args) {
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

static PyObject *py_compress_marked(PyObject *self, PyObject *args) {
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

/* Random accesses: a part of 2**15 of them takes far longer than a thread start. */
#define INDEXED_MIN_PART (1 << 15)

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

static PyObject *py_indexed(PyObject *self, PyObject *args) {
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

#define MERGE_MAX_ROWS 8

/* Top-k's aggregation without a scatter per worker: the P workers' sorted rows are merged.
 *
 * merge_rows: the sorted union of P rows of int32 indices (each strictly ascending, in [0, d)) into
 * union_out and, per union entry, the sum of the rows' values there in row order (0 + v_first +
 * ...: the floats of zeroing the aggregate and scatter-adding the rows in order) into sums_out.
 * settle: the aggregate's new entries (sums / divisor) written at the union, the previous step's
 * entries that are not in it zeroed, and optionally x -= lr * G at the union, in one walk over both
 * sorted lists: a random access per entry instead of one per pass. */
#define MERGE_ROWS(T)                                                                                   \
    static Py_ssize_t merge_rows_##T(int rows, const int32_t *const *idx, const char *const *val,      \
                                     const Py_ssize_t *len, Py_ssize_t d, int32_t *out, T *sums,       \
                                     Py_ssize_t capacity) {                                            \
        Py_ssize_t pos[MERGE_MAX_ROWS] = {0}, u = 0;                                                  \
        for (;;) {                                                                                     \
            int32_t m = INT32_MAX;                                                                     \
            int any = 0;                                                                               \
            for (int r = 0; r < rows; ++r)                                                             \
                if (pos[r] < len[r] && idx[r][pos[r]] <= m) { m = idx[r][pos[r]]; any = 1; }            \
            if (!any) return u;                                                                        \
            if (m < 0 || m >= d) return -1;                                                            \
            if (u >= capacity) return -2;                                                              \
            T sum = 0;                                                                                 \
            for (int r = 0; r < rows; ++r) {                                                           \
                if (pos[r] < len[r] && idx[r][pos[r]] == m) {                                          \
                    T v;                                                                               \
                    memcpy(&v, val[r] + pos[r] * sizeof(T), sizeof v); /* payload rows need not be aligned */ \
                    sum = sum + v;                                                                     \
                    ++pos[r];                                                                          \
                    if (pos[r] < len[r] && idx[r][pos[r]] <= m) return -1; /* not strictly ascending */ \
                }                                                                                      \
            }                                                                                          \
            out[u] = m;                                                                                \
            sums[u] = sum;                                                                             \
            ++u;                                                                                       \
        }                                                                                              \
    }                                                                                                  \
    static void settle_##T(T *g, T *x, const int32_t *stale, Py_ssize_t n_stale, const int32_t *idx,    \
                           T *sums, Py_ssize_t u, double divisor, double lr) {                         \
        const T p = (T)divisor, s = (T)lr;                                                             \
        Py_ssize_t i = 0;                                                                              \
        for (Py_ssize_t j = 0; j < u; ++j) {                                                           \
            const int32_t at = idx[j];                                                                 \
            for (; i < n_stale && stale[i] < at; ++i) g[stale[i]] = 0;                                 \
            if (i < n_stale && stale[i] == at) ++i; /* written below */                                \
            const T value = divisor != 1.0 ? sums[j] / p : sums[j];                                    \
            if (g) g[at] = value;                                                                      \
            sums[j] = value; /* G's values at the union, in order: a sparse gradient for the update */ \
            if (x) {                                                                                   \
                const T product = s * value;                                                           \
                x[at] -= product;                                                                      \
            }                                                                                          \
        }                                                                                              \
        for (; i < n_stale; ++i) g[stale[i]] = 0;                                                      \
    }
MERGE_ROWS(float)
MERGE_ROWS(double)

static PyObject *py_merge_rows(PyObject *self, PyObject *args) {
    PyObject *idx_rows, *val_rows;
    Py_ssize_t d, itemsize;
    Py_buffer out = {0}, sums = {0};
    (void)self;
    if (!PyArg_ParseTuple(args, "O!O!nnw*w*", &PyTuple_Type, &idx_rows, &PyTuple_Type, &val_rows, &d, &itemsize, &out,
                          &sums))
        return NULL;
    Py_buffer ib[MERGE_MAX_ROWS], vb[MERGE_MAX_ROWS];
    const int32_t *idx[MERGE_MAX_ROWS];
    const char *val[MERGE_MAX_ROWS];
    Py_ssize_t len[MERGE_MAX_ROWS];
    const Py_ssize_t rows = PyTuple_GET_SIZE(idx_rows);
    int held = 0;
    PyObject *result = NULL;
    if (rows > MERGE_MAX_ROWS || PyTuple_GET_SIZE(val_rows) != rows || (itemsize != 4 && itemsize != 8)) {
        PyErr_Format(PyExc_ValueError, "merge_rows: %zd rows (at most %d, as many values as indices), itemsize %zd",
                     rows, MERGE_MAX_ROWS, itemsize);
        goto done;
    }
    for (; held < rows; ++held) {
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(idx_rows, held), &ib[held], PyBUF_C_CONTIGUOUS) < 0) goto done;
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(val_rows, held), &vb[held], PyBUF_C_CONTIGUOUS) < 0) {
            PyBuffer_Release(&ib[held]);
            goto done;
        }
        len[held] = ib[held].len / 4;
        if (vb[held].len < len[held] * itemsize) {
            PyErr_SetString(PyExc_ValueError, "merge_rows: a row has fewer values than indices");
            PyBuffer_Release(&ib[held]);
            PyBuffer_Release(&vb[held]);
            goto done;
        }
        idx[held] = (const int32_t *)ib[held].buf;
        val[held] = (const char *)vb[held].buf;
    }
    const Py_ssize_t capacity = out.len / 4 < sums.len / itemsize ? out.len / 4 : sums.len / itemsize;
    Py_ssize_t u;
    Py_BEGIN_ALLOW_THREADS
    u = itemsize == 4 ? merge_rows_float((int)rows, idx, val, len, d, (int32_t *)out.buf, (float *)sums.buf, capacity)
                      : merge_rows_double((int)rows, idx, val, len, d, (int32_t *)out.buf, (double *)sums.buf, capacity);
    Py_END_ALLOW_THREADS
    if (u == -1) PyErr_Format(PyExc_ValueError, "merge_rows: every row must hold unique indices in [0, %zd), ascending", d);
    else if (u == -2) PyErr_SetString(PyExc_ValueError, "merge_rows: the outputs cannot hold the union");
    else result = PyLong_FromSsize_t(u);
done:
    for (int r = 0; r < held; ++r) {
        PyBuffer_Release(&ib[r]);
        PyBuffer_Release(&vb[r]);
    }
    PyBuffer_Release(&out);
    PyBuffer_Release(&sums);
    return result;
}

/* One settle call, split over the union: chunk [j0, j1) also zeroes the stale entries from its first
 * union entry (or the start) up to the next chunk's first one (or the end). */
typedef struct {
    Py_ssize_t itemsize, u, n_stale;
    char *g, *x;
    const int32_t *stale, *idx;
    char *sums;
    double divisor, lr;
} settle_job;

static void settle_part(void *ctx, Py_ssize_t j0, Py_ssize_t j1, int part) {
    const settle_job *j = (const settle_job *)ctx;
    const Py_ssize_t s0 = j0 == 0 ? 0 : mpiopt_lower_bound(j->stale, j->n_stale, j->idx[j0]);
    const Py_ssize_t s1 = j1 == j->u ? j->n_stale : mpiopt_lower_bound(j->stale, j->n_stale, j->idx[j1]);
    (void)part;
    if (j->itemsize == 4)
        settle_float((float *)j->g, (float *)j->x, j->stale + s0, s1 - s0, j->idx + j0, (float *)j->sums + j0,
                     j1 - j0, j->divisor, j->lr);
    else
        settle_double((double *)j->g, (double *)j->x, j->stale + s0, s1 - s0, j->idx + j0, (double *)j->sums + j0,
                      j1 - j0, j->divisor, j->lr);
}

static PyObject *py_settle(PyObject *self, PyObject *args) {
    Py_buffer g = {0}, x = {0}, stale = {0}, idx = {0}, sums = {0};
    PyObject *go, *xo, *staleo;
    Py_ssize_t u, itemsize;
    double divisor, lr;
    (void)self;
    int threads;
    if (!PyArg_ParseTuple(args, "OOOy*w*nnddi", &go, &xo, &staleo, &idx, &sums, &u, &itemsize, &divisor, &lr, &threads))
        return NULL;
    PyObject *result = NULL;
    if (go != Py_None && PyObject_GetBuffer(go, &g, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) goto done;
    if (xo != Py_None && PyObject_GetBuffer(xo, &x, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) goto done;
    if (staleo != Py_None && PyObject_GetBuffer(staleo, &stale, PyBUF_C_CONTIGUOUS) < 0) goto done;
    /* without g the stale entries are not touched, and without g and x no entry of a vector is */
    const Py_ssize_t written = g.obj ? g.len : x.obj ? x.len : (Py_ssize_t)INT32_MAX * itemsize;
    const Py_ssize_t n = (itemsize == 4 || itemsize == 8) ? written / itemsize : 0;
    const Py_ssize_t n_stale = g.obj && stale.obj ? stale.len / 4 : 0;
    int ok = (itemsize == 4 || itemsize == 8) && u >= 0 && idx.len >= 4 * u && sums.len >= u * itemsize &&
             (!x.obj || !g.obj || x.len == g.len);
    for (Py_ssize_t i = 0; ok && i < u; ++i) {
        const int32_t at = ((const int32_t *)idx.buf)[i];
        ok = at >= 0 && at < n && (i == 0 || at > ((const int32_t *)idx.buf)[i - 1]);
    }
    for (Py_ssize_t i = 0; ok && i < n_stale; ++i) {
        const int32_t at = ((const int32_t *)stale.buf)[i];
        ok = at >= 0 && at < n && (i == 0 || at > ((const int32_t *)stale.buf)[i - 1]);
    }
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "settle: bad sizes, or indices that are not unique, ascending and in range");
        goto done;
    }
    settle_job job = {itemsize, u, n_stale, g.obj ? (char *)g.buf : NULL, x.obj ? (char *)x.buf : NULL, (const int32_t *)stale.buf,
                      (const int32_t *)idx.buf, (char *)sums.buf, divisor, lr};
    Py_BEGIN_ALLOW_THREADS
    mpiopt_parallel_for_min(threads, u, 1, INDEXED_MIN_PART, settle_part, &job);
    Py_END_ALLOW_THREADS
    Py_INCREF(Py_None);
    result = Py_None;
done:
    if (g.obj) PyBuffer_Release(&g);
    if (x.obj) PyBuffer_Release(&x);
    if (stale.obj) PyBuffer_Release(&stale);
    PyBuffer_Release(&idx);
    PyBuffer_Release(&sums);
    return result;
}

/* RegTop-k's |1 + delta| / mu at the k entries sent last step, from the sent values s and last step's
 * aggregate G: own = s * w; delta = (G[idx] - own) / own, or q where own is 0; out = |delta + 1| / mu.
 * numpy's operations on k-sized rows, each rounded to the dtype, in one loop (the tanh that makes the
 * regularizer stays numpy's, for its bits). */
#define RATIO(T, ABS)                                                                                  \
    static void ratio_##T(const T *prev, const int32_t *support, Py_ssize_t n_support, const int32_t *idx, \
                          const T *sent, T *out, Py_ssize_t k, double w, double q, double mu) {        \
        const T w_ = (T)w, q_ = (T)q, mu_ = (T)mu;                                                     \
        Py_ssize_t s = support && k ? mpiopt_lower_bound(support, n_support, idx[0]) : 0;                     \
        for (Py_ssize_t i = 0; i < k; ++i) {                                                           \
            const T own = sent[i] * w_;                                                                \
            T r = q_;                                                                                  \
            T previous;                                                                                \
            if (support) { /* G_prev's non-zero entries, walked in step with idx (both ascending) */   \
                while (s < n_support && support[s] < idx[i]) ++s;                                      \
                previous = s < n_support && support[s] == idx[i] ? prev[s] : (T)0;                      \
            } else {                                                                                   \
                previous = prev[idx[i]];                                                               \
            }                                                                                          \
            if (own != 0) {                                                                            \
                const T difference = previous - own;                                                   \
                r = difference / own;                                                                  \
            }                                                                                          \
            r = r + (T)1;                                                                              \
            out[i] = ABS(r) / mu_;                                                                     \
        }                                                                                              \
    }
RATIO(float, fabsf)
RATIO(double, fabs)

typedef struct {
    Py_ssize_t itemsize, n_support;
    const char *prev, *sent;
    const int32_t *idx, *support;
    char *out;
    double w, q, mu;
} ratio_job;

static void ratio_part(void *ctx, Py_ssize_t lo, Py_ssize_t hi, int part) {
    const ratio_job *j = (const ratio_job *)ctx;
    const Py_ssize_t at = lo * j->itemsize;
    (void)part;
    if (j->itemsize == 4)
        ratio_float((const float *)j->prev, j->support, j->n_support, j->idx + lo, (const float *)(j->sent + at),
                    (float *)(j->out + at), hi - lo, j->w, j->q, j->mu);
    else
        ratio_double((const double *)j->prev, j->support, j->n_support, j->idx + lo, (const double *)(j->sent + at),
                     (double *)(j->out + at), hi - lo, j->w, j->q, j->mu);
}

static PyObject *py_regtopk_ratio(PyObject *self, PyObject *args) {
    Py_buffer prev, indices, sent, out, support = {0};
    PyObject *supporto = Py_None;
    Py_ssize_t k, itemsize;
    double w, q, mu;
    int threads;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*y*w*nndddi|O", &prev, &indices, &sent, &out, &k, &itemsize, &w, &q, &mu, &threads,
                          &supporto))
        return NULL;
    PyObject *result = NULL;
    if (supporto != Py_None && PyObject_GetBuffer(supporto, &support, PyBUF_C_CONTIGUOUS) < 0) goto done;
    const Py_ssize_t n = prev.len / (itemsize ? itemsize : 1), n_support = support.obj ? support.len / 4 : 0;
    const int32_t *idx = (const int32_t *)indices.buf, *at = (const int32_t *)support.buf;
    /* with a support, prev holds G_prev at its entries (ascending), and idx must ascend too */
    int ok = (itemsize == 4 || itemsize == 8) && k >= 0 && indices.len >= 4 * k && sent.len >= k * itemsize &&
             out.len >= k * itemsize && (!support.obj || n >= n_support);
    for (Py_ssize_t i = 0; ok && i < k; ++i) ok = support.obj ? (i == 0 || idx[i] > idx[i - 1]) : idx[i] >= 0 && idx[i] < n;
    for (Py_ssize_t i = 1; ok && i < n_support; ++i) ok = at[i] > at[i - 1];
    if (!ok) {
        PyErr_Format(PyExc_ValueError,
                     "regtopk_ratio: bad k=%zd itemsize=%zd, buffers too small, indices out of [0, %zd) or not ascending",
                     k, itemsize, n);
    } else {
        ratio_job job = {itemsize, n_support, (const char *)prev.buf, (const char *)sent.buf, idx, at, (char *)out.buf, w, q, mu};
        Py_BEGIN_ALLOW_THREADS
        mpiopt_parallel_for_min(threads, k, 1, INDEXED_MIN_PART, ratio_part, &job);
        Py_END_ALLOW_THREADS
        Py_INCREF(Py_None);
        result = Py_None;
    }
done:
    PyBuffer_Release(&prev);
    PyBuffer_Release(&indices);
    PyBuffer_Release(&sent);
    PyBuffer_Release(&out);
    if (support.obj) PyBuffer_Release(&support);
    return result;
}

/* sample[i / stride] = factor[p] * sample[i / stride] for each of the k positions i = idx[p] that the
 * strided sample holds (i % stride == 0): the sampled entries' RegTop-k scores. */
#define SCALE_SAMPLED(T)                                                                               \
    static void scale_sampled_##T(T *sample, Py_ssize_t n, const int32_t *idx, const T *factor, Py_ssize_t k, \
                                  Py_ssize_t stride) {                                                 \
        for (Py_ssize_t p = 0; p < k; ++p) {                                                           \
            const Py_ssize_t i = idx[p];                                                               \
            if (i % stride == 0 && i / stride < n) sample[i / stride] = factor[p] * sample[i / stride]; \
        }                                                                                              \
    }
SCALE_SAMPLED(float)
SCALE_SAMPLED(double)

static PyObject *py_scale_sampled(PyObject *self, PyObject *args) {
    Py_buffer sample, indices, factors;
    Py_ssize_t k, itemsize, stride;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*y*y*nnn", &sample, &indices, &factors, &k, &itemsize, &stride)) return NULL;
    PyObject *result = NULL;
    if ((itemsize != 4 && itemsize != 8) || k < 0 || stride < 1 || indices.len < 4 * k || factors.len < k * itemsize) {
        PyErr_Format(PyExc_ValueError, "scale_sampled: bad k=%zd itemsize=%zd stride=%zd or buffers too small", k, itemsize,
                     stride);
    } else {
        const Py_ssize_t n = sample.len / itemsize;
        const int32_t *idx = (const int32_t *)indices.buf;
        Py_BEGIN_ALLOW_THREADS
        if (itemsize == 4) scale_sampled_float((float *)sample.buf, n, idx, (const float *)factors.buf, k, stride);
        else scale_sampled_double((double *)sample.buf, n, idx, (const double *)factors.buf, k, stride);
        Py_END_ALLOW_THREADS
        Py_INCREF(Py_None);
        result = Py_None;
    }
    PyBuffer_Release(&sample);
    PyBuffer_Release(&indices);
    PyBuffer_Release(&factors);
    return result;
}
static PyMethodDef methods[] = {
    {"bitmap_set", py_bitmap_set, METH_VARARGS,
     "bitmap_set(indices, k, d, out)\n\n"
     "Zero the ceil(d / 8) bytes of out, then set bit j % 8 of out[j // 8] for the k int32 indices j."},
    {"bitmap_mark", py_bitmap_mark, METH_VARARGS,
     "bitmap_mark(indices, k, d, out)\n\n"
     "Set bit j % 8 of out[j // 8] for the k int32 indices j (other bits unchanged)."},
    {"bitmap_indices", py_bitmap_indices, METH_VARARGS,
     "bitmap_indices(bitmap, d, out) -> int\n\n"
     "Write the positions (< d, ascending) of the set bits as int32 into out, as many as it holds;\n"
     "return how many bits are set."},
    {"scan", py_scan, METH_VARARGS,
     "scan(x, g, n, itemsize, threshold, absolute, over, over_factors, idx_out, scores_out, threads) -> (int, bool)\n\n"
     "Top-k's candidates: with g (else None), x[i] += g[i] first; the score of i is |x[i]| (absolute) or x[i],\n"
     "or over_factors[p] times that where over[p] == i (int32 positions, ascending; both None for none).\n"
     "The positions (ascending) and scores of the scores >= threshold go to idx_out / scores_out; returns\n"
     "their number, which exceeds the outputs' capacity when they did not all fit (then the outputs are\n"
     "partial), and whether every element of g is finite (True without g)."},
    {"compress_marked", py_compress_marked, METH_VARARGS,
     "compress_marked(src, mask, n, out) -> int\n\n"
     "The int32 src[i] with mask[i] (bool bytes) set, i < n, in order into out; return how many."},
    {"indexed", py_indexed, METH_VARARGS,
     "indexed(op, x, indices, k, itemsize, other, scalar, threads)\n\n"
     "For the k int32 indices j of x (float32/float64): op 0 other[i] = x[j], x[j] = 0; 1 x[j] += other[i];\n"
     "2 x[j] = 0; 3 x[j] /= scalar; 4 x[j] -= scalar * other[j] (scalar in x's dtype); 5 other[i] = x[j];\n"
     "6 x[j] = other[i]."},
    {"merge_rows", py_merge_rows, METH_VARARGS,
     "merge_rows(index_rows, value_rows, d, itemsize, union_out, sums_out) -> int\n\n"
     "The sorted union of up to 8 rows of int32 indices (each unique, ascending, in [0, d)) into union_out,\n"
     "and per union entry the sum of the rows' values there, added in row order from 0, into sums_out;\n"
     "returns the union's size."},
    {"settle", py_settle, METH_VARARGS,
     "settle(g, x, stale, union, sums, u, itemsize, divisor, lr, threads)\n\n"
     "G_j = sums[j] / divisor (no division when it is 1) for j < u, written back into sums[j]; unless g is\n"
     "None, g[union[j]] = G_j and g[i] = 0 for the stale indices not in the union (both sorted); unless x\n"
     "is None, x[union[j]] -= lr * G_j."},
    {"regtopk_ratio", py_regtopk_ratio, METH_VARARGS,
     "regtopk_ratio(prev, idx, sent, out, k, itemsize, w, q, mu, threads, support=None)\n\n"
     "RegTop-k's |1 + delta| / mu before its tanh: out[p] = |(G - own) / own + 1| / mu with G = prev[idx[p]]\n"
     "and own = sent[p] * w, or |q + 1| / mu where own is 0; each operation rounded to the dtype.  With\n"
     "support (int32, ascending), prev holds G's values there only (0 elsewhere) and idx ascends."},
    {"scale_sampled", py_scale_sampled, METH_VARARGS,
     "scale_sampled(sample, idx, factors, k, itemsize, stride)\n\n"
     "sample[i // stride] = factors[p] * sample[i // stride] for each i = idx[p] with i % stride == 0 (and\n"
     "i // stride < len(sample)): the RegTop-k scores of a strided sample's sent entries."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_sparsec", "Fused CPU loops for Top-k and RegTop-k: selection, payload bitmaps, aggregation.", -1, methods, NULL, NULL, NULL, NULL,
};

/* VERSION changes with the functions' arguments, so that a stale build is refused (mpiopt.kernels._backend). */
PyMODINIT_FUNC PyInit__sparsec(void) {
    PyObject *m = PyModule_Create(&module);
    if (m && (PyModule_AddIntConstant(m, "VERSION", 1) < 0 || PyModule_AddIntConstant(m, "MERGE_MAX_ROWS", MERGE_MAX_ROWS) < 0))
        Py_CLEAR(m);
    return m;
}
