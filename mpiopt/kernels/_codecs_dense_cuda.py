"""``_codecs_dense_encode.c`` and ``_codecs_dense_decode.c`` for cupy arrays: the dense codecs' (``int8``, ``int4``,
``fp4``, ``sign``, ``none``, ``bf16``) encode, one block a chunk (the fold, the chunk's scale, codes and feedback), and
their decode-sum, one thread an entry (every row in order, then the division).

The C loops' bits, but for a NaN's payload and sign (the GPU's arithmetic returns its canonical NaN), and with no
comparison of a float that CuPy's ``-ftz`` could flush (signs and zero tests read the bits).  The C loops are the
twin the CPU suite runs against the array code; tests/unit/test_codecs.py compares the two on a lent GPU.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..arrays import array_module
from . import _cuda

__all__ = ["DENSE", "KINDS", "takes_dense", "dense_encode", "dense_decode"]

#: The codecs these kernels take, by the C loops' numbers.
KINDS = {"int8": 0, "int4": 1, "fp4": 2, "sign": 3, "none": 4, "bf16": 5}
_SIGN, _NONE, _BF16 = 3, 4, 5
# sign's chunk, at most: the leaves of numpy's pairwise sum (<= 128 entries, most >= 64) fit the shared table.
_MAX_SIGN_CHUNK = 8192

_SOURCE = _cuda.HELPERS + r"""
enum { INT8, INT4, FP4, SIGN, NONE, BF16 };
#define MAX_LEAVES 256

/* v < 0 as the C loops compare (NaN and -0.0 not), from the bits. */
__device__ __forceinline__ bool negative_(float v) { return !nonnegative_(v) && !nan_(v); }
/* A float32 at any byte address, little-endian. */
__device__ __forceinline__ float load_float_(const unsigned char *p) {
    return __uint_as_float((unsigned)p[0] | (unsigned)p[1] << 8 | (unsigned)p[2] << 16 | (unsigned)p[3] << 24);
}

/* A code's value in units of its chunk's scale: int8's and int4's integer, fp4's E3M0 (2**(index - 7), 0 for index 0,
 * sign bit 8), sign's +-1. */
__device__ __forceinline__ float unit_(int kind, unsigned q) {
    if (kind == INT8) return (float)(signed char)q;
    if (kind == INT4) return (float)((int)(q << 28) >> 28);
    if (kind == FP4) return __uint_as_float(((q & 7) ? ((q & 7) + 120) << 23 : 0u) | (q & 8) << 28);
    return __uint_as_float(0x3f800000u | (~q & 1u) << 31);
}

/* The code of v in a chunk of scale s (safe: s, or 1 where s is 0), as quantize_int, quantize_fp4, quantize_sign. */
__device__ __forceinline__ unsigned code_(int kind, float v, float safe) {
    if (kind == SIGN) return nonnegative_(v) ? 1u : 0u;
    if (kind == FP4) {
        const float t = div_(abs_(v), safe);
        int index = (int)((__float_as_uint(t) + 0x400000u) >> 23) - 120;
        index = min(max(index, 0), 7);
        index = max(index, __float_as_uint(t) >= 0x3c000000u && !nan_(t) ? 1 : 0); /* t >= 2**-7 */
        if (nan_(t) && !nan_(v) && !nan_(safe)) index = 0; /* inf / inf: x86's NaN, whose sign bit gives index 0 */
        return (unsigned)index | (negative_(v) ? 8u : 0u);
    }
    const float qmax = kind == INT8 ? 127.0f : 7.0f;
    float t = div_(v, safe);
    t = t > qmax ? qmax : t;
    t = t < -qmax ? -qmax : t;
    const float r = sub_(add_(abs_(t), 0x1p23f), 0x1p23f); /* rint, ties to even */
    const int k = nan_(t) ? 0 : (int)r;                           /* NaN: 0, as numpy's cast */
    return (unsigned)(negative_(t) ? -k : k) & 255u;
}

/* numpy's pairwise float64 sum of |a[0, n)| at a leaf of its tree (n <= 128), as pairwise_abs. */
__device__ double leaf_abs_(const float *a, int n) {
    if (n < 8) {
        double res = 0.;
        for (int i = 0; i < n; ++i) res = add_(res, fabs(widen_(a[i])));
        return res;
    }
    double r[8];
    for (int q = 0; q < 8; ++q) r[q] = fabs(widen_(a[q]));
    int i;
    for (i = 8; i < n - (n % 8); i += 8)
        for (int q = 0; q < 8; ++q) r[q] = add_(r[q], fabs(widen_(a[i + q])));
    double res = add_(add_(add_(r[0], r[1]), add_(r[2], r[3])), add_(add_(r[4], r[5]), add_(r[6], r[7])));
    for (; i < n; ++i) res = add_(res, fabs(widen_(a[i])));
    return res;
}

