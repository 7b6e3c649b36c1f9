/* torch.optim.SGD's local update, fused into one C loop per case (optional).
 *
 * Computes what mpiopt.kernels.update's array code computes, element by element
 * in one pass over (x, g, b) instead of numpy's five to nine passes:
 *
 *   g = g / P                                              (an average's divisor, when given)
 *   d = g                      or  d = x * wd + g          (weight decay)
 *   b = d                                                  (first step)
 *   b = b * m + d              or  b = b * m + d * (1 - dampening)
 *   s = d + b * m  (Nesterov)  or  s = b               or  s = d (no momentum)
 *   x = x - s * lr
 *   x = merge(x)                                           (DaSGD's merge, when asked for: below)
 *   c = x,  c2 = x                                         (copies of the result, when asked for)
 *
 * Every product and sum is rounded to the parameters' dtype on its own, in the
 * order numpy does them, so the results equal numpy's bit for bit (NaN payloads
 * aside).  That needs IEEE single/double arithmetic without excess precision and
 * without a*b+c contracted into a fused multiply-add: setup.py builds with
 * -ffp-contract=off, and the checks in _cloops.h refuse a build that could differ
 * (the build is optional: without this extension mpiopt uses the numpy code).
 * The same pass reports whether every element of g is finite; all_finite makes
 * that check alone (the algorithms' gradient check, before any update).
 * elastic_pull is EASGD's pull of the workers and the centre c towards each
 * other, from a received sum of the P workers' x, in one pass over (x, c,
 * sum) instead of numpy's seven:
 *
 *   m = sum / P;  w = x - c;  w = w * alpha;  x = x - w;  m = m - c;  m = m * beta;  c = c + m
 *
 * merge_average is DaSGD's merge of a received sum of P models, in one pass
 * over (x, snapshot, sum) instead of numpy's three (or in the update's pass):
 *
 *   a = sum / P;  x = x - snapshot;  x = x + a             (delayed rule)
 *   a = sum / P;  a = a * (1 - p);   x = x * p;  x = x + a (proportion rule)
 *
 * outer_sgd is DiLoCo's outer step from a received sum of P models, in one
 * pass over (x, sum, b) instead of numpy's four (x is the outer parameters):
 *
 *   a = sum / P;  d = x - a;  b = b * m + d;  s = d + b * m (Nesterov) or b;  x = x - s * lr;
 *   c = x   or   c = c * alpha + x * (1 - alpha)             (a copy, or Streaming DiLoCo's mix, when asked for)
 *
 * Long vectors are split across threads (_parallel.h): element by element,
 * so the bits do not depend on the split.
 */
#include "_cloops.h"

#include <math.h>

#if defined(__GNUC__)
#define ALWAYS_INLINE static inline __attribute__((always_inline))
#else
#define ALWAYS_INLINE static inline
#endif

/* merge's rules (the update's and merge_average's flag). */
enum { NO_MERGE, DELAYED, PROPORTION };

/* DaSGD's merge of element i, whose parameter is y: (y - snapshot) + sum / P, or y * p + (sum / P) * q. */
#define DEFINE_MERGE_ONE(T, NAME)                                                                          \
    ALWAYS_INLINE T NAME(T y, Py_ssize_t i, const T *restrict snapshot, const T *restrict sum, T divisor, T p, \
                         T q, int rule) {                                                                  \
        const T a = sum[i] / divisor;                                                                      \
        if (rule == PROPORTION) {                                                                          \
            const T z = y * p;                                                                             \
            const T w = a * q;                                                                             \
            return z + w;                                                                                  \
        }                                                                                                  \
        const T z = y - snapshot[i];                                                                       \
        return z + a;                                                                                      \
    }
DEFINE_MERGE_ONE(float, merge_one_f32)
DEFINE_MERGE_ONE(double, merge_one_f64)

/* The step's direction from d and the new momentum b: d + b * m (Nesterov) or b. */
#define DEFINE_DIRECTION(T, NAME)                                             \
    ALWAYS_INLINE T NAME(T d, T bi, T mom, int nesterov) {                    \
        if (nesterov) {                                                       \
            const T t = bi * mom;                                             \
            return d + t;                                                     \
        }                                                                     \
        return bi;                                                            \
    }
DEFINE_DIRECTION(float, direction_f32)
DEFINE_DIRECTION(double, direction_f64)

/* The loop for one dtype; the int flags are constants at every call site, so
 * each case below compiles into its own branch-free (vectorized) loop. */
