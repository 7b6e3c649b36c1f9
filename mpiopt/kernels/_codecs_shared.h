/* What the source files of mpiopt.kernels._codecsc share (private: compiled into that one module, never
 * installed as a header): the codec kinds, the chunk loops' attributes and the float helpers they inline,
 * the argument helpers in _codecsc.c, and the Python functions each file defines for the method table in
 * _codecsc.c.  _cloops.h brings Python.h, the IEEE build checks and the parallel for (_parallel.h).
 */
#ifndef MPIOPT_CODECSC_H
#define MPIOPT_CODECSC_H

#include "_cloops.h"

#include <math.h>

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

/* E3M0's value of code q in units of the scale, from the bits: 2**(index - 7), 0 for index 0, sign bit 8. */
static inline float e3m0(uint32_t q) {
    const uint32_t index = q & 7;
    return float_of((index ? (index + 120) << 23 : 0) | (q & 8) << 28);
}

/* +1.0f for bit 1, -1.0f for bit 0. */
static inline float unit(uint32_t bit) { return float_of(0x3f800000u | (~bit & 1u) << 31); }

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

/* The functions below link the module's files together; hidden, so that the shared object exports
 * PyInit__codecsc alone and the names cannot clash with another library's. */
#if defined(__GNUC__)
#define MPIOPT_CODECS_PRIVATE __attribute__((visibility("hidden")))
#else
#define MPIOPT_CODECS_PRIVATE
#endif

/* _codecsc.c: what the Python functions share (threads, buffers, the dense payload's layout) */
MPIOPT_CODECS_PRIVATE PyObject *mpiopt_codecs_run_parts(int threads, Py_ssize_t d, Py_ssize_t align, mpiopt_part_fn fn, void *job);
MPIOPT_CODECS_PRIVATE int mpiopt_codecs_get_floats(PyObject *o, Py_buffer *view, int writable, Py_ssize_t d, const char *what);
MPIOPT_CODECS_PRIVATE Py_ssize_t mpiopt_codecs_payload_layout(int kind, Py_ssize_t d, Py_ssize_t chunk, Py_ssize_t *values_at);
MPIOPT_CODECS_PRIVATE int mpiopt_codecs_check_kind(int kind, Py_ssize_t chunk);

/* _codecs_dense_encode.c: the dense codecs' encode (fold, scale, codes, feedback; bf16's rounding) */
MPIOPT_CODECS_PRIVATE PyObject *mpiopt_codecs_encode(PyObject *self, PyObject *args);

/* _codecs_dense_decode.c: the dense codecs' decode-sum, and sign's table of +-1.0f (filled at import) */
MPIOPT_CODECS_PRIVATE void mpiopt_codecs_fill_tables(void);
MPIOPT_CODECS_PRIVATE PyObject *mpiopt_codecs_decode(PyObject *self, PyObject *args);

/* _codecs_topk.c: topk's encode (selection, levels, bit fields) and decode-sum */
MPIOPT_CODECS_PRIVATE PyObject *mpiopt_codecs_topk_encode(PyObject *self, PyObject *args);
MPIOPT_CODECS_PRIVATE PyObject *mpiopt_codecs_topk_decode(PyObject *self, PyObject *args);

/* _codecs_topk.c's candidates with AVX-512 (gather512) where gcc builds it; PyInit sets the flag where the
 * CPU has it. */
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11 && defined(__x86_64__) && defined(__linux__)
#define GATHER512 1
MPIOPT_CODECS_PRIVATE extern int mpiopt_codecs_use_gather512;
#endif

#endif