/* The leaves of that tree over [start, start + n), in order. */
__device__ void leaves_(int start, int n, int *starts, int *lengths, int *count) {
    if (n <= 128) {
        starts[*count] = start;
        lengths[*count] = n;
        ++*count;
        return;
    }
    int n2 = n / 2;
    n2 -= n2 % 8;
    leaves_(start, n2, starts, lengths, count);
    leaves_(start + n2, n - n2, starts, lengths, count);
}

/* The tree's sum from its leaves' sums (taken in order from *next). */
__device__ double combine_(int n, const double *sums, int *next) {
    if (n <= 128) return sums[(*next)++];
    int n2 = n / 2;
    n2 -= n2 % 8;
    const double a = combine_(n2, sums, next);
    return add_(a, combine_(n - n2, sums, next));
}

/* encode_chunk, chunk c = blockIdx.x: e = e * beta + x (fold 2) or e + x (fold 1); the chunk's scale (absmax by the
 * bits, / 127 or / 7 in float64 for the integers; sign's pairwise mean of |e|), its codes, a byte per thread visit, and
 * with feedback e -= the decoded value. */
__global__ void dense_encode(long long d, int kind, int chunk, int fold, int feedback, float beta, float *e, const float *x,
                             unsigned char *scales, unsigned char *values) {
    __shared__ int top, count, starts[MAX_LEAVES], lengths[MAX_LEAVES];
    __shared__ double sums[MAX_LEAVES];
    __shared__ float scale;
    const long long c = blockIdx.x, c0 = c * chunk;
    const int n = (int)min((long long)chunk, d - c0);
    float *ec = e + c0;
    if (threadIdx.x == 0) top = 0;
    __syncthreads();
    int mine = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float y = ec[i];
        if (fold == 2) y = add_(mul_(y, beta), x[c0 + i]);
        else if (fold == 1) y = add_(y, x[c0 + i]);
        if (fold) ec[i] = y;
        mine = max(mine, (int)(__float_as_uint(y) & 0x7fffffffu)); /* NaN's bits are above inf's */
    }
    if (kind == SIGN) {
        __syncthreads(); /* the folded chunk, read by other threads below */
        if (threadIdx.x == 0) {
            count = 0;
            leaves_(0, n, starts, lengths, &count);
        }
        __syncthreads();
        for (int l = threadIdx.x; l < count; l += blockDim.x) sums[l] = leaf_abs_(ec + starts[l], lengths[l]);
        __syncthreads();
        if (threadIdx.x == 0) {
            int next = 0;
            scale = narrow_(div_(combine_(n, sums, &next), (double)n));
        }
    } else {
        atomicMax(&top, mine);
        __syncthreads();
        if (threadIdx.x == 0) {
            const float absmax = __int_as_float(top);
            scale = kind == FP4 ? absmax : narrow_(div_(widen_(absmax), kind == INT8 ? 127.0 : 7.0));
        }
    }
    __syncthreads();
    const float s = scale;
    if (threadIdx.x < 4) scales[4 * c + threadIdx.x] = (unsigned char)(__float_as_uint(s) >> (8 * threadIdx.x));
    const float safe = (__float_as_uint(s) & 0x7fffffffu) == 0 ? 1.0f : s;
    const int per = kind == INT8 ? 1 : kind == SIGN ? 8 : 2;
    unsigned char *out = values + c0 / per;
    for (int b = threadIdx.x; b < (n + per - 1) / per; b += blockDim.x) {
        unsigned byte = 0;
        for (int g = 0; g < per && b * per + g < n; ++g) {
            const int i = b * per + g;
            const float v = ec[i];
            const unsigned q = code_(kind, v, safe);
            if (feedback) ec[i] = sub_(v, kind == SIGN && nan_(s) ? s : mul_(unit_(kind, q), s));
            byte |= kind == INT8 ? q : kind == SIGN ? q << g : (q & 15u) << (4 * g);
        }
        out[b] = (unsigned char)byte;
    }
}

/* bf16's round to nearest even on the float32 bits; NaN -> 0x7FC0. */
__global__ void bf16_encode(long long d, const float *x, unsigned char *out) {
    FOR_EACH(i, d) {
        const unsigned b = __float_as_uint(x[i]);
        const unsigned r = nan_(x[i]) ? 0x7FC0u : ((((b >> 16) & 1u) + 0x7FFFu + b) >> 16) & 0xFFFFu;
        out[2 * i] = (unsigned char)r;
        out[2 * i + 1] = (unsigned char)(r >> 8);
    }
}