#define DEFINE_LOOP(T, NAME, ABS, MAX, MERGE_ONE, DIRECTION)                                                                \
    ALWAYS_INLINE int NAME(Py_ssize_t n, T *restrict x, const T *restrict g, T *restrict b, T *restrict c,       \
                           T *restrict c2, const T *restrict snapshot, const T *restrict sum, T lr, T wd, T mom, \
                           T scale, T div, T mdiv, T mp, T mq, int divide, int copies, int merge, int decay,      \
                           int momentum, int first, int damp, int nesterov) {                                    \
        int finite = 1;                                                                                          \
        for (Py_ssize_t i = 0; i < n; ++i) {                                                                     \
            T gi = g[i];                                                                                         \
            finite &= ABS(gi) <= MAX; /* false for inf and NaN */                                                \
            if (divide) gi = gi / div;                                                                           \
            T d = gi;                                                                                            \
            if (decay) {                                                                                         \
                const T t = x[i] * wd;                                                                           \
                d = t + gi;                                                                                      \
            }                                                                                                    \
            T s = d;                                                                                             \
            if (momentum) {                                                                                      \
                T bi;                                                                                            \
                if (first) {                                                                                     \
                    bi = d;                                                                                      \
                } else {                                                                                         \
                    bi = b[i] * mom;                                                                             \
                    if (damp) {                                                                                  \
                        const T t = d * scale;                                                                   \
                        bi = bi + t;                                                                             \
                    } else {                                                                                     \
                        bi = bi + d;                                                                             \
                    }                                                                                            \
                }                                                                                                \
                b[i] = bi;                                                                                       \
                s = DIRECTION(d, bi, mom, nesterov);                                                             \
            }                                                                                                    \
            const T u = s * lr;                                                                                  \
            T y = x[i] - u;                                                                                      \
            if (merge) y = MERGE_ONE(y, i, snapshot, sum, mdiv, mp, mq, merge);                                  \
            x[i] = y;                                                                                            \
            if (copies >= 1) c[i] = y;                                                                           \
            if (copies == 2) c2[i] = y;                                                                          \
        }                                                                                                        \
        return finite;                                                                                           \
    }

DEFINE_LOOP(float, loop_f32, fabsf, FLT_MAX, merge_one_f32, direction_f32)
DEFINE_LOOP(double, loop_f64, fabs, DBL_MAX, merge_one_f64, direction_f64)

/* One specialized loop per case: (divide) x (0, 1 or 2 copies | delayed/proportion merge) x (decay) x
 * (no momentum | first/later x plain/dampened/Nesterov). */
#define CASE(LOOP, DIV, COPIES, MERGE, DEC, MOM, FIRST, DAMP, NEST)                                           \
    return LOOP(n, x_, g_, b_, c_, c2_, s_, t_, lr_, wd_, m_, sc_, p_, md_, mp_, mq_, DIV, COPIES, MERGE, DEC, MOM, \
                FIRST, DAMP, NEST)
#define CASES(LOOP, DIV, COPIES, MERGE)                                      \
    do {                                                                     \
        if (!momentum) {                                                     \
            if (decay) CASE(LOOP, DIV, COPIES, MERGE, 1, 0, 0, 0, 0);        \
            CASE(LOOP, DIV, COPIES, MERGE, 0, 0, 0, 0, 0);                   \
        }                                                                    \
        if (first) {                                                         \
            if (decay) {                                                     \
                if (nesterov) CASE(LOOP, DIV, COPIES, MERGE, 1, 1, 1, 0, 1); \
                CASE(LOOP, DIV, COPIES, MERGE, 1, 1, 1, 0, 0);               \
            }                                                                \
            if (nesterov) CASE(LOOP, DIV, COPIES, MERGE, 0, 1, 1, 0, 1);     \
            CASE(LOOP, DIV, COPIES, MERGE, 0, 1, 1, 0, 0);                   \
        }                                                                    \
        if (decay) {                                                         \
            if (nesterov) CASE(LOOP, DIV, COPIES, MERGE, 1, 1, 0, 0, 1);     \
            if (damp) CASE(LOOP, DIV, COPIES, MERGE, 1, 1, 0, 1, 0);         \
            CASE(LOOP, DIV, COPIES, MERGE, 1, 1, 0, 0, 0);                   \
        }                                                                    \
        if (nesterov) CASE(LOOP, DIV, COPIES, MERGE, 0, 1, 0, 0, 1);         \
        if (damp) CASE(LOOP, DIV, COPIES, MERGE, 0, 1, 0, 1, 0);             \
        CASE(LOOP, DIV, COPIES, MERGE, 0, 1, 0, 0, 0);                       \
    } while (0)
/* Each output variant with and without the divisor; copies and a merge never come together (py_sgd). */
#define VARIANT(LOOP, COPIES, MERGE)                   \
    do {                                               \
        if (divisor != 1.0) CASES(LOOP, 1, COPIES, MERGE); \
        CASES(LOOP, 0, COPIES, MERGE);                 \
    } while (0)
#define DISPATCH(LOOP, T)                                                                                     \
    do {                                                                                                      \
        T *x_ = (T *)x;                                                                                       \
        const T *g_ = (const T *)g;                                                                           \
        T *b_ = (T *)b;                                                                                       \
        T *c_ = (T *)c, *c2_ = (T *)c2;                                                                       \
        const T *s_ = (const T *)m->snapshot, *t_ = (const T *)m->sum;                                        \
        const T lr_ = (T)lr, wd_ = (T)wd, m_ = (T)mom, sc_ = (T)scale, p_ = (T)divisor;                       \
        const T md_ = (T)m->divisor, mp_ = (T)m->p, mq_ = (T)m->q;                                            \
        if (m->rule == DELAYED) VARIANT(LOOP, 0, DELAYED);                                                    \
        if (m->rule == PROPORTION) VARIANT(LOOP, 0, PROPORTION);                                              \
        if (c2) VARIANT(LOOP, 2, NO_MERGE);                                                                   \
        if (c) VARIANT(LOOP, 1, NO_MERGE);                                                                    \
        VARIANT(LOOP, 0, NO_MERGE);                                                                           \
    } while (0)

