/* mpiopt.kernels._codecsc's decode-sum for the dense codecs (int8, int4, fp4, sign, none, bf16): the sum of
 * P payloads' decoded rows in row order (4 rows in one loop while the chunk's scales are finite) and the
 * division of the mean, in one pass over the output; sign's table of a byte's 8 signs as +-1.0f.  Chunks go
 * to threads whole (_parallel.h).
 */
#include "_codecs_shared.h"

typedef struct {
    int kind, add;
    Py_ssize_t chunk, rows, nbytes, values_at;
    const unsigned char *payloads;
    float *out;
    float divisor;
} decode_job;

/* Byte b's 8 signs as +-1.0f (bit k: entry k); filled at import. */
static float SIGNS[256][8];

void mpiopt_codecs_fill_tables(void) {
    for (uint32_t b = 0; b < 256; ++b) {
        for (int k = 0; k < 8; ++k) SIGNS[b][k] = unit(b >> k);
    }
}

/* A float32 and a bfloat16 at any byte address (payload rows need not be aligned). */
static inline float load_float(const unsigned char *p) {
    float f;
    memcpy(&f, p, 4);
    return f;
}

static inline float load_bf16(const unsigned char *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return float_of((uint32_t)h << 16);
}

/* none's and bf16's value i of a row (bytes from element c0 on). */
#define DENSE(p, i) (kind == NONE ? load_float((p) + 4 * (i)) : load_bf16((p) + 2 * (i)))

/* none and bf16: up to 4 rows in one loop (4 input streams, the output written once), in row order. */
INLINE void decode_dense(const decode_job *j, Py_ssize_t c0, Py_ssize_t n, float *restrict o, int kind) {
    const Py_ssize_t width = kind == NONE ? 4 : 2;
    for (Py_ssize_t r = 0; r < j->rows; r += 4) {
        const unsigned char *p[4];
        const Py_ssize_t q = j->rows - r < 4 ? j->rows - r : 4;
        for (Py_ssize_t k = 0; k < 4; ++k) p[k] = j->payloads + (r + (k < q ? k : 0)) * j->nbytes + width * c0;
        const int first = r == 0 && !j->add;
        if (q == 4 && first)
            for (Py_ssize_t i = 0; i < n; ++i) o[i] = add(add(add(DENSE(p[0], i), DENSE(p[1], i)), DENSE(p[2], i)), DENSE(p[3], i));
        else if (q == 4)
            for (Py_ssize_t i = 0; i < n; ++i)
                o[i] = add(add(add(add(o[i], DENSE(p[0], i)), DENSE(p[1], i)), DENSE(p[2], i)), DENSE(p[3], i));
        else
            for (Py_ssize_t k = 0; k < q; ++k) {
                if (k == 0 && first)
                    for (Py_ssize_t i = 0; i < n; ++i) o[i] = DENSE(p[k], i);
                else
                    for (Py_ssize_t i = 0; i < n; ++i) o[i] = add(o[i], DENSE(p[k], i));
            }
    }
}
#undef DENSE

#if defined(__GNUC__)
/* 8 floats as one value (GCC/clang vector extension): a byte's signs from the table in one load, not 8
 * gathered lanes (what the loop vectorizer makes of SIGNS[bytes[b]][k]). */
typedef float float8 __attribute__((vector_size(32)));
#endif

/* sign's 4 rows (bytes q[k], finite scales s[k]) into o[0, n): a byte's 8 signs at a time. */
INLINE void signs4(float *restrict o, Py_ssize_t n, const unsigned char *const *q, const float *s, int first) {
    Py_ssize_t b = 0;
#if defined(__GNUC__)
    for (; 8 * b + 8 <= n; ++b) {
        float8 acc, t;
        if (first) {
            acc = (float8){-0.0f, -0.0f, -0.0f, -0.0f, -0.0f, -0.0f, -0.0f, -0.0f}; /* -0 + x is x */
        } else {
            memcpy(&acc, o + 8 * b, 32);
        }
        for (int k = 0; k < 4; ++k) {
            memcpy(&t, SIGNS[q[k][b]], 32);
            acc = acc + t * s[k];
        }
        memcpy(o + 8 * b, &acc, 32);
    }
#endif
    for (Py_ssize_t i = 8 * b; i < n; ++i) {
        float acc = first ? -0.0f : o[i];
        for (int k = 0; k < 4; ++k) acc = acc + SIGNS[q[k][i >> 3]][i & 7] * s[k];
        o[i] = acc;
    }
}

