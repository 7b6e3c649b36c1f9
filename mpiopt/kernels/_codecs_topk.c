/* mpiopt.kernels._codecsc's topk (mpiopt.codecs.TopkCodec): per chunk the k largest |e| (ties to the lowest
 * index, NaN below every number) by a radix select on the float bits over the candidates near the last
 * chunk's threshold (SSE2, or AVX-512 where the CPU has it), their b-bit levels of the mean |value| and the
 * payload's bit fields, with encode's fold and feedback; and the decode-sum of topk payloads in row order.
 */
#include "_codecs_shared.h"

#include <stdlib.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

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

#ifdef GATHER512
#include <immintrin.h>
/* gather with AVX-512 where the CPU has it (PyInit decides): a compare and a compress per 16 keys. */
int mpiopt_codecs_use_gather512;

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
        if (mpiopt_codecs_use_gather512)
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
    int32_t *counts; /* NULL, or each entry's senders: then out is their mean (SparseLoCo's) */
} topk_decode_job;

static void topk_decode_part(void *ctx, Py_ssize_t lo, Py_ssize_t hi, int part) {
    const topk_decode_job *j = (const topk_decode_job *)ctx;
    (void)part;
    for (Py_ssize_t c0 = lo; c0 < hi; c0 += j->chunk) {
        const Py_ssize_t n = hi - c0 < j->chunk ? hi - c0 : j->chunk, kk = n < j->k ? n : j->k;
        const Py_ssize_t c = c0 / j->chunk, j0 = c * j->k;
        float *restrict o = j->out + c0;
        int32_t *restrict counts = j->counts ? j->counts + c0 : NULL;
        if (!j->add) memset(o, 0, n * sizeof(float)); /* +0.0, then each row added: numpy's zeros and scatter_add */
        if (counts) memset(counts, 0, n * sizeof(int32_t));
        for (Py_ssize_t r = 0; r < j->rows; ++r) {
            const unsigned char *row = j->payloads + r * j->nbytes;
            float s;
            memcpy(&s, row + 4 * c, 4);
            for (Py_ssize_t i = 0; i < kk; ++i) {
                const uint32_t at = get_field(row + j->indices_at, j0 + i, j->index_bits);
                const float v = j->table[get_field(row + j->values_at, j0 + i, j->bits)] * s;
                o[at] = add(o[at], v);
                if (counts) counts[at]++;
            }
        }
        if (counts) /* numpy's counts = max(counts, 1); out /= counts: a float64 quotient, rounded to float32 */
            for (Py_ssize_t i = 0; i < n; ++i) {
                counts[i] = counts[i] > 1 ? counts[i] : 1;
                o[i] = (float)((double)o[i] / (double)counts[i]);
            }
        else if (j->divisor != 1.0f)
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

PyObject *mpiopt_codecs_topk_encode(PyObject *self, PyObject *args) {
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
    if (mpiopt_codecs_get_floats(eo, &e, fold || feedback, -1, "topk: e") < 0) return NULL;
    PyObject *result = NULL;
    const Py_ssize_t d = e.len / 4;
    Py_ssize_t indices_at, values_at;
    if (fold && mpiopt_codecs_get_floats(xo, &x, 0, d, "topk: x") < 0) goto done;
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
    result = mpiopt_codecs_run_parts(topk_threads(threads, k, bits, index_bits), d, chunk, topk_part, &job);
done:
    PyBuffer_Release(&e);
    if (x.obj) PyBuffer_Release(&x);
    if (t.obj) PyBuffer_Release(&t);
    if (p.obj) PyBuffer_Release(&p);
    return result;
}

PyObject *mpiopt_codecs_topk_decode(PyObject *self, PyObject *args) {
    PyObject *po, *oo, *to, *co;
    Py_ssize_t rows, chunk, k;
    int bits, index_bits, add, threads;
    double divisor;
    Py_buffer p = {0}, o = {0}, t = {0}, cnt = {0};
    (void)self;
    if (!PyArg_ParseTuple(args, "OnOnniiOpdOi", &po, &rows, &oo, &chunk, &k, &bits, &index_bits, &to, &add, &divisor, &co,
                          &threads))
        return NULL;
    if (mpiopt_codecs_get_floats(oo, &o, 1, -1, "topk: out") < 0) return NULL;
    PyObject *result = NULL;
    const Py_ssize_t d = o.len / 4;
    Py_ssize_t indices_at, values_at;
    if (co != Py_None) {
        if (PyObject_GetBuffer(co, &cnt, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) goto done;
        if (cnt.len != 4 * d) { /* the caller (mpiopt.codecs.fused) passes int32 */
            PyErr_SetString(PyExc_ValueError, "topk: counts must be d writable 4-byte integers, C-contiguous");
            goto done;
        }
        if (add || divisor != 1.0) {
            PyErr_SetString(PyExc_ValueError, "topk: counts take neither add nor a divisor");
            goto done;
        }
    }
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
                           (const float *)t.buf, (float *)o.buf, (float)divisor, cnt.obj ? (int32_t *)cnt.buf : NULL};
    result = mpiopt_codecs_run_parts(threads, d, chunk, topk_decode_part, &job);
done:
    if (cnt.obj) PyBuffer_Release(&cnt);
    PyBuffer_Release(&o);
    if (t.obj) PyBuffer_Release(&t);
    if (p.obj) PyBuffer_Release(&p);
    return result;
}