/* A merge's operands, offset to one part (rule NO_MERGE: none). */
typedef struct {
    int rule;
    const char *snapshot, *sum;
    double divisor, p, q;
} merge_args;

static int run(int itemsize, Py_ssize_t n, void *x, const void *g, void *b, void *c, void *c2, const merge_args *m,
               double divisor, double lr, double wd, double mom, double scale, int decay, int momentum, int first,
               int damp, int nesterov) {
    if (itemsize == 4) DISPATCH(loop_f32, float);
    DISPATCH(loop_f64, double);
}

/* One call's arguments, and each part's finite flag. */
typedef struct {
    int itemsize, decay, momentum, first, damp, nesterov;
    char *x, *b, *c, *c2;
    const char *g;
    merge_args merge;
    double divisor, lr, wd, mom, scale;
    const int32_t *support; /* NULL, or the sorted entries outside which g is +0.0 (n_support of them) */
    const char *support_values; /* g at them, in their order */
    Py_ssize_t n_support;
    int finite[MPIOPT_MAX_PARTS];
} sgd_job;

/* A sparse gradient's block: elements of g gathered into an L1-resident buffer, zero elsewhere. */
#define SUPPORT_BLOCK 1024

/* The merge's operands from element lo on. */
static merge_args merge_part_args(const merge_args *m, Py_ssize_t at) {
    merge_args part = *m;
    if (part.snapshot) part.snapshot += at;
    if (part.sum) part.sum += at;
    return part;
}

/* The update of elements [lo, hi), reading their gradient from g (g[0] is element lo's). */
static int sgd_range(const sgd_job *j, Py_ssize_t lo, Py_ssize_t hi, const char *g) {
    const Py_ssize_t at = lo * j->itemsize;
    const merge_args m = merge_part_args(&j->merge, at);
    return run(j->itemsize, hi - lo, j->x + at, g, j->b ? j->b + at : NULL, j->c ? j->c + at : NULL,
               j->c2 ? j->c2 + at : NULL, &m, j->divisor, j->lr, j->wd, j->mom, j->scale, j->decay, j->momentum,
               j->first, j->damp, j->nesterov);
}

static void sgd_part(void *ctx, Py_ssize_t lo, Py_ssize_t hi, int part) {
    sgd_job *j = (sgd_job *)ctx;
    if (!j->support) {
        j->finite[part] = sgd_range(j, lo, hi, j->g + lo * j->itemsize);
        return;
    }
    /* g is +0.0 outside the support: the same loop, block by block, on a buffer that holds g's support
     * entries and zeros (the same operands, so the same bits), instead of a stream of mostly zeros. */
    double storage[SUPPORT_BLOCK] = {0}; /* zero bits: +0.0 in either dtype */
    char *buffer = (char *)storage;
    const Py_ssize_t s = j->itemsize;
    int finite = 1;
    Py_ssize_t p = mpiopt_lower_bound(j->support, j->n_support, lo);
    for (Py_ssize_t start = lo; start < hi; start += SUPPORT_BLOCK) {
        const Py_ssize_t end = start + SUPPORT_BLOCK < hi ? start + SUPPORT_BLOCK : hi;
        const Py_ssize_t first = p;
        for (; p < j->n_support && j->support[p] < end; ++p) {
            const Py_ssize_t i = j->support[p];
            if (s == 4) ((float *)buffer)[i - start] = ((const float *)j->support_values)[p];
            else ((double *)buffer)[i - start] = ((const double *)j->support_values)[p];
        }
        finite &= sgd_range(j, start, end, buffer);
        for (Py_ssize_t q = first; q < p; ++q) {
            if (s == 4) ((float *)buffer)[j->support[q] - start] = 0.0f;
            else ((double *)buffer)[j->support[q] - start] = 0.0;
        }
    }
    j->finite[part] = finite;
}

/* Whether every element is finite: no early exit, so the loop vectorizes (NaN is the rare case).
 * The range is read as 4 quarters in lockstep: one core streams a read-only pass about twice as fast
 * from 4 places at once as from one (docs/benchmarks-kernels.md, "Design measurements"). */
#define FINITE(ABS, MAX, v) (ABS(v) <= MAX)
#define DEFINE_FINITE(T, NAME, ABS, MAX)                                                          \
    static int NAME(const T *restrict g, Py_ssize_t n) {                                         \
        const Py_ssize_t q = n / 4;                                                              \
        const T *restrict a = g, *restrict b = g + q, *restrict c = g + 2 * q, *restrict d = g + 3 * q; \
        int finite = 1;                                                                          \
        for (Py_ssize_t i = 0; i < q; ++i)                                                       \
            finite &= FINITE(ABS, MAX, a[i]) & FINITE(ABS, MAX, b[i]) & FINITE(ABS, MAX, c[i]) & \
                      FINITE(ABS, MAX, d[i]);                                                 \
        for (Py_ssize_t i = 4 * q; i < n; ++i) finite &= FINITE(ABS, MAX, g[i]);              \
        return finite;                                                                           \
    }