/* decode_chunk, entry by entry: out = (out with add, else the first row's value) + every row's decoded value in row
 * order, then / divisor (correctly rounded, as the C loop's quotient or product by an exact reciprocal). */
__global__ void dense_decode(long long d, int kind, int chunk, long long rows, long long nbytes, long long values_at,
                             const unsigned char *payloads, float *out, int add, float divisor) {
    FOR_EACH(i, d) {
        float o = add ? out[i] : 0.0f;
        for (long long r = 0; r < rows; ++r) {
            const unsigned char *row = payloads + r * nbytes;
            float v;
            if (kind == NONE) {
                v = load_float_(row + 4 * i);
            } else if (kind == BF16) {
                v = __uint_as_float(((unsigned)row[2 * i] | (unsigned)row[2 * i + 1] << 8) << 16);
            } else {
                const unsigned char *q = row + values_at;
                const unsigned code = kind == INT8 ? q[i] : kind == SIGN ? (q[i >> 3] >> (i & 7)) & 1u : (q[i >> 1] >> (4 * (i & 1))) & 15u;
                v = mul_(unit_(kind, code), load_float_(row + 4 * (i / chunk)));
            }
            o = r == 0 && !add ? v : add_(o, v);
        }
        out[i] = divisor != 1.0f ? div_(o, divisor) : o;
    }
}
"""

#: The dense codecs' kernels (float32 only, as the C loops).
DENSE = _cuda.Program(_SOURCE, (), ("dense_encode", "bf16_encode", "dense_decode"))


def takes_dense(kind: int, chunk: int, vectors: tuple, payloads: Any) -> bool:
    """Whether the kernels take codec ``kind`` with this chunk (nibbles: even; sign: a multiple of 8, at most 8192) on
    C-contiguous cupy float32 ``vectors`` and uint8 ``payloads``."""
    fits = kind in KINDS.values() and (kind not in (1, 2) or chunk % 2 == 0) and (kind != _SIGN or (chunk % 8 == 0 and chunk <= _MAX_SIGN_CHUNK))
    typed = [(a, np.float32) for a in vectors] + [(payloads, np.uint8)]
    kinds = all(array_module(a) is not np and a.dtype == dtype and a.flags.c_contiguous for a, dtype in typed)
    return fits and kinds and _cuda.compiled(DENSE)


def _layout(kind: int, d: int, chunk: int) -> tuple:
    """(values' offset, bytes) of a payload, as ``mpiopt_codecs_payload_layout``."""
    values_at = 4 * -(-d // chunk) if kind < _NONE else 0
    return values_at, values_at + (d, -(-d // 2), -(-d // 2), -(-d // 8), 4 * d, 2 * d)[kind]


def dense_encode(kind: int, e: Any, x: Any, beta: float, payload: Any, chunk: int, feedback: bool) -> bool:
    """``_codecsc.encode`` on cupy arrays (not ``none``, a copy; ``bf16`` neither folds nor feeds back): False (nothing
    done) where :func:`takes_dense` says no."""
    if kind == _NONE or not takes_dense(kind, chunk, (e,) if x is None else (e, x), payload):
        return False
    d = e.shape[0]
    values_at, nbytes = _layout(kind, d, chunk)
    if payload.shape != (nbytes,):
        raise ValueError(f"codec {kind}: payload of {payload.shape} bytes, the codec's is ({nbytes},)")
    if kind == _BF16:
        _cuda.launch(DENSE, "bf16_encode", None, -(-d // _cuda.THREADS), (np.int64(d), e, payload))
        return True
    fold = 0 if x is None else 2 if beta != 1.0 else 1
    args = (np.int64(d), np.int32(kind), np.int32(chunk), np.int32(fold), np.int32(feedback), np.float32(beta), e,
            e if x is None else x, payload, payload[values_at:])
    _cuda.launch(DENSE, "dense_encode", None, -(-d // chunk), args)
    return True


def dense_decode(kind: int, payloads: Any, rows: int, out: Any, chunk: int, add: bool, divisor: float) -> bool:
    """``_codecsc.decode`` on cupy arrays (``payloads`` one row or ``rows`` of them): False where it cannot run."""
    if not takes_dense(kind, chunk, (out,), payloads):
        return False
    d = out.shape[0]
    values_at, nbytes = _layout(kind, d, chunk)
    if rows < 1 or payloads.size != rows * nbytes:
        raise ValueError(f"codec {kind}: {payloads.size} payload bytes, not {rows} rows of the codec's {nbytes}")
    args = (np.int64(d), np.int32(kind), np.int32(chunk), np.int64(rows), np.int64(nbytes), np.int64(values_at), payloads, out,
            np.int32(add), np.float32(divisor))
    _cuda.launch(DENSE, "dense_decode", None, -(-d // _cuda.THREADS), args)
    return True
