/* The codecs' loops (mpiopt.codecs: int8, int4, fp4, sign, none, bf16, topk), fused (optional).
 *
 * encode: per chunk, in cache, error feedback's fold (e = e * beta + x), the chunk's scale, the codes and
 * the residual's update (e = e - decoded) in one visit instead of numpy's dozen passes over d; topk's
 * selection is a radix select on the float bits.  decode: the sum of P payloads' decoded rows in row
 * order (and the division of the mean) in one pass over the output.  Every product, quotient and sum is
 * the float32 (or float64) operation numpy does, in its order: the same bits.  The details that carry
 * it: np.rint's round-half-to-even is (|t| + 2**23) - 2**23 for |t| <= 127 (no SSE4.1 needed); numpy's
 * pairwise float64 sums (its blocks of 8 accumulators and 128 entries; for sign's float32 input, chunks
 * of at most 8192, numpy's buffer); a + b keeps a's NaN when both are NaN (add below).
 * Chunks go to threads whole (_parallel.h), so the bits do not depend on the split.
 */
#include "_cloops.h"

#include <math.h>
#include <stdlib.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

enum { INT8, INT4, FP4, SIGN, NONE, BF16 };

/* The chunk loops also compiled for AVX2 and AVX-512, picked at load time: the same IEEE operations and
 * no contraction (the same bits) on 8 or 16 lanes instead of SSE2's 4. */
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11 && defined(__x86_64__) && defined(__linux__)
#define WIDE __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define WIDE
#endif
/* What the chunk loops call is compiled into each of their versions. */
#if defined(__GNUC__)
#define INLINE static inline __attribute__((always_inline))
#else
#define INLINE static inline
#endif
/* Codes per inner block: in L1 with their chunk. */
#define BLOCK 512

static inline uint32_t bits_of(float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    return u;
}

static inline float float_of(uint32_t u) {
    float v;
    memcpy(&v, &u, 4);
    return v;
}

/* numpy's a + b, whose NaN is a's when both are NaN: the compiler may swap the operands of a C +. */
static inline float add(float a, float b) { return a != a ? a : a + b; }

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

/* E3M0's value of code q in units of the scale, from the bits: 2**(index - 7), 0 for index 0, sign bit 8. */
static inline float e3m0(uint32_t q) {
    const uint32_t index = q & 7;
    return float_of((index ? (index + 120) << 23 : 0) | (q & 8) << 28);
}

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

/* +1.0f for bit 1, -1.0f for bit 0. */
static inline float unit(uint32_t bit) { return float_of(0x3f800000u | (~bit & 1u) << 31); }

/* Byte b's 8 signs as +-1.0f (bit k: entry k); filled at import. */
static float SIGNS[256][8];