/* int4's or fp4's 4 rows (bytes q[k], finite scales s[k]) into o[0, n), a byte (two nibbles) at a time. */
INLINE void nibbles4(float *restrict o, Py_ssize_t n, const unsigned char *const *q, const float *s, int first, int kind) {
#define NIB(c) (kind == INT4 ? (float)((int32_t)((uint32_t)(c) << 28) >> 28) : e3m0(c))
#define SUM(base, shift, at)                                                                            \
    (((base + NIB((uint32_t)q[0][at] >> shift & 15u) * s[0]) + NIB((uint32_t)q[1][at] >> shift & 15u) * s[1]) + \
     NIB((uint32_t)q[2][at] >> shift & 15u) * s[2]) + NIB((uint32_t)q[3][at] >> shift & 15u) * s[3]
    const Py_ssize_t pairs = n / 2;
    if (first)
        for (Py_ssize_t i = 0; i < pairs; ++i) {
            o[2 * i] = SUM(-0.0f, 0, i);
            o[2 * i + 1] = SUM(-0.0f, 4, i);
        }
    else
        for (Py_ssize_t i = 0; i < pairs; ++i) {
            o[2 * i] = SUM(o[2 * i], 0, i);
            o[2 * i + 1] = SUM(o[2 * i + 1], 4, i);
        }
    if (n % 2) o[n - 1] = first ? SUM(-0.0f, 0, pairs) : SUM(o[n - 1], 0, pairs);
#undef SUM
#undef NIB
}

WIDE static void decode_chunk(const decode_job *j, Py_ssize_t c0, Py_ssize_t n) {
    float *restrict o = j->out + c0;
    if (j->kind == NONE || j->kind == BF16) {
        if (j->kind == NONE) decode_dense(j, c0, n, o, NONE);
        else decode_dense(j, c0, n, o, BF16);
        if (j->divisor != 1.0f) divide(o, n, j->divisor);
        return;
    }
    Py_ssize_t r = 0;
    for (; j->kind <= SIGN && r + 4 <= j->rows; r += 4) { /* 4 rows in one loop while their scales are finite */
        const unsigned char *q[4];
        float s[4];
        for (int k = 0; k < 4; ++k) {
            const unsigned char *row = j->payloads + (r + k) * j->nbytes;
            memcpy(&s[k], row + 4 * (c0 / j->chunk), 4);
            q[k] = row + j->values_at + (j->kind == INT8 ? c0 : j->kind == SIGN ? c0 / 8 : c0 / 2);
        }
        if (!(s[0] - s[0] == 0.0f && s[1] - s[1] == 0.0f && s[2] - s[2] == 0.0f && s[3] - s[3] == 0.0f)) break;
        const int first = r == 0 && !j->add;
        if (j->kind == INT8) {
#define DEC(k) ((float)(signed char)q[k][i] * s[k])
            if (first)
                for (Py_ssize_t i = 0; i < n; ++i) o[i] = ((DEC(0) + DEC(1)) + DEC(2)) + DEC(3);
            else
                for (Py_ssize_t i = 0; i < n; ++i) o[i] = (((o[i] + DEC(0)) + DEC(1)) + DEC(2)) + DEC(3);
#undef DEC
        } else if (j->kind == SIGN) {
            signs4(o, n, q, s, first);
        } else if (j->kind == INT4) {
            nibbles4(o, n, q, s, first, INT4);
        } else {
            nibbles4(o, n, q, s, first, FP4);
        }
    }
    for (; r < j->rows; ++r) {
        const unsigned char *row = j->payloads + r * j->nbytes, *v = row + j->values_at;
        const int first = r == 0 && !j->add;
        float s = 0.0f;
        if (j->kind < NONE) memcpy(&s, row + 4 * (c0 / j->chunk), 4);
        if (j->kind == INT8 && s - s == 0.0f) { /* the common case in one loop (no NaN to order) */
            const signed char *q = (const signed char *)v + c0;
            if (first)
                for (Py_ssize_t i = 0; i < n; ++i) o[i] = (float)q[i] * s;
            else
                for (Py_ssize_t i = 0; i < n; ++i) o[i] = o[i] + (float)q[i] * s;
        } else if ((j->kind == INT4 || j->kind == FP4) && s - s == 0.0f) { /* pairs of nibbles, one loop */
            const unsigned char *bytes = v + c0 / 2;
            const Py_ssize_t pairs = n / 2;
#define NIBBLE(c) (j->kind == INT4 ? (float)((int32_t)((uint32_t)(c) << 28) >> 28) : e3m0(c))
            if (first)
                for (Py_ssize_t i = 0; i < pairs; ++i) {
                    o[2 * i] = NIBBLE(bytes[i] & 15u) * s;
                    o[2 * i + 1] = NIBBLE((uint32_t)bytes[i] >> 4) * s;
                }
            else
                for (Py_ssize_t i = 0; i < pairs; ++i) {
                    o[2 * i] = o[2 * i] + NIBBLE(bytes[i] & 15u) * s;
                    o[2 * i + 1] = o[2 * i + 1] + NIBBLE((uint32_t)bytes[i] >> 4) * s;
                }
            if (n % 2) o[n - 1] = first ? NIBBLE(bytes[pairs] & 15u) * s : o[n - 1] + NIBBLE(bytes[pairs] & 15u) * s;
#undef NIBBLE
        } else if (j->kind < NONE) {
            float unitv[BLOCK]; /* the block's decoded values in units of the scale */
            for (Py_ssize_t b = 0; b < n; b += BLOCK) {
                const Py_ssize_t m = n - b < BLOCK ? n - b : BLOCK, at = c0 + b; /* even for nibbles, a multiple of 8 for signs */
                if (j->kind == INT8) {
                    const signed char *q = (const signed char *)v + at;
                    for (Py_ssize_t i = 0; i < m; ++i) unitv[i] = (float)q[i];
                } else if (j->kind == SIGN) {
                    const unsigned char *bytes = v + at / 8;
                    for (Py_ssize_t i = 0; i < m / 8; ++i) memcpy(unitv + 8 * i, SIGNS[bytes[i]], 32);
                    for (Py_ssize_t i = m / 8 * 8; i < m; ++i) unitv[i] = SIGNS[bytes[m / 8]][i % 8];
                } else {
                    const unsigned char *bytes = v + at / 2;
                    unsigned char codes[BLOCK];
                    for (Py_ssize_t i = 0; i < m / 2; ++i) {
                        codes[2 * i] = bytes[i] & 15;
                        codes[2 * i + 1] = bytes[i] >> 4;
                    }
                    if (m % 2) codes[m - 1] = bytes[m / 2] & 15;
                    if (j->kind == INT4)
                        for (Py_ssize_t i = 0; i < m; ++i) unitv[i] = (float)((int32_t)((uint32_t)codes[i] << 28) >> 28);
                    else
                        for (Py_ssize_t i = 0; i < m; ++i) unitv[i] = e3m0(codes[i]);
                }
                float *restrict ob = o + b;
                if (first)
                    for (Py_ssize_t i = 0; i < m; ++i) ob[i] = unitv[i] * s;
                else if (s - s == 0.0f) /* finite units times a finite scale: no NaN to order */
                    for (Py_ssize_t i = 0; i < m; ++i) ob[i] = ob[i] + unitv[i] * s;
                else
                    for (Py_ssize_t i = 0; i < m; ++i) ob[i] = add(ob[i], unitv[i] * s);
            }
        }
    }
    if (j->divisor != 1.0f)
        divide(o, n, j->divisor);
}

