/* Fused CPU loops over packed signs (optional): signSGD / Signum's sign packing and majority vote.
 *
 * vote: the majority vote of P packed sign vectors in one C loop.
 * Computes what mpiopt.kernels.signs.majority_vote's numpy code computes:
 * bit j of out[w] is set where at least `threshold` of the P rows have bit j
 * of word w set.  numpy needs one pass over memory per bitwise operation
 * (about 23 for P = 8); here each word of each row is read once and the
 * bit-sliced arithmetic stays in registers:
 *
 *   - rows are taken 8 at a time; a carry-save adder tree (full adders on
 *     whole 64-bit words) turns 8 words into the 4 bit planes of their count;
 *   - that 4-bit count is added into running bit-sliced counters;
 *   - the counters are compared with the threshold, bit-sliced, from the top.
 *
 * Missing rows of the last group count as zero words.
 *
 * pack_signs, unpack_signs: what numpy does with d-sized temporaries
 * (greater_equal + packbits, take's intp indices), here written straight into
 * the caller's buffer, so a step allocates nothing.
 *
 * momentum_signs: Signum's momentum update and the packing of its signs in one
 * pass (numpy needs four); apply_signs: the update x = x * decay - lr * sign.
 *
 * Threads (_parallel.h): pack_signs, momentum_signs and apply_signs split long
 * vectors on whole bytes of signs.
 *
 * The float loops (momentum_signs, apply_signs) round every product and sum on
 * their own, as numpy does (_cloops.h).  Without a C compiler mpiopt uses the
 * numpy code, which gives the same bits.
 */
#include "_cloops.h"

#include <stdlib.h>

#define MAX_LEVELS 48
#define BLOCK 128 /* words per block: the counters (levels x BLOCK words) stay in L1 */

/* sum and carry of three bit planes */
#define FULL_ADD(a, b, c, s, k) \
    do { uint64_t x_ = (a) ^ (b); s = x_ ^ (c); k = ((a) & (b)) | (x_ & (c)); } while (0)

static int bit_length(Py_ssize_t n) {
    int b = 0;
    while (n) { ++b; n >>= 1; }
    return b;
}

/* The 4 bit planes of the number of set bits among 8 words. */
static inline void count8(const uint64_t x[8], uint64_t plane[4]) {
    uint64_t s1, c1, s2, c2, s3, c3, t, f;
    FULL_ADD(x[0], x[1], x[2], s1, c1);
    FULL_ADD(x[3], x[4], x[5], s2, c2);
    FULL_ADD(s1, s2, x[6], s3, c3);
    plane[0] = s3 ^ x[7];
    uint64_t c4 = s3 & x[7];           /* weight 2: c1, c2, c3, c4 */
    FULL_ADD(c1, c2, c3, t, f);         /* weight 4: f, and t & c4 below */
    plane[1] = t ^ c4;
    uint64_t f2 = t & c4;
    plane[2] = f ^ f2;
    plane[3] = f & f2;
}

static void vote(const unsigned char *rows, Py_ssize_t voters, Py_ssize_t stride, Py_ssize_t nwords,
                 Py_ssize_t threshold, unsigned char *out) {
    const int levels = bit_length(voters);
    uint64_t count[MAX_LEVELS < 4 ? 4 : MAX_LEVELS][BLOCK];
    static const unsigned char zeros[8 * BLOCK]; /* the missing rows of the last group */
    for (Py_ssize_t start = 0; start < nwords; start += BLOCK) {
        const Py_ssize_t n = nwords - start < BLOCK ? nwords - start : BLOCK;
        for (int b = 4; b < levels; ++b)  /* levels 0-3 are set by the first group */
            for (Py_ssize_t w = 0; w < n; ++w) count[b][w] = 0;
        for (Py_ssize_t first = 0; first < voters; first += 8) {
            const unsigned char *row[8];
            for (int i = 0; i < 8; ++i) row[i] = first + i < voters ? rows + (first + i) * stride + 8 * start : zeros;
            if (first == 0) {  /* the counters are zero: the first group's planes are the count */
                for (Py_ssize_t w = 0; w < n; ++w) {
                    uint64_t x[8], plane[4];
                    for (int i = 0; i < 8; ++i) x[i] = load64(row[i] + 8 * w);
                    count8(x, plane);
                    for (int b = 0; b < 4; ++b) count[b][w] = plane[b];
                }
                continue;
            }
            /* after this group the count needs at most `used` bits */
            const int used = bit_length(first + 8 < voters ? first + 8 : voters);
            for (Py_ssize_t w = 0; w < n; ++w) {
                uint64_t x[8], plane[4], carry = 0;
                for (int i = 0; i < 8; ++i) x[i] = load64(row[i] + 8 * w);
                count8(x, plane);
                for (int b = 0; b < used; ++b) {  /* count += plane, ripple carry */
                    uint64_t add = b < 4 ? plane[b] : 0, s, k;
                    FULL_ADD(count[b][w], add, carry, s, k);
                    count[b][w] = s;
                    carry = k;
                }
            }
        }
        for (Py_ssize_t w = 0; w < n; ++w) {  /* count >= threshold: greater so far, or equal in every bit */
            uint64_t greater = 0, equal = ~(uint64_t)0;
            for (int b = levels - 1; b >= 0; --b) {
                if ((threshold >> b) & 1) equal &= count[b][w];
                else greater |= equal & count[b][w];
            }
            store64(out + 8 * (start + w), greater | equal);
        }
    }
}

