/* mpiopt.kernels._sparsec's aggregation: merge_rows and settle combine the workers' sorted payloads
 * into the caller's workspaces (numpy's masks and nonzero() allocate).  settle splits its union into
 * parts of 2**15 (unique, so parts touch disjoint entries).
 */
#include "_sparsec.h"

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

PyObject *mpiopt_sparse_merge_rows(PyObject *self, PyObject *args) {
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

PyObject *mpiopt_sparse_settle(PyObject *self, PyObject *args) {
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
