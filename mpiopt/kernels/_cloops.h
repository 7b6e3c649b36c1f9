/* What the C loop modules (_signsc.c, _sparsec.c, _updatec.c) share: the build checks that keep
 * numpy's bits, unaligned 64-bit words, and the parallel for (_parallel.h).
 *
 * The float loops round every product and sum to the dtype on its own, as numpy's passes do: that
 * needs IEEE single/double arithmetic without excess precision and without a*b+c contracted into a
 * fused multiply-add.  setup.py builds with -ffp-contract=off, and the checks below refuse a build
 * whose arithmetic could differ (the build is optional: without it mpiopt uses the numpy code).
 * Buffers come through the buffer protocol, so building needs no numpy headers.
 */
#ifndef MPIOPT_CLOOPS_H
#define MPIOPT_CLOOPS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <float.h>
#include <stdint.h>
#include <string.h>

#include "_parallel.h"

#if defined(__FAST_MATH__)
#error "mpiopt's C loops need IEEE arithmetic: build without -ffast-math / -Ofast"
#endif
#if !defined(FLT_EVAL_METHOD) || FLT_EVAL_METHOD != 0
#error "mpiopt's C loops need float and double evaluated in their own precision (FLT_EVAL_METHOD == 0)"
#endif

/* A 64-bit word at any byte address (rows of ceil(d/8) bytes need not be word-aligned). */
static inline uint64_t load64(const unsigned char *p) {
    uint64_t x;
    memcpy(&x, p, sizeof x);
    return x;
}

static inline void store64(unsigned char *p, uint64_t x) { memcpy(p, &x, sizeof x); }

#endif