/* The last nbytes % 8 bytes of every row, zero-padded to a word, voted on their own. */
static int vote_tail(const unsigned char *rows, Py_ssize_t voters, Py_ssize_t stride, Py_ssize_t nbytes,
                     Py_ssize_t threshold, unsigned char *out) {
    const Py_ssize_t whole = nbytes / 8, rest = nbytes % 8;
    if (!rest) return 0;
    uint64_t *tails = calloc((size_t)voters, sizeof *tails);  /* P words: small next to the rows */
    if (!tails) return -1;
    for (Py_ssize_t r = 0; r < voters; ++r) memcpy(&tails[r], rows + r * stride + 8 * whole, (size_t)rest);
    unsigned char word[8];
    vote((const unsigned char *)tails, voters, 8, 1, threshold, word);
    memcpy(out + 8 * whole, word, (size_t)rest);
    free(tails);
    return 0;
}

static PyObject *py_vote(PyObject *self, PyObject *args) {
    Py_buffer rows, out;
    Py_ssize_t voters, stride, nbytes, threshold;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*nnnnw*", &rows, &voters, &stride, &nbytes, &threshold, &out)) return NULL;
    PyObject *result = NULL;
    /* threshold <= voters: the counters have voters' bits, and a higher threshold's would go unread */
    if (voters < 1 || bit_length(voters) > MAX_LEVELS || nbytes < 0 || stride < nbytes || threshold < 0 || threshold > voters) {
        PyErr_Format(PyExc_ValueError, "vote: bad shape voters=%zd stride=%zd nbytes=%zd threshold=%zd",
                     voters, stride, nbytes, threshold);
    } else if (rows.len < (voters - 1) * stride + nbytes || out.len < nbytes) {
        PyErr_SetString(PyExc_ValueError, "vote: buffers too small for the given shape");
    } else {
        int failed;
        Py_BEGIN_ALLOW_THREADS
        vote((const unsigned char *)rows.buf, voters, stride, nbytes / 8, threshold, (unsigned char *)out.buf);
        failed = vote_tail((const unsigned char *)rows.buf, voters, stride, nbytes, threshold, (unsigned char *)out.buf);
        Py_END_ALLOW_THREADS
        if (failed) {
            PyErr_NoMemory();
        } else {
            Py_INCREF(Py_None);
            result = Py_None;
        }
    }
    PyBuffer_Release(&rows);
    PyBuffer_Release(&out);
    return result;
}

