/* mpiopt.kernels._codecsc's encode for the dense codecs (int8, int4, fp4, sign, bf16): per chunk, in cache,
 * error feedback's fold (e = e * beta + x), the chunk's scale (absmax, or sign's mean |e| as numpy's pairwise
 * float64 sum), the codes and the residual's update (e = e - decoded) in one visit; bf16's round to nearest
 * even.  Chunks go to threads whole (_parallel.h).
 */
#include "_codecs_shared.h"

/* numpy's pairwise float64 sum of |a| (pairwise_sum in its loops_utils), as add.reduce does a row. */
WIDE static double pairwise_abs(const float *a, Py_ssize_t n) {
    if (n < 8) {
        double res = 0.;
        for (Py_ssize_t i = 0; i < n; ++i) res += (double)fabsf(a[i]);
        return res;
    }
    if (n <= 128) {
        double r[8];
        for (int k = 0; k < 8; ++k) r[k] = (double)fabsf(a[k]);
        Py_ssize_t i;
        for (i = 8; i < n - (n % 8); i += 8)
            for (int k = 0; k < 8; ++k) r[k] += (double)fabsf(a[i + k]);
        double res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for (; i < n; ++i) res += (double)fabsf(a[i]);
        return res;
    }
    Py_ssize_t n2 = n / 2;
    n2 -= n2 % 8;
    return pairwise_abs(a, n2) + pairwise_abs(a + n2, n - n2);
}

typedef struct {
    int kind, fold, feedback; /* fold: 0 none, 1 e = e + x, 2 e = e * beta + x */
    Py_ssize_t chunk;
    float *e;
    const float *x;
    float beta;
    unsigned char *scales, *values;
} encode_job;

/* Codes of v[0, m) (scale s) into q; with feedback v = v - decoded.  Branch-free, vectorizable loops: a
 * finite scale gives finite quotients; a non-finite one (NaN or inf in the chunk) takes the scalar loop. */
INLINE void quantize_int(float *restrict v, Py_ssize_t m, float s, float qmax, signed char *restrict q, int feedback) {
    const float safe = s == 0.0f ? 1.0f : s;
    if (s - s == 0.0f) {
        for (Py_ssize_t i = 0; i < m; ++i) {
            float t = v[i] / safe;
            t = t < qmax ? t : qmax;
            t = t > -qmax ? t : -qmax; /* clip(rint(t)) == rint(clip(t)): the bounds are integers */
            q[i] = (signed char)(int)copysignf((fabsf(t) + 0x1p23f) - 0x1p23f, t); /* rint, ties to even */
        }
    } else {
        for (Py_ssize_t i = 0; i < m; ++i) {
            float t = v[i] / safe;
            t = t > qmax ? qmax : t;
            t = t < -qmax ? -qmax : t;
            const float r = (fabsf(t) + 0x1p23f) - 0x1p23f;
            const int k = t == t ? (int)r : 0; /* NaN: 0, as numpy's cast */
            q[i] = (signed char)(t < 0.0f ? -k : k);
        }
    }
    if (feedback)
        for (Py_ssize_t i = 0; i < m; ++i) {
            const float dec = (float)q[i] * s;
            v[i] = v[i] - dec;
        }
}

INLINE void quantize_fp4(float *restrict v, Py_ssize_t m, float s, unsigned char *restrict q, int feedback) {
    const float safe = s == 0.0f ? 1.0f : s;
    for (Py_ssize_t i = 0; i < m; ++i) {
        const float t = fabsf(v[i]) / safe;
        /* the nearest power of two by the bits (mpiopt.codecs.scaled.FP4Codec), 2**-7 and up to 2**-6 */
        int32_t index = (int32_t)((bits_of(t) + 0x400000u) >> 23) - 120;
        index = index < 0 ? 0 : index;
        index = index > 7 ? 7 : index;
        const int32_t flag = t >= 0x1p-7f ? 1 : 0;
        index = index > flag ? index : flag;
        q[i] = (unsigned char)(index | (v[i] < 0.0f ? 8 : 0));
    }
    if (feedback)
        for (Py_ssize_t i = 0; i < m; ++i) {
            const float dec = e3m0(q[i]) * s;
            v[i] = v[i] - dec;
        }
}

INLINE void quantize_sign(float *restrict v, Py_ssize_t m, float s, unsigned char *restrict q, int feedback) {
    for (Py_ssize_t i = 0; i < m; ++i) q[i] = v[i] >= 0.0f ? 1 : 0;
    if (feedback)
        for (Py_ssize_t i = 0; i < m; ++i) {
            const float dec = s == s ? unit(q[i]) * s : s; /* a NaN keeps its sign (the compiler may flip it on -1 * s) */
            v[i] = v[i] - dec;
        }
}

/* Codes q[0, m) of elements [at, at + m) into the values section (at even for nibbles, a multiple of 8 for signs). */
INLINE void put_codes(int kind, unsigned char *values, Py_ssize_t at, const unsigned char *q, Py_ssize_t m) {
    if (kind == INT8) {
        memcpy(values + at, q, m);
    } else if (kind == SIGN) {
        unsigned char *out = values + at / 8;
        for (Py_ssize_t i = 0; i < m / 8; ++i) {
            unsigned byte = 0;
            for (int b = 0; b < 8; ++b) byte |= (unsigned)q[8 * i + b] << b;
            out[i] = (unsigned char)byte;
        }
        if (m % 8) {
            unsigned byte = 0;
            for (Py_ssize_t b = m / 8 * 8; b < m; ++b) byte |= (unsigned)q[b] << (b % 8);
            out[m / 8] = (unsigned char)byte;
        }
    } else {
        unsigned char *out = values + at / 2;
        const Py_ssize_t pairs = m / 2;
        for (Py_ssize_t i = 0; i < pairs; ++i) out[i] = (unsigned char)((q[2 * i] & 15) | (q[2 * i + 1] & 15) << 4);
        if (m % 2) out[pairs] = q[m - 1] & 15;
    }
}