DEFINE_FINITE(float, finite_f32, fabsf, FLT_MAX)
DEFINE_FINITE(double, finite_f64, fabs, DBL_MAX)

/* out = g / divisor and whether every element of g is finite, in one pass: an Allreduce's sum turned into the
 * mean where the caller's optimizer reads it, checked on the way (a non-finite sum means some rank's was). */
#define DEFINE_DIVIDE_FINITE(T, NAME, ABS, MAX)                                                  \
    static int NAME(const T *g, T *out, T divisor, Py_ssize_t n) {                              \
        int finite = 1;                                                                          \
        for (Py_ssize_t i = 0; i < n; ++i) {                                                     \
            finite &= FINITE(ABS, MAX, g[i]);                                                    \
            out[i] = g[i] / divisor;                                                             \
        }                                                                                        \
        return finite;                                                                           \
    }
DEFINE_DIVIDE_FINITE(float, divide_finite_f32, fabsf, FLT_MAX)
DEFINE_DIVIDE_FINITE(double, divide_finite_f64, fabs, DBL_MAX)

/* all_finite's job (out NULL) and divide_finite's (out = g / divisor besides). */
typedef struct {
    int itemsize;
    const char *g;
    char *out;
    double divisor;
    int finite[MPIOPT_MAX_PARTS];
} finite_job;

static void finite_part(void *ctx, Py_ssize_t lo, Py_ssize_t hi, int part) {
    finite_job *j = (finite_job *)ctx;
    const Py_ssize_t n = hi - lo, at = lo * j->itemsize;
    const char *g = j->g + at;
    if (j->itemsize == 4)
        j->finite[part] = j->out ? divide_finite_f32((const float *)g, (float *)(j->out + at), (float)j->divisor, n)
                                 : finite_f32((const float *)g, n);
    else
        j->finite[part] = j->out ? divide_finite_f64((const double *)g, (double *)(j->out + at), j->divisor, n)
                                 : finite_f64((const double *)g, n);
}

static int all_parts(const int *flags, int parts) {
    int all = 1;
    for (int p = 0; p < parts; ++p) all &= flags[p];
    return all;
}

/* A job's part over n elements in up to `threads` threads, without the GIL: whether every part found its range finite. */
static PyObject *finite_in_parallel(int threads, Py_ssize_t n, mpiopt_part_fn part, void *job, const int *finite) {
    int parts;
    Py_BEGIN_ALLOW_THREADS
    parts = mpiopt_parallel_for(threads, n, 1, part, job);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(all_parts(finite, parts));
}