/* Bit i % 8 of out[i / 8] = (x[i] >= 0), pad bits 0; returns whether x holds a NaN. */
#define PACK_SIGNS(T)                                                                   \
    static int pack_signs_##T(const T *x, Py_ssize_t n, unsigned char *out) {          \
        int nan = 0;                                                                   \
        Py_ssize_t whole = n / 8;                                                      \
        for (Py_ssize_t b = 0; b < whole; ++b) {                                       \
            const T *v = x + 8 * b;                                                    \
            unsigned bits = 0;                                                         \
            for (int j = 0; j < 8; ++j) {                                              \
                bits |= (unsigned)(v[j] >= 0) << j;                                    \
                nan |= v[j] != v[j];                                                   \
            }                                                                          \
            out[b] = (unsigned char)bits;                                              \
        }                                                                              \
        if (n > 8 * whole) {                                                           \
            unsigned bits = 0;                                                         \
            for (Py_ssize_t j = 0; j < n - 8 * whole; ++j) {                           \
                bits |= (unsigned)(x[8 * whole + j] >= 0) << j;                        \
                nan |= x[8 * whole + j] != x[8 * whole + j];                           \
            }                                                                          \
            out[whole] = (unsigned char)bits;                                          \
        }                                                                              \
        return nan;                                                                    \
    }
PACK_SIGNS(float)
PACK_SIGNS(double)

/* m[i] = m[i] * beta + g[i] * omb, each product and the sum rounded on their own as numpy's passes
 * (m *= beta; t = g * (1 - beta); m += t) round them; bit i % 8 of out[i / 8] = (m[i] >= 0). */
#define MOMENTUM_SIGNS(T)                                                                         \
    static void momentum_signs_tail_##T(T *restrict m, const T *restrict g, Py_ssize_t n, T beta, T omb, \
                                        unsigned char *restrict out) {                            \
        for (Py_ssize_t b = 0; 8 * b < n; ++b) {                                                 \
            const Py_ssize_t count = n - 8 * b < 8 ? n - 8 * b : 8;                              \
            T *restrict v = m + 8 * b;                                                           \
            const T *restrict w = g + 8 * b;                                                     \
            unsigned bits = 0;                                                                   \
            for (Py_ssize_t j = 0; j < count; ++j) {                                             \
                const T t = v[j] * beta, u = w[j] * omb, s = t + u;                              \
                v[j] = s;                                                                        \
                bits |= (unsigned)(s >= 0) << j;                                                 \
            }                                                                                    \
            out[b] = (unsigned char)bits;                                                        \
        }                                                                                        \
    }
MOMENTUM_SIGNS(float)
MOMENTUM_SIGNS(double)

/* The whole bytes with SSE2 where the compiler targets it (every x86-64): the compiler does not
 * vectorize the sign packing, and this halves the time (docs/benchmarks-kernels.md).  The same IEEE
 * products and sums, and cmpge gives >= 0 exactly (true for -0.0, false for NaN). */
#if defined(__SSE2__)
#include <emmintrin.h>
static void momentum_signs_float(float *m, const float *g, Py_ssize_t n, float beta, float omb, unsigned char *out) {
    const __m128 B = _mm_set1_ps(beta), O = _mm_set1_ps(omb), Z = _mm_setzero_ps();
    Py_ssize_t b = 0;
    for (; 8 * b + 8 <= n; ++b) {
        float *v = m + 8 * b;
        const float *w = g + 8 * b;
        const __m128 s0 = _mm_add_ps(_mm_mul_ps(_mm_loadu_ps(v), B), _mm_mul_ps(_mm_loadu_ps(w), O));
        const __m128 s1 = _mm_add_ps(_mm_mul_ps(_mm_loadu_ps(v + 4), B), _mm_mul_ps(_mm_loadu_ps(w + 4), O));
        _mm_storeu_ps(v, s0);
        _mm_storeu_ps(v + 4, s1);
        out[b] = (unsigned char)(_mm_movemask_ps(_mm_cmpge_ps(s0, Z)) | (_mm_movemask_ps(_mm_cmpge_ps(s1, Z)) << 4));
    }
    momentum_signs_tail_float(m + 8 * b, g + 8 * b, n - 8 * b, beta, omb, out + b);
}
static void momentum_signs_double(double *m, const double *g, Py_ssize_t n, double beta, double omb, unsigned char *out) {
    const __m128d B = _mm_set1_pd(beta), O = _mm_set1_pd(omb), Z = _mm_setzero_pd();
    Py_ssize_t b = 0;
    for (; 8 * b + 8 <= n; ++b) {
        double *v = m + 8 * b;
        const double *w = g + 8 * b;
        unsigned bits = 0;
        for (int j = 0; j < 4; ++j) {
            const __m128d s = _mm_add_pd(_mm_mul_pd(_mm_loadu_pd(v + 2 * j), B), _mm_mul_pd(_mm_loadu_pd(w + 2 * j), O));
            _mm_storeu_pd(v + 2 * j, s);
            bits |= (unsigned)_mm_movemask_pd(_mm_cmpge_pd(s, Z)) << (2 * j);
        }
        out[b] = (unsigned char)bits;
    }
    momentum_signs_tail_double(m + 8 * b, g + 8 * b, n - 8 * b, beta, omb, out + b);
}
#else
#define momentum_signs_float momentum_signs_tail_float
#define momentum_signs_double momentum_signs_tail_double
#endif