/* The largest |v| by its bits (NaN's are above inf's, so NaN wins; the bits are below 2**31, so signed). */
#define TOP(v) top = (int32_t)(bits_of(v) & 0x7fffffffu) > top ? (int32_t)(bits_of(v) & 0x7fffffffu) : top

WIDE static void encode_chunk(const encode_job *j, Py_ssize_t c0, Py_ssize_t n) {
    float *restrict e = j->e + c0;
    const float *restrict x = j->x + c0;
    const float beta = j->beta;
    int32_t top = 0;
    if (j->kind == SIGN) { /* the sum below reads e again, in cache */
        if (j->fold == 2)
            for (Py_ssize_t i = 0; i < n; ++i) {
                const float v = e[i] * beta;
                e[i] = add(v, x[i]);
            }
        else if (j->fold == 1)
            for (Py_ssize_t i = 0; i < n; ++i) e[i] = add(e[i], x[i]);
    } else if (j->fold == 2) {
        for (Py_ssize_t i = 0; i < n; ++i) {
            const float v = e[i] * beta, w = add(v, x[i]);
            e[i] = w;
            TOP(w);
        }
    } else if (j->fold == 1) {
        for (Py_ssize_t i = 0; i < n; ++i) {
            const float w = add(e[i], x[i]);
            e[i] = w;
            TOP(w);
        }
    } else {
        for (Py_ssize_t i = 0; i < n; ++i) TOP(e[i]);
    }
    float s;
    if (j->kind == SIGN) {
        s = (float)(pairwise_abs(e, n) / (double)n);
    } else {
        const float absmax = float_of((uint32_t)top);
        s = j->kind == FP4 ? absmax : (float)((double)absmax / (j->kind == INT8 ? 127.0 : 7.0));
    }
    memcpy(j->scales + 4 * (c0 / j->chunk), &s, 4);
    unsigned char q[BLOCK];
    for (Py_ssize_t b = 0; b < n; b += BLOCK) {
        const Py_ssize_t m = n - b < BLOCK ? n - b : BLOCK;
        if (j->kind == INT8 || j->kind == INT4)
            quantize_int(e + b, m, s, j->kind == INT8 ? 127.0f : 7.0f, (signed char *)q, j->feedback);
        else if (j->kind == FP4)
            quantize_fp4(e + b, m, s, q, j->feedback);
        else
            quantize_sign(e + b, m, s, q, j->feedback);
        put_codes(j->kind, j->values, c0 + b, q, m);
    }
}

/* bf16's round to nearest even on the float32 bits; NaN -> 0x7FC0. */
WIDE static void encode_bf16(const float *restrict x, unsigned char *restrict out, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; ++i) {
        const uint32_t b = bits_of(x[i]);
        const uint16_t r = x[i] != x[i] ? 0x7FC0 : (uint16_t)((((b >> 16) & 1u) + 0x7FFFu + b) >> 16);
        memcpy(out + 2 * i, &r, 2);
    }
}

static void encode_part(void *ctx, Py_ssize_t lo, Py_ssize_t hi, int part) {
    const encode_job *j = (const encode_job *)ctx;
    (void)part;
    if (j->kind == BF16) {
        encode_bf16(j->e + lo, j->values + 2 * lo, hi - lo);
        return;
    }
    for (Py_ssize_t c0 = lo; c0 < hi; c0 += j->chunk) encode_chunk(j, c0, hi - c0 < j->chunk ? hi - c0 : j->chunk);
}

PyObject *mpiopt_codecs_encode(PyObject *self, PyObject *args) {
    PyObject *eo, *xo, *po;
    int kind, feedback, threads;
    Py_ssize_t chunk;
    double beta;
    Py_buffer e = {0}, x = {0}, p = {0};
    (void)self;
    if (!PyArg_ParseTuple(args, "iOOdOnpi", &kind, &eo, &xo, &beta, &po, &chunk, &feedback, &threads)) return NULL;
    if (mpiopt_codecs_check_kind(kind, chunk) < 0 || kind == NONE) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "encode: none is a copy");
        return NULL;
    }
    const int fold = xo != Py_None;
    if (mpiopt_codecs_get_floats(eo, &e, fold || feedback, -1, "encode: e") < 0) return NULL;
    PyObject *result = NULL;
    const Py_ssize_t d = e.len / 4;
    Py_ssize_t values_at;
    if (fold && mpiopt_codecs_get_floats(xo, &x, 0, d, "encode: x") < 0) goto done;
    if (PyObject_GetBuffer(po, &p, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) goto done;
    if (d < 1 || p.len != mpiopt_codecs_payload_layout(kind, d, chunk, &values_at)) {
        PyErr_SetString(PyExc_ValueError, "encode: the payload's size is not the codec's");
        goto done;
    }
    encode_job job = {kind, fold ? (beta != 1.0 ? 2 : 1) : 0, feedback, kind == BF16 ? 4096 : chunk, (float *)e.buf,
                      (const float *)x.buf, (float)beta, (unsigned char *)p.buf, (unsigned char *)p.buf + values_at};
    result = mpiopt_codecs_run_parts(threads, d, job.chunk, encode_part, &job);
done:
    PyBuffer_Release(&e);
    if (x.obj) PyBuffer_Release(&x);
    if (p.obj) PyBuffer_Release(&p);
    return result;
}