/* A job's part over n elements in up to `threads` threads, without the GIL; returns None (a new reference). */
static PyObject *none_in_parallel(int threads, Py_ssize_t n, mpiopt_part_fn part, void *job) {
    Py_BEGIN_ALLOW_THREADS
    mpiopt_parallel_for(threads, n, 1, part, job);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* 4 for float32, 8 for float64 (native byte order), 0 for anything else. */
static int float_itemsize(const Py_buffer *view) {
    const char *f = view->format ? view->format : "B";
    if (*f == '@' || *f == '=' || *f == (PY_LITTLE_ENDIAN ? '<' : '>')) ++f;
    if (strcmp(f, "f") == 0 && view->itemsize == 4) return 4;
    if (strcmp(f, "d") == 0 && view->itemsize == 8) return 8;
    return 0;
}

/* The params' writable buffer; returns its element size (4 or 8), or 0 with an exception set and x released. */
static int get_params(PyObject *o, Py_buffer *x, const char *what) {
    if (PyObject_GetBuffer(o, x, PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) return 0;
    const int itemsize = float_itemsize(x);
    if (!itemsize) {
        PyErr_Format(PyExc_TypeError, "%s: params must be float32 or float64", what);
        PyBuffer_Release(x);
    }
    return itemsize;
}

/* Another buffer of the params' length (x->len bytes) and element size; -1 with an exception set (and the
 * view released) if it is not. */
static int get_like(PyObject *o, Py_buffer *view, int writable, const Py_buffer *x, int itemsize, const char *what) {
    if (PyObject_GetBuffer(o, view, (writable ? PyBUF_WRITABLE : 0) | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (float_itemsize(view) != itemsize || view->len != x->len) {
        PyErr_Format(PyExc_ValueError, "%s must have the params' dtype and length (%zd bytes), got %zd bytes", what,
                     x->len, view->len);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* The momentum buffer where momentum != 0 (writable, like x); 0, or -1 with an exception set where it is
 * missing or unlike x. */
static int get_buffer(PyObject *o, Py_buffer *view, double momentum, const Py_buffer *x, int itemsize, const char *what) {
    if (momentum == 0.0) return 0;
    if (o == Py_None) {
        PyErr_Format(PyExc_ValueError, "%s: momentum != 0 needs a buffer", what);
        return -1;
    }
    char name[64];
    snprintf(name, sizeof name, "%s: buffer", what);
    return get_like(o, view, 1, x, itemsize, name);
}

/* A merge's operands: total (the sum of `divisor` models), the snapshot (unread by the proportion rule) and
 * the proportion (None: the delayed rule).  0, or -1 with an exception set. */
static int get_merge(PyObject *so, PyObject *to, double divisor, PyObject *po, const Py_buffer *x, int itemsize,
                     const char *what, Py_buffer *snapshot, Py_buffer *sum, merge_args *m) {
    m->rule = po == Py_None ? DELAYED : PROPORTION;
    m->divisor = divisor;
    m->p = 0.0;
    if (m->rule == PROPORTION && (m->p = PyFloat_AsDouble(po)) == -1.0 && PyErr_Occurred()) return -1;
    m->q = 1.0 - m->p; /* in double first, then rounded to the dtype: numpy's `average *= 1.0 - p` */
    if (get_like(to, sum, 0, x, itemsize, what) < 0) return -1;
    m->sum = (const char *)sum->buf;
    if (m->rule == DELAYED && get_like(so, snapshot, 0, x, itemsize, what) < 0) return -1;
    m->snapshot = (const char *)snapshot->buf;
    return 0;
}

/* A gradient's support: int32 positions, ascending, unique and in [0, n).  0, or -1 with an exception
 * set (and the view released). */
static int get_support(PyObject *o, Py_buffer *view, Py_ssize_t n) {
    if (PyObject_GetBuffer(o, view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) return -1;
    const char *f = view->format ? view->format : "B";
    if (*f == '@' || *f == '=' || *f == (PY_LITTLE_ENDIAN ? '<' : '>')) ++f;
    const int32_t *at = (const int32_t *)view->buf;
    int ok = view->itemsize == 4 && (strcmp(f, "i") == 0 || strcmp(f, "l") == 0);
    for (Py_ssize_t i = 0; ok && i < view->len / 4; ++i) ok = at[i] >= 0 && at[i] < n && (i == 0 || at[i] > at[i - 1]);
    if (!ok) {
        PyErr_Format(PyExc_ValueError, "sgd: support must be int32 positions, unique, ascending and in [0, %zd)", n);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyObject *py_sgd(PyObject *self, PyObject *args) {
    PyObject *xo, *go, *bo, *co, *co2, *mo, *so = Py_None, *vo = Py_None;
    double divisor, lr, wd, mom, dampening;
    int nesterov, first, threads;
    Py_buffer x = {0}, g = {0}, b = {0}, c = {0}, c2 = {0}, snapshot = {0}, sum = {0}, support = {0}, values = {0};
    merge_args merge = {NO_MERGE, NULL, NULL, 1.0, 0.0, 1.0};
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOOOOdddddppi|OO", &xo, &go, &bo, &co, &co2, &mo, &divisor, &lr, &wd, &mom, &dampening,
                          &nesterov, &first, &threads, &so, &vo))
        return NULL;
    const int itemsize = get_params(xo, &x, "sgd");
    if (!itemsize) return NULL;
    PyObject *result = NULL;
    if (get_like(go, &g, 0, &x, itemsize, "sgd: grad") < 0) goto done;
    if (get_buffer(bo, &b, mom, &x, itemsize, "sgd") < 0) goto done;
    if ((co == Py_None && co2 != Py_None) || (co != Py_None && mo != Py_None)) {
        PyErr_SetString(PyExc_ValueError, "sgd: a second copy needs a first, and copies exclude a merge");
        goto done;
    }
    if (co != Py_None && get_like(co, &c, 1, &x, itemsize, "sgd: copy_to") < 0) goto done;
    if (co2 != Py_None && get_like(co2, &c2, 1, &x, itemsize, "sgd: copy_to_2") < 0) goto done;
    if (mo != Py_None) {
        PyObject *so, *to, *po;
        double world_size;
        if (!PyArg_ParseTuple(mo, "OOdO", &so, &to, &world_size, &po)) goto done;
        if (get_merge(so, to, world_size, po, &x, itemsize, "sgd: merge", &snapshot, &sum, &merge) < 0) goto done;
    }
    if ((so == Py_None) != (vo == Py_None)) {
        PyErr_SetString(PyExc_ValueError, "sgd: give support and its values together");
        goto done;
    }
    if (so != Py_None) {
        if (get_support(so, &support, x.len / itemsize) < 0) goto done;
        if (PyObject_GetBuffer(vo, &values, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) goto done;
        if (float_itemsize(&values) != itemsize || values.len / itemsize != support.len / 4) {
            PyErr_SetString(PyExc_ValueError, "sgd: the support's values must have the params' dtype and the support's length");
            goto done;
        }
    }
    sgd_job job = {itemsize, wd != 0.0, mom != 0.0, first, dampening != 0.0, nesterov, (char *)x.buf, (char *)b.buf,
                   (char *)c.buf, (char *)c2.buf, (const char *)g.buf, merge, divisor, lr, wd, mom, 1.0 - dampening,
                   (const int32_t *)support.buf, (const char *)values.buf, support.len / 4, {0}};
    result = finite_in_parallel(threads, x.len / itemsize, sgd_part, &job, job.finite);
done:
    PyBuffer_Release(&x);
    if (g.obj) PyBuffer_Release(&g);
    if (b.obj) PyBuffer_Release(&b);
    if (c.obj) PyBuffer_Release(&c);
    if (c2.obj) PyBuffer_Release(&c2);
    if (snapshot.obj) PyBuffer_Release(&snapshot);
    if (sum.obj) PyBuffer_Release(&sum);
    if (support.obj) PyBuffer_Release(&support);
    if (values.obj) PyBuffer_Release(&values);
    return result;
}

/* merge_average's loop, one per rule and dtype (the rule is a constant at each call site). */
#define DEFINE_MERGE(T, NAME, MERGE_ONE)                                                                       \
    ALWAYS_INLINE void NAME(Py_ssize_t n, T *restrict x, const merge_args *m, int rule) {                      \
        const T *restrict snapshot = (const T *)m->snapshot, *restrict sum = (const T *)m->sum;                \
        const T divisor = (T)m->divisor, p = (T)m->p, q = (T)m->q;                                             \
        for (Py_ssize_t i = 0; i < n; ++i) x[i] = MERGE_ONE(x[i], i, snapshot, sum, divisor, p, q, rule);      \
    }
DEFINE_MERGE(float, merge_f32, merge_one_f32)
DEFINE_MERGE(double, merge_f64, merge_one_f64)

typedef struct {
    int itemsize;
    char *x;
    merge_args merge;
} merge_job;

static void merge_part(void *ctx, Py_ssize_t lo, Py_ssize_t hi, int part) {
    const merge_job *j = (const merge_job *)ctx;
    const Py_ssize_t at = lo * j->itemsize;
    const merge_args m = merge_part_args(&j->merge, at);
    (void)part;
    if (j->itemsize == 4) {
        if (m.rule == PROPORTION) merge_f32(hi - lo, (float *)(j->x + at), &m, PROPORTION);
        else merge_f32(hi - lo, (float *)(j->x + at), &m, DELAYED);
    } else {
        if (m.rule == PROPORTION) merge_f64(hi - lo, (double *)(j->x + at), &m, PROPORTION);
        else merge_f64(hi - lo, (double *)(j->x + at), &m, DELAYED);
    }
}

static PyObject *py_merge(PyObject *self, PyObject *args) {
    PyObject *xo, *so, *to, *po;
    double divisor;
    int threads;
    Py_buffer x = {0}, snapshot = {0}, sum = {0};
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOdOi", &xo, &so, &to, &divisor, &po, &threads)) return NULL;
    const int itemsize = get_params(xo, &x, "merge_average");
    if (!itemsize) return NULL;
    PyObject *result = NULL;
    merge_job job = {itemsize, (char *)x.buf, {NO_MERGE, NULL, NULL, 1.0, 0.0, 1.0}};
    if (get_merge(so, to, divisor, po, &x, itemsize, "merge_average", &snapshot, &sum, &job.merge) < 0) goto done;
    result = none_in_parallel(threads, x.len / itemsize, merge_part, &job);
done:
    PyBuffer_Release(&x);
    if (sum.obj) PyBuffer_Release(&sum);
    if (snapshot.obj) PyBuffer_Release(&snapshot);
    return result;
}

/* elastic_pull's loop, one per dtype (the order of numpy's in-place passes, element by element). */
#define DEFINE_PULL(T, NAME)                                                                                   \
    ALWAYS_INLINE void NAME(Py_ssize_t n, T *restrict x, T *restrict c, const T *restrict sum, T p, T alpha,    \
                            T beta) {                                                                          \
        for (Py_ssize_t i = 0; i < n; ++i) {                                                                   \
            const T m = sum[i] / p, ci = c[i];                                                                 \
            const T w = x[i] - ci;                                                                             \
            const T v = w * alpha;                                                                             \
            x[i] = x[i] - v;                                                                                   \
            const T dm = m - ci;                                                                               \
            const T u = dm * beta;                                                                             \
            c[i] = ci + u;                                                                                     \
        }                                                                                                      \
    }
DEFINE_PULL(float, pull_f32)
DEFINE_PULL(double, pull_f64)

typedef struct {
    int itemsize;
    char *x, *c;
    const char *sum;
    double divisor, alpha, beta;
} pull_job;

static void pull_part(void *ctx, Py_ssize_t lo, Py_ssize_t hi, int part) {
    const pull_job *j = (const pull_job *)ctx;
    const Py_ssize_t at = lo * j->itemsize;
    (void)part;
    if (j->itemsize == 4)
        pull_f32(hi - lo, (float *)(j->x + at), (float *)(j->c + at), (const float *)(j->sum + at), (float)j->divisor,
                 (float)j->alpha, (float)j->beta);
    else
        pull_f64(hi - lo, (double *)(j->x + at), (double *)(j->c + at), (const double *)(j->sum + at), j->divisor,
                 j->alpha, j->beta);
}

static PyObject *py_pull(PyObject *self, PyObject *args) {
    PyObject *xo, *co, *so;
    double divisor, alpha, beta;
    int threads;
    Py_buffer x = {0}, c = {0}, sum = {0};
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOdddi", &xo, &co, &so, &divisor, &alpha, &beta, &threads)) return NULL;
    const int itemsize = get_params(xo, &x, "elastic_pull");
    if (!itemsize) return NULL;
    PyObject *result = NULL;
    if (get_like(co, &c, 1, &x, itemsize, "elastic_pull: center") < 0) goto done;
    if (get_like(so, &sum, 0, &x, itemsize, "elastic_pull: total") < 0) goto done;
    pull_job job = {itemsize, (char *)x.buf, (char *)c.buf, (const char *)sum.buf, divisor, alpha, beta};
    result = none_in_parallel(threads, x.len / itemsize, pull_part, &job);
done:
    PyBuffer_Release(&x);
    if (c.obj) PyBuffer_Release(&c);
    if (sum.obj) PyBuffer_Release(&sum);
    return result;
}

/* outer_sgd's outputs beside x: none, a copy, or a mix into c. */
enum { NO_COPY, COPY, MIX };

/* outer_sgd's loop, one per dtype; the flags are constants at every call site (OUTER_CASE). */
#define DEFINE_OUTER(T, NAME, DIRECTION)                                                                                  \
    ALWAYS_INLINE void NAME(Py_ssize_t n, T *restrict x, const T *restrict sum, T *restrict b, T *restrict c,   \
                            T p, T lr, T mom, T keep, T take, int momentum, int nesterov, int copy) {          \
        for (Py_ssize_t i = 0; i < n; ++i) {                                                                   \
            const T a = sum[i] / p;                                                                            \
            const T d = x[i] - a;                                                                              \
            T s = d;                                                                                           \
            if (momentum) {                                                                                    \
                T bi = b[i] * mom;                                                                             \
                bi = bi + d;                                                                                   \
                b[i] = bi;                                                                                     \
                s = DIRECTION(d, bi, mom, nesterov);                                                           \
            }                                                                                                  \
            const T u = s * lr;                                                                                \
            const T y = x[i] - u;                                                                              \
            x[i] = y;                                                                                          \
            if (copy == MIX) {                                                                                 \
                const T l = c[i] * keep;                                                                       \
                const T t = y * take;                                                                          \
                c[i] = l + t;                                                                                  \
            } else if (copy == COPY) {                                                                         \
                c[i] = y;                                                                                      \
            }                                                                                                  \
        }                                                                                                      \
    }
DEFINE_OUTER(float, outer_f32, direction_f32)
DEFINE_OUTER(double, outer_f64, direction_f64)

typedef struct {
    int itemsize, momentum, nesterov, copy;
    char *x, *b, *c;
    const char *sum;
    double divisor, lr, mom, keep, take;
} outer_job;

#define OUTER_CASE(LOOP, T, MOM, NEST, COPY)                                                                  \
    LOOP(n, (T *)(j->x + at), (const T *)(j->sum + at), j->b ? (T *)(j->b + at) : NULL,                       \
         j->c ? (T *)(j->c + at) : NULL, (T)j->divisor, (T)j->lr, (T)j->mom, (T)j->keep, (T)j->take, MOM, NEST,  \
         COPY)
#define OUTER_OUTPUTS(LOOP, T, MOM, NEST)                                                   \
    do {                                                                                    \
        if (j->copy == MIX) OUTER_CASE(LOOP, T, MOM, NEST, MIX);                            \
        else if (j->copy == COPY) OUTER_CASE(LOOP, T, MOM, NEST, COPY);                     \
        else OUTER_CASE(LOOP, T, MOM, NEST, NO_COPY);                                       \
    } while (0)
#define OUTER_CASES(LOOP, T)                                                                \
    do {                                                                                    \
        if (!j->momentum) OUTER_OUTPUTS(LOOP, T, 0, 0);                                     \
        else if (j->nesterov) OUTER_OUTPUTS(LOOP, T, 1, 1);                                 \
        else OUTER_OUTPUTS(LOOP, T, 1, 0);                                                  \
    } while (0)

static void outer_part(void *ctx, Py_ssize_t lo, Py_ssize_t hi, int part) {
    const outer_job *j = (const outer_job *)ctx;
    const Py_ssize_t n = hi - lo, at = lo * j->itemsize;
    (void)part;
    if (j->itemsize == 4) OUTER_CASES(outer_f32, float);
    else OUTER_CASES(outer_f64, double);
}

static PyObject *py_outer(PyObject *self, PyObject *args) {
    PyObject *xo, *so, *bo, *co;
    double divisor, lr, mom, alpha;
    int nesterov, threads;
    Py_buffer x = {0}, sum = {0}, b = {0}, c = {0};
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOOddddpi", &xo, &so, &bo, &co, &divisor, &lr, &mom, &alpha, &nesterov, &threads))
        return NULL;
    const int itemsize = get_params(xo, &x, "outer_sgd");
    if (!itemsize) return NULL;
    PyObject *result = NULL;
    if (get_like(so, &sum, 0, &x, itemsize, "outer_sgd: total") < 0) goto done;
    if (get_buffer(bo, &b, mom, &x, itemsize, "outer_sgd") < 0) goto done;
    if (co != Py_None && get_like(co, &c, 1, &x, itemsize, "outer_sgd: out") < 0) goto done;
    const int copy = co == Py_None ? NO_COPY : alpha != 0.0 ? MIX : COPY;
    /* 1 - alpha in double first, then rounded to the dtype: numpy's `x * (1.0 - alpha)` */
    outer_job job = {itemsize, mom != 0.0, nesterov && mom != 0.0, copy, (char *)x.buf, (char *)b.buf, (char *)c.buf,
                     (const char *)sum.buf, divisor, lr, mom, alpha, 1.0 - alpha};
    result = none_in_parallel(threads, x.len / itemsize, outer_part, &job);
done:
    PyBuffer_Release(&x);
    if (sum.obj) PyBuffer_Release(&sum);
    if (b.obj) PyBuffer_Release(&b);
    if (c.obj) PyBuffer_Release(&c);
    return result;
}

/* all_finite(buffer, threads, out=None, divisor=1.0): with out, also out = buffer / divisor in the same pass. */
static PyObject *py_all_finite(PyObject *self, PyObject *args) {
    PyObject *go, *oo = Py_None;
    double divisor = 1.0;
    int threads;
    Py_buffer g = {0}, o = {0};
    (void)self;
    if (!PyArg_ParseTuple(args, "Oi|Od", &go, &threads, &oo, &divisor)) return NULL;
    if (PyObject_GetBuffer(go, &g, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) return NULL;
    PyObject *result = NULL;
    const int itemsize = float_itemsize(&g);
    if (!itemsize) {
        PyErr_SetString(PyExc_TypeError, "all_finite: the buffer must be float32 or float64");
        goto done;
    }
    if (oo != Py_None && (get_params(oo, &o, "all_finite") != itemsize || o.len != g.len)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "all_finite: out must be a buffer of the buffer's dtype and length");
        goto done;
    }
    finite_job job = {itemsize, (const char *)g.buf, (char *)o.buf, divisor, {0}};
    result = finite_in_parallel(threads, g.len / itemsize, finite_part, &job, job.finite);
done:
    PyBuffer_Release(&g);
    if (o.obj) PyBuffer_Release(&o);
    return result;
}

static PyMethodDef methods[] = {
    {"sgd", py_sgd, METH_VARARGS,
     "sgd(params, grad, buffer, copy_to, copy_to_2, merge, divisor, lr, weight_decay, momentum, dampening, nesterov,"
     " first_step, threads, support=None, values=None) -> bool\n\n"
     "torch.optim.SGD's update of params (and of the momentum buffer, None when momentum == 0) in\n"
     "place, in one pass, for the gradient grad / divisor, then merge_average(params, *merge) unless\n"
     "merge is None, and the new params written into copy_to and copy_to_2 (unless None; not with a\n"
     "merge); contiguous, non-overlapping float32 or float64 buffers of equal length.  With support\n"
     "(int32 positions, ascending, unique) grad is read there only and taken as +0.0 elsewhere.\n"
     "Returns whether every element of grad is finite.  Long vectors are split across up to threads threads."},
    {"merge_average", py_merge, METH_VARARGS,
     "merge_average(params, snapshot, total, divisor, proportion, threads) -> None\n\n"
     "DaSGD's merge of the average total / divisor into params in place, in one pass: params - snapshot +\n"
     "average (proportion None) or proportion * params + (1 - proportion) * average (snapshot unread);\n"
     "contiguous, non-overlapping float32 or float64 buffers of equal length."},
    {"elastic_pull", py_pull, METH_VARARGS,
     "elastic_pull(params, center, total, divisor, alpha, beta, threads) -> None\n\n"
     "EASGD's pull in place, in one pass: params -= alpha * (params - center), then center += beta *\n"
     "(total / divisor - center) from the same params; contiguous, non-overlapping float32 or float64\n"
     "buffers of equal length (total, the sum of divisor workers' params, is left unchanged)."},
    {"outer_sgd", py_outer, METH_VARARGS,
     "outer_sgd(params, total, buffer, out, divisor, lr, momentum, alpha, nesterov, threads) -> None\n\n"
     "DiLoCo's outer SGD step in place, in one pass, on the pseudo-gradient params - total / divisor:\n"
     "torch.optim.SGD's momentum (buffer None when momentum == 0; never a first step: a zero buffer\n"
     "gives its bits) and Nesterov; unless out is None, the new params are copied into out (alpha 0)\n"
     "or mixed into it, out = out * alpha + params * (1 - alpha); contiguous, non-overlapping float32\n"
     "or float64 buffers of equal length (total is left unchanged)."},
    {"all_finite", py_all_finite, METH_VARARGS,
     "all_finite(buffer, threads, out=None, divisor=1.0) -> bool\n\nWhether every element of a contiguous float32 or float64\n"
     "buffer is finite; with out (a buffer of its dtype and length, perhaps the buffer itself), also\n"
     "out = buffer / divisor in the same pass."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_updatec", "Fused CPU torch.optim.SGD update, DaSGD merge, EASGD pull and DiLoCo outer step.", -1, methods, NULL, NULL, NULL, NULL,
};

/* VERSION changes with the functions' arguments, so that update.py can refuse a stale build. */
PyMODINIT_FUNC PyInit__updatec(void) {
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddIntConstant(m, "VERSION", 5) < 0) Py_CLEAR(m);
    return m;
}