/* One pack_signs / momentum_signs call: parts start on whole bytes of signs. */
typedef struct {
    Py_ssize_t itemsize;
    const char *x;  /* the values packed (pack_signs) or the gradient (momentum_signs) */
    char *m;        /* the momentum buffer, or NULL for pack_signs */
    double beta;
    unsigned char *out;
    int nan[MPIOPT_MAX_PARTS];
} signs_job;

static void signs_part(void *ctx, Py_ssize_t lo, Py_ssize_t hi, int part) {
    signs_job *j = (signs_job *)ctx;
    const Py_ssize_t at = lo * j->itemsize, n = hi - lo;
    unsigned char *out = j->out + lo / 8;
    j->nan[part] = 0;
    if (j->m == NULL)
        j->nan[part] = j->itemsize == 4 ? pack_signs_float((const float *)(j->x + at), n, out)
                                        : pack_signs_double((const double *)(j->x + at), n, out);
    else if (j->itemsize == 4)
        momentum_signs_float((float *)(j->m + at), (const float *)(j->x + at), n, (float)j->beta, (float)(1.0 - j->beta), out);
    else
        momentum_signs_double((double *)(j->m + at), (const double *)(j->x + at), n, j->beta, 1.0 - j->beta, out);
}

static int run_signs(signs_job *job, Py_ssize_t n, int threads) {
    int parts, nan = 0;
    Py_BEGIN_ALLOW_THREADS
    parts = mpiopt_parallel_for(threads, n, 8, signs_part, job);
    Py_END_ALLOW_THREADS
    for (int p = 0; p < parts; ++p) nan |= job->nan[p];
    return nan;
}

static PyObject *py_pack_signs(PyObject *self, PyObject *args) {
    Py_buffer x, out;
    Py_ssize_t n, itemsize;
    int threads;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*nnw*i", &x, &n, &itemsize, &out, &threads)) return NULL;
    PyObject *result = NULL;
    if (n < 0 || (itemsize != 4 && itemsize != 8)) {
        PyErr_Format(PyExc_ValueError, "pack_signs: bad n=%zd itemsize=%zd", n, itemsize);
    } else if (x.len < n * itemsize || out.len < (n + 7) / 8) {
        PyErr_SetString(PyExc_ValueError, "pack_signs: buffers too small for the given length");
    } else {
        signs_job job = {itemsize, (const char *)x.buf, NULL, 0.0, (unsigned char *)out.buf, {0}};
        result = PyBool_FromLong(run_signs(&job, n, threads));
    }
    PyBuffer_Release(&x);
    PyBuffer_Release(&out);
    return result;
}

static PyObject *py_momentum_signs(PyObject *self, PyObject *args) {
    Py_buffer m, g, out;
    Py_ssize_t n, itemsize;
    double beta;
    int threads;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*y*nndw*i", &m, &g, &n, &itemsize, &beta, &out, &threads)) return NULL;
    PyObject *result = NULL;
    if (n < 0 || (itemsize != 4 && itemsize != 8) || m.len < n * itemsize || g.len < n * itemsize || out.len < (n + 7) / 8) {
        PyErr_Format(PyExc_ValueError, "momentum_signs: bad n=%zd itemsize=%zd or buffers too small", n, itemsize);
    } else {
        signs_job job = {itemsize, (const char *)g.buf, (char *)m.buf, beta, (unsigned char *)out.buf, {0}};
        run_signs(&job, n, threads);
        Py_INCREF(Py_None);
        result = Py_None;
    }
    PyBuffer_Release(&m);
    PyBuffer_Release(&g);
    PyBuffer_Release(&out);
    return result;
}