static void fill_tables(void) {
    for (uint32_t b = 0; b < 256; ++b) {
        for (int k = 0; k < 8; ++k) SIGNS[b][k] = unit(b >> k);
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

typedef struct {
    int kind, add;
    Py_ssize_t chunk, rows, nbytes, values_at;
    const unsigned char *payloads;
    float *out;
    float divisor;
} decode_job;

/* o /= divisor; by a power of two a product by its exact reciprocal, which rounds the same exact value. */
INLINE void divide(float *restrict o, Py_ssize_t n, float divisor) {
    int exponent;
    if (frexpf(divisor, &exponent) == 0.5f) {
        const float reciprocal = 1.0f / divisor;
        for (Py_ssize_t i = 0; i < n; ++i) o[i] = o[i] * reciprocal;
    } else {
        for (Py_ssize_t i = 0; i < n; ++i) o[i] = o[i] / divisor;
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

/* fn over [0, d) in parts of whole `align` entries, on up to `threads` threads, without the GIL; returns None. */
static PyObject *run_parts(int threads, Py_ssize_t d, Py_ssize_t align, mpiopt_part_fn fn, void *job) {
    Py_BEGIN_ALLOW_THREADS
    mpiopt_parallel_for(threads, d, align, fn, job);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* A C-contiguous float32 buffer (writable if asked) of d entries; -1 with an exception set. */
static int get_floats(PyObject *o, Py_buffer *view, int writable, Py_ssize_t d, const char *what) {
    if (PyObject_GetBuffer(o, view, (writable ? PyBUF_WRITABLE : 0) | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) return -1;
    const char *f = view->format ? view->format : "B";
    if (*f == '@' || *f == '=' || *f == (PY_LITTLE_ENDIAN ? '<' : '>')) ++f;
    if (strcmp(f, "f") != 0 || view->itemsize != 4 || (d >= 0 && view->len != 4 * d)) {
        PyErr_Format(PyExc_ValueError, "%s must be C-contiguous float32 of the vector's length", what);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* Bytes a (P rows of) payload(s) of d entries take, and where its values start. */
static Py_ssize_t payload_layout(int kind, Py_ssize_t d, Py_ssize_t chunk, Py_ssize_t *values_at) {
    *values_at = kind < NONE ? 4 * ((d + chunk - 1) / chunk) : 0;
    const Py_ssize_t values[] = {d, (d + 1) / 2, (d + 1) / 2, (d + 7) / 8, 4 * d, 2 * d};
    return *values_at + values[kind];
}

/* Parts own whole chunks: chunk even for nibbles and a multiple of 8 for signs (checked by the caller). */
static int check_kind(int kind, Py_ssize_t chunk) {
    if (kind < INT8 || kind > BF16 || chunk < 1 || ((kind == INT4 || kind == FP4) && chunk % 2) ||
        (kind == SIGN && (chunk % 8 || chunk > 8192))) {
        PyErr_SetString(PyExc_ValueError, "codecs: unknown kind, or a chunk the C loops do not take");
        return -1;
    }
    return 0;
}

static PyObject *py_encode(PyObject *self, PyObject *args) {
    PyObject *eo, *xo, *po;
    int kind, feedback, threads;
    Py_ssize_t chunk;
    double beta;
    Py_buffer e = {0}, x = {0}, p = {0};
    (void)self;
    if (!PyArg_ParseTuple(args, "iOOdOnpi", &kind, &eo, &xo, &beta, &po, &chunk, &feedback, &threads)) return NULL;
    if (check_kind(kind, chunk) < 0 || kind == NONE) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "encode: none is a copy");
        return NULL;
    }
    const int fold = xo != Py_None;
    if (get_floats(eo, &e, fold || feedback, -1, "encode: e") < 0) return NULL;
    PyObject *result = NULL;
    const Py_ssize_t d = e.len / 4;
    Py_ssize_t values_at;
    if (fold && get_floats(xo, &x, 0, d, "encode: x") < 0) goto done;
    if (PyObject_GetBuffer(po, &p, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) goto done;
    if (d < 1 || p.len != payload_layout(kind, d, chunk, &values_at)) {
        PyErr_SetString(PyExc_ValueError, "encode: the payload's size is not the codec's");
        goto done;
    }
    encode_job job = {kind, fold ? (beta != 1.0 ? 2 : 1) : 0, feedback, kind == BF16 ? 4096 : chunk, (float *)e.buf,
                      (const float *)x.buf, (float)beta, (unsigned char *)p.buf, (unsigned char *)p.buf + values_at};
    result = run_parts(threads, d, job.chunk, encode_part, &job);
done:
    PyBuffer_Release(&e);
    if (x.obj) PyBuffer_Release(&x);
    if (p.obj) PyBuffer_Release(&p);
    return result;
}

static PyObject *py_decode(PyObject *self, PyObject *args) {
    PyObject *po, *oo;
    int kind, add, threads;
    Py_ssize_t chunk, rows;
    double divisor;
    Py_buffer p = {0}, o = {0};
    (void)self;
    if (!PyArg_ParseTuple(args, "iOnOnpdi", &kind, &po, &rows, &oo, &chunk, &add, &divisor, &threads)) return NULL;
    if (check_kind(kind, chunk) < 0) return NULL;
    if (get_floats(oo, &o, 1, -1, "decode: out") < 0) return NULL;
    PyObject *result = NULL;
    const Py_ssize_t d = o.len / 4;
    Py_ssize_t values_at;
    if (PyObject_GetBuffer(po, &p, PyBUF_C_CONTIGUOUS) < 0) goto done;
    const Py_ssize_t nbytes = payload_layout(kind, d, chunk, &values_at);
    if (d < 1 || rows < 1 || p.len != rows * nbytes) {
        PyErr_SetString(PyExc_ValueError, "decode: the payloads' size is not rows times the codec's");
        goto done;
    }
    decode_job job = {kind, add, kind >= NONE ? 4096 : chunk, rows, nbytes, values_at, (const unsigned char *)p.buf,
                      (float *)o.buf, (float)divisor};
    result = run_parts(threads, d, job.chunk, decode_part, &job);
done:
    PyBuffer_Release(&o);
    if (p.obj) PyBuffer_Release(&p);
    return result;
}

/* ---- topk: per chunk the k largest |e| (ties to the lowest index, NaN below every number), b-bit levels ---- */

/* numpy's pairwise float64 sum (as pairwise_abs) of a float64 array. */
WIDE static double pairwise(const double *a, Py_ssize_t n) {
    if (n < 8) {
        double res = 0.;
        for (Py_ssize_t i = 0; i < n; ++i) res += a[i];
        return res;
    }
    if (n <= 128) {
        double r[8];
        for (int k = 0; k < 8; ++k) r[k] = a[k];
        Py_ssize_t i;
        for (i = 8; i < n - (n % 8); i += 8)
            for (int k = 0; k < 8; ++k) r[k] += a[i + k];
        double res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for (; i < n; ++i) res += a[i];
        return res;
    }
    Py_ssize_t n2 = n / 2;
    n2 -= n2 % 8;
    return pairwise(a, n2) + pairwise(a + n2, n - n2);
}

/* Field j of w bits at bit j * w of a section: OR-ed in (the section starts zeroed), or read. */
INLINE void put_field(unsigned char *p, Py_ssize_t j, int w, uint32_t value) {
    const Py_ssize_t pos = j * w;
    uint64_t t = (uint64_t)value << (pos & 7);
    for (unsigned char *b = p + (pos >> 3); t; t >>= 8) *b++ |= (unsigned char)t;
}

/* Fields j0, j0 + 1, ... of v: a byte at a time from a bit accumulator where field j0 starts a byte. */
INLINE void put_fields(unsigned char *p, Py_ssize_t j0, int w, const uint32_t *v, Py_ssize_t count) {
    if ((j0 * w) & 7) {
        for (Py_ssize_t i = 0; i < count; ++i) put_field(p, j0 + i, w, v[i]);
        return;
    }
    unsigned char *b = p + (j0 * w >> 3);
    uint64_t acc = 0;
    int held = 0;
    for (Py_ssize_t i = 0; i < count; ++i) {
        acc |= (uint64_t)v[i] << held;
        for (held += w; held >= 8; held -= 8, acc >>= 8) *b++ = (unsigned char)acc;
    }
    if (held) *b |= (unsigned char)acc;
}

static inline uint32_t get_field(const unsigned char *p, Py_ssize_t j, int w) {
    const Py_ssize_t pos = j * w, last = (pos + w - 1) >> 3;
    uint64_t t = 0;
    for (Py_ssize_t b = last; b >= pos >> 3; --b) t = t << 8 | p[b];
    return (uint32_t)(t >> (pos & 7)) & ((1u << w) - 1);
}

typedef struct {
    int fold, feedback, bits, index_bits;
    Py_ssize_t d, chunk, k;
    float *e;
    const float *x;
    float beta;
    double low, spacing; /* the levels' first and spacing, in units of the mean |value| */
    const float *table;  /* the 2**bits decoded values in units of the scale */
    unsigned char *scales, *indices, *values;
} topk_job;

/* Per-part work space: a chunk's keys, its candidates (positions, keys), its selection, their magnitudes;
 * histograms (zero between uses); the last chunk's threshold, where the next one's candidates start. */
typedef struct {
    int32_t *keys, *cand, *cand_keys, *picked;
    uint32_t *scratch, *codes;
    double *magnitudes;
    uint32_t h1[2048], h2[1024];
    int32_t hint;
} topk_space;

/* Of the counts h[0..top], the bin holding the need-th largest and how many lie above it. */
static inline uint32_t bin_of(const uint32_t *h, uint32_t top, Py_ssize_t need, Py_ssize_t *above) {
    Py_ssize_t sum = 0;
    uint32_t b = top;
    while (sum + h[b] < need) sum += h[b--];
    *above = sum;
    return b;
}

/* The positions of keys[0, n) at least low, ascending, into at; returns how many.  SSE2 compares 16 keys
 * at once and only their set bits are visited (a few in a hundred keys pass). */
INLINE Py_ssize_t gather(const int32_t *keys, Py_ssize_t n, int32_t low, int32_t *at) {
    Py_ssize_t m = 0, i = 0;
#if defined(__SSE2__)
    const __m128i below = _mm_set1_epi32(low - 1);
#define MASK4(q) _mm_movemask_ps(_mm_castsi128_ps(_mm_cmpgt_epi32(_mm_loadu_si128((const __m128i *)(keys + i + 4 * (q))), below)))
    for (; i + 16 <= n; i += 16) {
        unsigned mask = (unsigned)(MASK4(0) | MASK4(1) << 4 | MASK4(2) << 8 | MASK4(3) << 12);
        const int count = __builtin_popcount(mask);
        /* the first two unconditionally (at has spare entries): most blocks hold 0, 1 or 2 */
        at[m] = (int32_t)(i + __builtin_ctz(mask | 0x10000u));
        mask &= mask - 1;
        at[m + 1] = (int32_t)(i + __builtin_ctz(mask | 0x10000u));
        if (count > 2)
            for (Py_ssize_t q = m + 2; mask &= mask - 1, mask; ++q) at[q] = (int32_t)(i + __builtin_ctz(mask));
        m += count;
    }
#undef MASK4
#endif
    for (; i < n; ++i) {
        at[m] = (int32_t)i;
        m += keys[i] >= low;
    }
    return m;
}

#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11 && defined(__x86_64__) && defined(__linux__)
#include <immintrin.h>
/* gather with AVX-512 where the CPU has it (PyInit decides): a compare and a compress per 16 keys. */
#define GATHER512 1
static int use_gather512;

__attribute__((target("avx512f,popcnt"))) static Py_ssize_t gather512(const int32_t *keys, Py_ssize_t n, int32_t low,
                                                                      int32_t *at) {
    Py_ssize_t m = 0, i = 0;
    const __m512i bound = _mm512_set1_epi32(low), sixteen = _mm512_set1_epi32(16);
    __m512i index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (; i + 16 <= n; i += 16, index = _mm512_add_epi32(index, sixteen)) {
        const __mmask16 mask = _mm512_cmpge_epi32_mask(_mm512_loadu_si512((const void *)(keys + i)), bound);
        _mm512_storeu_si512((void *)(at + m), _mm512_maskz_compress_epi32(mask, index)); /* at has 16 spare */
        m += _mm_popcnt_u32(mask);
    }
    for (; i < n; ++i) {
        at[m] = (int32_t)i;
        m += keys[i] >= low;
    }
    return m;
}
#endif

/* The kk-th largest of keys[0, m) (top their largest) and how many keys equal to it to take, lowest
 * position first: a radix select on bits 31-20, 19-10 and 9-0; the histograms are left zero. */
INLINE int32_t threshold(topk_space *w, const int32_t *keys, Py_ssize_t m, Py_ssize_t kk, int32_t top, Py_ssize_t *ties) {
    uint32_t *h = w->h1, *h2 = w->h2, *low = w->scratch;
    for (Py_ssize_t i = 0; i < m; ++i) h[keys[i] >> 20]++;
    Py_ssize_t above, need = kk;
    const uint32_t b1 = bin_of(h, (uint32_t)top >> 20, need, &above);
    need -= above;
    Py_ssize_t c = 0; /* the bin's keys, low 20 bits (branch-free: about one in five is in the bin) */
    for (Py_ssize_t i = 0; i < m; ++i) {
        h[keys[i] >> 20] = 0;
        low[c] = (uint32_t)keys[i] & 0xfffff;
        c += (uint32_t)keys[i] >> 20 == b1;
    }
    if (c <= 48) { /* few keys in the bin: sorted descending (insertion), the need-th is the threshold */
        for (Py_ssize_t i = 1; i < c; ++i) {
            const uint32_t u = low[i];
            Py_ssize_t k = i;
            for (; k > 0 && low[k - 1] < u; --k) low[k] = low[k - 1];
            low[k] = u;
        }
        const uint32_t t = low[need - 1];
        Py_ssize_t larger = 0;
        while (low[larger] > t) ++larger;
        *ties = need - larger;
        return (int32_t)(b1 << 20 | t);
    }
    uint32_t top2 = 0;
    for (Py_ssize_t i = 0; i < c; ++i) {
        h2[low[i] >> 10]++;
        top2 = low[i] > top2 ? low[i] : top2;
    }
    const uint32_t b2 = bin_of(h2, top2 >> 10, need, &above);
    need -= above;
    uint32_t top3 = 0;
    for (Py_ssize_t i = 0; i < c; ++i) h2[low[i] >> 10] = 0;
    for (Py_ssize_t i = 0; i < c; ++i)
        if (low[i] >> 10 == b2) {
            h2[low[i] & 1023]++;
            top3 = (low[i] & 1023) > top3 ? low[i] & 1023 : top3;
        }
    const uint32_t b3 = bin_of(h2, top3, need, &above);
    for (Py_ssize_t i = 0; i < c; ++i) h2[low[i] & 1023] = 0;
    *ties = need - above;
    return (int32_t)(b1 << 20 | b2 << 10 | b3);
}

/* Chunk c (n entries from c0; its fields from j0): fold, select, scale, levels, fields, and feedback. */
/* keys[i]: |v|'s bits + 1 (order-preserving), NaN 0 (below every number). */
static inline int32_t key_of(float v) {
    const int32_t u = (int32_t)(bits_of(v) & 0x7fffffffu) + 1;
    return u > 0x7f800001 ? 0 : u;
}

WIDE static void topk_chunk(const topk_job *j, topk_space *w, Py_ssize_t c0, Py_ssize_t n, Py_ssize_t j0) {
    float *restrict e = j->e + c0;
    const float *restrict x = j->x + c0;
    int32_t *restrict keys = w->keys;
    const Py_ssize_t kk = n < j->k ? n : j->k;
    const float beta = j->beta;
    int32_t top = 0;
    if (j->fold == 2)
        for (Py_ssize_t i = 0; i < n; ++i) {
            const float v = add(e[i] * beta, x[i]);
            const int32_t key = key_of(v);
            e[i] = v;
            keys[i] = key;
            top = key > top ? key : top;
        }
    else if (j->fold == 1)
        for (Py_ssize_t i = 0; i < n; ++i) {
            const float v = add(e[i], x[i]);
            const int32_t key = key_of(v);
            e[i] = v;
            keys[i] = key;
            top = key > top ? key : top;
        }
    else
        for (Py_ssize_t i = 0; i < n; ++i) {
            const int32_t key = key_of(e[i]);
            keys[i] = key;
            top = key > top ? key : top;
        }
    /* Candidates: the keys from an eighth of an octave below the last chunk's threshold (chunks alike need look
     * at a few per cent of their keys), else from an octave below, else all. */
    Py_ssize_t m = 0;
    for (int32_t below = 1 << 20; m < kk; below = below < (8 << 20) ? 8 << 20 : INT32_MAX)
#ifdef GATHER512
        if (use_gather512)
            m = gather512(keys, n, w->hint > below ? w->hint - below : 0, w->cand);
        else
#endif
            m = gather(keys, n, w->hint > below ? w->hint - below : 0, w->cand);
    for (Py_ssize_t i = 0; i < m; ++i) w->cand_keys[i] = keys[w->cand[i]];
    Py_ssize_t ties;
    const int32_t t = threshold(w, w->cand_keys, m, kk, top, &ties);
    w->hint = t;
    Py_ssize_t picked = 0;
    Py_ssize_t equal = 0; /* keys equal to t so far: the first `ties` of them are taken */
    for (Py_ssize_t i = 0; i < m; ++i) { /* branch-free: about half are taken */
        const int32_t key = w->cand_keys[i];
        const int take = (key > t) | ((key == t) & (equal < ties));
        equal += key == t;
        w->picked[picked] = w->cand[i];
        picked += take;
    }
    for (Py_ssize_t i = 0; i < kk; ++i) w->magnitudes[i] = fabs((double)e[w->picked[i]]);
    const float s = (float)(pairwise(w->magnitudes, kk) / (double)kk);
    memcpy(j->scales + 4 * (c0 / j->chunk), &s, 4);
    const double unit = s == 0.0f ? 1.0 : (double)s, last = (double)((1 << (j->bits - 1)) - 1);
    const double first = j->low, spacing = j->spacing;
    const double *restrict magnitudes = w->magnitudes;
    uint32_t *restrict codes = w->codes;
    for (Py_ssize_t i = 0; i < kk; ++i) { /* the nearest level: clip, then rint; NaN -> 0 (nan_to_num); a vector loop */
        double r = (magnitudes[i] / unit - first) / spacing;
        r = r > last ? last : r;
        r = r < 0.0 ? 0.0 : r;
        codes[i] = (uint32_t)(r == r ? (r + 0x1p52) - 0x1p52 : 0.0);
    }
    const int sign_at = j->bits - 1;
    for (Py_ssize_t i = 0; i < kk; ++i) {
        const Py_ssize_t at = w->picked[i];
        const uint32_t code = codes[i] | (bits_of(e[at]) >> 31) << sign_at;
        codes[i] = code;
        if (j->feedback) {
            const float dec = j->table[code] * s;
            e[at] = e[at] - dec; /* numpy's e + (-1 * dec): the same, NaN's included */
        }
    }
    put_fields(j->values, j0, j->bits, w->codes, kk);
    put_fields(j->indices, j0, j->index_bits, (const uint32_t *)w->picked, kk);
}

static void topk_part(void *ctx, Py_ssize_t lo, Py_ssize_t hi, int part) {
    const topk_job *j = (const topk_job *)ctx;
    (void)part;
    topk_space *w = (topk_space *)calloc(1, sizeof(topk_space));
    const Py_ssize_t n = j->chunk < j->d ? j->chunk : j->d;
    if (w) {
        w->keys = (int32_t *)malloc(n * 4);
        w->cand = (int32_t *)malloc((n + 16) * 4);
        w->cand_keys = (int32_t *)malloc(n * 4);
        w->picked = (int32_t *)malloc(n * 4);
        w->scratch = (uint32_t *)malloc(n * 4);
        w->codes = (uint32_t *)malloc(n * 4);
        w->magnitudes = (double *)malloc(n * 8);
    }
    if (w && w->keys && w->cand && w->cand_keys && w->picked && w->scratch && w->codes && w->magnitudes)
        for (Py_ssize_t c0 = lo; c0 < hi; c0 += j->chunk)
            topk_chunk(j, w, c0, hi - c0 < j->chunk ? hi - c0 : j->chunk, c0 / j->chunk * j->k);
    if (w) {
        free(w->keys);
        free(w->cand);
        free(w->cand_keys);
        free(w->scratch);
        free(w->codes);
        free(w->picked);
        free(w->magnitudes);
    }
    free(w);
}

typedef struct {
    int add, bits, index_bits;
    Py_ssize_t d, chunk, k, rows, nbytes, indices_at, values_at;
    const unsigned char *payloads;
    const float *table;
    float *out;
    float divisor;
} topk_decode_job;

static void topk_decode_part(void *ctx, Py_ssize_t lo, Py_ssize_t hi, int part) {
    const topk_decode_job *j = (const topk_decode_job *)ctx;
    (void)part;
    for (Py_ssize_t c0 = lo; c0 < hi; c0 += j->chunk) {
        const Py_ssize_t n = hi - c0 < j->chunk ? hi - c0 : j->chunk, kk = n < j->k ? n : j->k;
        const Py_ssize_t c = c0 / j->chunk, j0 = c * j->k;
        float *restrict o = j->out + c0;
        if (!j->add) memset(o, 0, n * sizeof(float)); /* +0.0, then each row added: numpy's zeros and scatter_add */
        for (Py_ssize_t r = 0; r < j->rows; ++r) {
            const unsigned char *row = j->payloads + r * j->nbytes;
            float s;
            memcpy(&s, row + 4 * c, 4);
            for (Py_ssize_t i = 0; i < kk; ++i) {
                const uint32_t at = get_field(row + j->indices_at, j0 + i, j->index_bits);
                const float v = j->table[get_field(row + j->values_at, j0 + i, j->bits)] * s;
                o[at] = add(o[at], v);
            }
        }
        if (j->divisor != 1.0f)
            divide(o, n, j->divisor);
    }
}

/* A float32 table of 2**bits entries; -1 with an exception set. */
static int get_table(PyObject *o, Py_buffer *view, int bits) {
    if (PyObject_GetBuffer(o, view, PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (bits < 1 || bits > 8 || view->len != 4 * ((Py_ssize_t)1 << bits)) {
        PyErr_SetString(PyExc_ValueError, "topk: the level table must hold 2**bits float32, bits in [1, 8]");
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* Sections of a topk payload: scales, indices, values; returns its bytes. */
static Py_ssize_t topk_layout(Py_ssize_t d, Py_ssize_t chunk, Py_ssize_t k, int bits, int index_bits, Py_ssize_t *indices_at,
                              Py_ssize_t *values_at) {
    const Py_ssize_t count = d / chunk * k + (d % chunk < k ? d % chunk : k);
    *indices_at = 4 * ((d + chunk - 1) / chunk);
    *values_at = *indices_at + (count * index_bits + 7) / 8;
    return *values_at + (count * bits + 7) / 8;
}

/* Threads only where every chunk's fields start on a byte (no byte shared by two parts). */
static int topk_threads(int threads, Py_ssize_t k, int bits, int index_bits) {
    return (k * bits) % 8 || (k * index_bits) % 8 ? 1 : threads;
}

static PyObject *py_topk_encode(PyObject *self, PyObject *args) {
    PyObject *eo, *xo, *po, *to;
    Py_ssize_t chunk, k;
    int bits, index_bits, feedback, threads;
    double beta, low, spacing;
    Py_buffer e = {0}, x = {0}, p = {0}, t = {0};
    (void)self;
    if (!PyArg_ParseTuple(args, "OOdOnniiddOpi", &eo, &xo, &beta, &po, &chunk, &k, &bits, &index_bits, &low, &spacing, &to,
                          &feedback, &threads))
        return NULL;
    const int fold = xo != Py_None;
    if (get_floats(eo, &e, fold || feedback, -1, "topk: e") < 0) return NULL;
    PyObject *result = NULL;
    const Py_ssize_t d = e.len / 4;
    Py_ssize_t indices_at, values_at;
    if (fold && get_floats(xo, &x, 0, d, "topk: x") < 0) goto done;
    if (get_table(to, &t, bits) < 0) goto done;
    if (PyObject_GetBuffer(po, &p, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) goto done;
    if (d < 1 || chunk < 1 || k < 1 || k > chunk || index_bits < 1 || index_bits > 24 || ((Py_ssize_t)1 << index_bits) < chunk ||
        p.len != topk_layout(d, chunk, k, bits, index_bits, &indices_at, &values_at)) {
        PyErr_SetString(PyExc_ValueError, "topk: bad chunk, k or index bits, or the payload's size is not the codec's");
        goto done;
    }
    unsigned char *payload = (unsigned char *)p.buf;
    memset(payload + indices_at, 0, p.len - indices_at); /* fields are OR-ed in */
    topk_job job = {fold ? (beta != 1.0 ? 2 : 1) : 0, feedback, bits, index_bits, d, chunk, k, (float *)e.buf,
                    (const float *)x.buf, (float)beta, low, spacing, (const float *)t.buf, payload, payload + indices_at,
                    payload + values_at};
    result = run_parts(topk_threads(threads, k, bits, index_bits), d, chunk, topk_part, &job);
done:
    PyBuffer_Release(&e);
    if (x.obj) PyBuffer_Release(&x);
    if (t.obj) PyBuffer_Release(&t);
    if (p.obj) PyBuffer_Release(&p);
    return result;
}

static PyObject *py_topk_decode(PyObject *self, PyObject *args) {
    PyObject *po, *oo, *to;
    Py_ssize_t rows, chunk, k;
    int bits, index_bits, add, threads;
    double divisor;
    Py_buffer p = {0}, o = {0}, t = {0};
    (void)self;
    if (!PyArg_ParseTuple(args, "OnOnniiOpdi", &po, &rows, &oo, &chunk, &k, &bits, &index_bits, &to, &add, &divisor, &threads))
        return NULL;
    if (get_floats(oo, &o, 1, -1, "topk: out") < 0) return NULL;
    PyObject *result = NULL;
    const Py_ssize_t d = o.len / 4;
    Py_ssize_t indices_at, values_at;
    if (get_table(to, &t, bits) < 0) goto done;
    if (PyObject_GetBuffer(po, &p, PyBUF_C_CONTIGUOUS) < 0) goto done;
    if (d < 1 || rows < 1 || chunk < 1 || k < 1 || k > chunk || index_bits < 1 || index_bits > 24) {
        PyErr_SetString(PyExc_ValueError, "topk: bad rows, chunk, k or index bits");
        goto done;
    }
    const Py_ssize_t nbytes = topk_layout(d, chunk, k, bits, index_bits, &indices_at, &values_at);
    if (p.len != rows * nbytes) {
        PyErr_SetString(PyExc_ValueError, "topk: the payloads' size is not rows times the codec's");
        goto done;
    }
    topk_decode_job job = {add, bits, index_bits, d, chunk, k, rows, nbytes, indices_at, values_at, (const unsigned char *)p.buf,
                           (const float *)t.buf, (float *)o.buf, (float)divisor};
    result = run_parts(threads, d, chunk, topk_decode_part, &job);
done:
    PyBuffer_Release(&o);
    if (t.obj) PyBuffer_Release(&t);
    if (p.obj) PyBuffer_Release(&p);
    return result;
}

static PyMethodDef methods[] = {
    {"encode", py_encode, METH_VARARGS,
     "encode(kind, e, x, beta, payload, chunk, feedback, threads) -> None\n\n"
     "kind 0 int8, 1 int4, 2 fp4, 3 sign, 5 bf16 (float32 in).  Unless x is None, first e = e * beta + x\n"
     "(beta 1: e + x) in place; then e's payload into payload; with feedback, e = e - decode(payload)."},
    {"decode", py_decode, METH_VARARGS,
     "decode(kind, payloads, rows, out, chunk, add, divisor, threads) -> None\n\n"
     "out (float32) = the sum of the rows' decoded vectors in row order (add: out + that sum), divided\n"
     "by divisor unless it is 1; kind as encode's, 4 none."},
    {"topk_encode", py_topk_encode, METH_VARARGS,
     "topk_encode(e, x, beta, payload, chunk, k, bits, index_bits, low, spacing, table, feedback, threads) -> None\n\n"
     "encode's fold and feedback around mpiopt.codecs.TopkCodec's payload: the k largest |e| of every chunk\n"
     "(ties to the lowest index, NaN last), levels low + i * spacing of the mean |value|, table the decoded\n"
     "values in units of the scale."},
    {"topk_decode", py_topk_decode, METH_VARARGS,
     "topk_decode(payloads, rows, out, chunk, k, bits, index_bits, table, add, divisor, threads) -> None\n\n"
     "decode's sum of rows in order for TopkCodec payloads (a zero vector plus each row's entries)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_codecsc", "Fused CPU loops of mpiopt.codecs' dense codecs.", -1, methods, NULL, NULL, NULL, NULL,
};

/* VERSION changes with the functions' arguments, so that mpiopt.codecs can refuse a stale build. */
PyMODINIT_FUNC PyInit__codecsc(void) {
    fill_tables();
#ifdef GATHER512
    __builtin_cpu_init();
    use_gather512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("popcnt");
#endif
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddIntConstant(m, "VERSION", 1) < 0) Py_CLEAR(m);
    return m;
}