static void decode_part(void *ctx, Py_ssize_t lo, Py_ssize_t hi, int part) {
    const decode_job *j = (const decode_job *)ctx;
    (void)part;
    for (Py_ssize_t c0 = lo; c0 < hi; c0 += j->chunk) decode_chunk(j, c0, hi - c0 < j->chunk ? hi - c0 : j->chunk);
}

PyObject *mpiopt_codecs_decode(PyObject *self, PyObject *args) {
    PyObject *po, *oo;
    int kind, add, threads;
    Py_ssize_t chunk, rows;
    double divisor;
    Py_buffer p = {0}, o = {0};
    (void)self;
    if (!PyArg_ParseTuple(args, "iOnOnpdi", &kind, &po, &rows, &oo, &chunk, &add, &divisor, &threads)) return NULL;
    if (mpiopt_codecs_check_kind(kind, chunk) < 0) return NULL;
    if (mpiopt_codecs_get_floats(oo, &o, 1, -1, "decode: out") < 0) return NULL;
    PyObject *result = NULL;
    const Py_ssize_t d = o.len / 4;
    Py_ssize_t values_at;
    if (PyObject_GetBuffer(po, &p, PyBUF_C_CONTIGUOUS) < 0) goto done;
    const Py_ssize_t nbytes = mpiopt_codecs_payload_layout(kind, d, chunk, &values_at);
    if (d < 1 || rows < 1 || p.len != rows * nbytes) {
        PyErr_SetString(PyExc_ValueError, "decode: the payloads' size is not rows times the codec's");
        goto done;
    }
    decode_job job = {kind, add, kind >= NONE ? 4096 : chunk, rows, nbytes, values_at, (const unsigned char *)p.buf,
                      (float *)o.buf, (float)divisor};
    result = mpiopt_codecs_run_parts(threads, d, job.chunk, decode_part, &job);
done:
    PyBuffer_Release(&o);
    if (p.obj) PyBuffer_Release(&p);
    return result;
}