/* out[i] = +1 where bit i % 8 of packed[i / 8] is set, else -1 (the inverse of pack_signs).
 * Whole bytes copy their 8 signs from a 256-row table (filled when the module loads): a
 * per-bit branch mispredicts on random signs. */
#define UNPACK_SIGNS(T)                                                                 \
    static T sign_table_##T[256][8];                                                    \
    static void fill_sign_table_##T(void) {                                             \
        for (int b = 0; b < 256; ++b)                                                   \
            for (int j = 0; j < 8; ++j) sign_table_##T[b][j] = ((b >> j) & 1) ? (T)1 : (T)-1; \
    }                                                                                   \
    static void unpack_signs_##T(const unsigned char *packed, Py_ssize_t n, T *out) {  \
        const Py_ssize_t whole = n / 8;                                                 \
        for (Py_ssize_t b = 0; b < whole; ++b) memcpy(out + 8 * b, sign_table_##T[packed[b]], sizeof sign_table_##T[0]); \
        for (Py_ssize_t i = 8 * whole; i < n; ++i) out[i] = sign_table_##T[packed[whole]][i - 8 * whole]; \
    }
UNPACK_SIGNS(float)
UNPACK_SIGNS(double)

/* params[i] = params[i] * decay - lr * sign_i (sign_i = +-1 from the packed bits), each operation
 * rounded on its own as numpy's passes (params *= decay; step = unpack * lr; params -= step) round
 * them, in one pass; decay = 1 skips the product, as the numpy code skips that pass.  A byte's 8
 * steps come from a 256-row table of +-lr (made per call; it stays in L1), so the inner loop has 8
 * fixed lanes that the compiler vectorizes (a per-bit lookup does not). */
#define APPLY_SIGNS(T)                                                                  \
    static void apply_signs_##T(const unsigned char *packed, Py_ssize_t n, T *restrict x, T (*table)[8], T f, \
                                int decay) {                                            \
        const Py_ssize_t whole = n / 8;                                                 \
        for (Py_ssize_t b = 0; b < whole; ++b) {                                        \
            const T *restrict step = table[packed[b]];                                  \
            T *restrict v = x + 8 * b;                                                  \
            if (decay)                                                                  \
                for (int j = 0; j < 8; ++j) { const T y = v[j] * f; v[j] = y - step[j]; } \
            else                                                                        \
                for (int j = 0; j < 8; ++j) v[j] = v[j] - step[j];                      \
        }                                                                               \
        for (Py_ssize_t i = 8 * whole; i < n; ++i) {                                    \
            const T y = decay ? x[i] * f : x[i];                                        \
            x[i] = y - table[packed[whole]][i - 8 * whole];                             \
        }                                                                               \
    }
APPLY_SIGNS(float)
APPLY_SIGNS(double)

typedef struct {
    Py_ssize_t itemsize;
    const unsigned char *packed;
    char *x;
    double decay;
    float table_f[256][8]; /* +lr where the bit is set, else -lr, in the dtype */
    double table_d[256][8];
} apply_job;

static void apply_part(void *ctx, Py_ssize_t lo, Py_ssize_t hi, int part) {
    apply_job *j = (apply_job *)ctx;
    (void)part;
    const int decay = j->decay != 1.0;
    if (j->itemsize == 4) apply_signs_float(j->packed + lo / 8, hi - lo, (float *)j->x + lo, j->table_f, (float)j->decay, decay);
    else apply_signs_double(j->packed + lo / 8, hi - lo, (double *)j->x + lo, j->table_d, j->decay, decay);
}

