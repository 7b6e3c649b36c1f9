/* mpiopt.kernels._sparsec's RegTop-k scores: regtopk_ratio computes the regularizer's ratio at the
 * entries sent last step, scale_sampled applies the regularizer to a strided sample's sent entries.
 */
#include "_sparsec.h"

#include <math.h>

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

PyObject *mpiopt_sparse_regtopk_ratio(PyObject *self, PyObject *args) {
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

PyObject *mpiopt_sparse_scale_sampled(PyObject *self, PyObject *args) {
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