static PyObject *py_apply_signs(PyObject *self, PyObject *args) {
    Py_buffer packed, x;
    Py_ssize_t n, itemsize;
    double lr, decay;
    int threads;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*nnw*ddi", &packed, &n, &itemsize, &x, &lr, &decay, &threads)) return NULL;
    PyObject *result = NULL;
    if (n < 0 || (itemsize != 4 && itemsize != 8) || packed.len < (n + 7) / 8 || x.len < n * itemsize) {
        PyErr_Format(PyExc_ValueError, "apply_signs: bad n=%zd itemsize=%zd or buffers too small", n, itemsize);
    } else {
        apply_job *job = PyMem_Malloc(sizeof(apply_job));
        if (job == NULL) {
            PyBuffer_Release(&packed);
            PyBuffer_Release(&x);
            return PyErr_NoMemory();
        }
        job->itemsize = itemsize;
        job->packed = (const unsigned char *)packed.buf;
        job->x = (char *)x.buf;
        job->decay = decay;
        for (int b = 0; b < 256; ++b)
            for (int j = 0; j < 8; ++j) {
                job->table_f[b][j] = ((b >> j) & 1) ? (float)lr : -(float)lr;
                job->table_d[b][j] = ((b >> j) & 1) ? lr : -lr;
            }
        Py_BEGIN_ALLOW_THREADS
        mpiopt_parallel_for(threads, n, 8, apply_part, job);
        Py_END_ALLOW_THREADS
        PyMem_Free(job);
        Py_INCREF(Py_None);
        result = Py_None;
    }
    PyBuffer_Release(&packed);
    PyBuffer_Release(&x);
    return result;
}

static PyObject *py_unpack_signs(PyObject *self, PyObject *args) {
    Py_buffer packed, out;
    Py_ssize_t n, itemsize;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*nnw*", &packed, &n, &itemsize, &out)) return NULL;
    PyObject *result = NULL;
    if (n < 0 || (itemsize != 4 && itemsize != 8) || packed.len < (n + 7) / 8 || out.len < n * itemsize) {
        PyErr_Format(PyExc_ValueError, "unpack_signs: bad n=%zd itemsize=%zd or buffers too small", n, itemsize);
    } else {
        Py_BEGIN_ALLOW_THREADS
        if (itemsize == 4) unpack_signs_float((const unsigned char *)packed.buf, n, (float *)out.buf);
        else unpack_signs_double((const unsigned char *)packed.buf, n, (double *)out.buf);
        Py_END_ALLOW_THREADS
        Py_INCREF(Py_None);
        result = Py_None;
    }
    PyBuffer_Release(&packed);
    PyBuffer_Release(&out);
    return result;
}
static PyMethodDef methods[] = {
    {"vote", py_vote, METH_VARARGS,
     "vote(rows, voters, stride_bytes, nbytes, threshold, out)\n\n"
     "Bit j of out byte b (b < nbytes) is set where at least threshold of the voters rows (row r: the\n"
     "nbytes bytes from byte r * stride_bytes, any alignment) have bit j of byte b set."},
    {"pack_signs", py_pack_signs, METH_VARARGS,
     "pack_signs(x, n, itemsize, out, threads) -> bool\n\n"
     "Bit i % 8 of out[i // 8] = x[i] >= 0 for the n float32 (itemsize 4) or float64 (8) values of x;\n"
     "pad bits 0.  Returns whether x holds a NaN (packed as 0)."},
    {"momentum_signs", py_momentum_signs, METH_VARARGS,
     "momentum_signs(m, g, n, itemsize, beta, out, threads)\n\n"
     "m[i] = m[i] * beta + g[i] * (1 - beta) (beta and 1 - beta in the dtype, each operation rounded), then\n"
     "bit i % 8 of out[i // 8] = m[i] >= 0, for n float32 (itemsize 4) or float64 (8) values; pad bits 0."},
    {"unpack_signs", py_unpack_signs, METH_VARARGS,
     "unpack_signs(packed, n, itemsize, out)\n\n"
     "out[i] = +1 where bit i % 8 of packed[i // 8] is set, else -1, for n float32 (itemsize 4) or float64 (8)."},
    {"apply_signs", py_apply_signs, METH_VARARGS,
     "apply_signs(packed, n, itemsize, x, lr, decay, threads)\n\n"
     "x[i] = x[i] * decay - lr * s_i (s_i = +1 where bit i % 8 of packed[i // 8] is set, else -1; lr and decay\n"
     "in x's dtype, each operation rounded; decay = 1 skips the product) for n float32/float64 values."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_signsc", "Fused CPU loops over packed signs: sign packing, the majority vote, Signum's update.", -1, methods, NULL, NULL, NULL, NULL,
};

/* VERSION changes with the functions' arguments, so that a stale build is refused (mpiopt.kernels._backend). */
PyMODINIT_FUNC PyInit__signsc(void) {
    fill_sign_table_float();
    fill_sign_table_double();
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddIntConstant(m, "VERSION", 1) < 0) Py_CLEAR(m);
    return m;
}
