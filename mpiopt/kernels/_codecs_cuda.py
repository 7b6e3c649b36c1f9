"""``_codecs_topk.c`` for cupy arrays: the ``topk`` codec's encode (fold, per-chunk selection, levels, bit fields and
feedback) and its decode-sum, one CUDA kernel each, one block a chunk.

The C loops' bits, but for a NaN's payload and sign (the GPU's arithmetic returns its canonical NaN, x86 a negative
one), which reach the payload only in a chunk whose scale is NaN, whose every value decodes to NaN either way.  The C loops are the
twin the CPU suite runs against the array code; tests/unit/test_codecs.py compares the two on a lent GPU.
"""

from __future__ import annotations

from typing import Any, Tuple

import numpy as np

from ..arrays import array_module
from . import _cuda
from ._backend import cached
from .sparse.device import BLOCK_SELECT, MAX_CHUNK

__all__ = ["TOPK", "MAX_SENT", "takes_topk", "topk_encode", "topk_decode"]

#: The most entries a chunk sends on this path: its selection, magnitudes and bit fields stay in shared memory.
MAX_SENT = 1024
_MAX_INDEX_BITS = 24  # as the C loops: a field and its offset in a byte fit 32 bits

_SOURCE = BLOCK_SELECT + r"""
#define MAX_SENT 1024

/* numpy's pairwise float64 sum, as _codecs_topk.c's pairwise. */
__device__ double pairwise_(const double *a, int n) {
    if (n < 8) {
        double res = 0.;
        for (int i = 0; i < n; ++i) res = add_(res, a[i]);
        return res;
    }
    if (n <= 128) {
        double r[8];
        for (int q = 0; q < 8; ++q) r[q] = a[q];
        int i;
        for (i = 8; i < n - (n % 8); i += 8)
            for (int q = 0; q < 8; ++q) r[q] = add_(r[q], a[i + q]);
        double res = add_(add_(add_(r[0], r[1]), add_(r[2], r[3])), add_(add_(r[4], r[5]), add_(r[6], r[7])));
        for (; i < n; ++i) res = add_(res, a[i]);
        return res;
    }
    int n2 = n / 2;
    n2 -= n2 % 8;
    return add_(pairwise_(a, n2), pairwise_(a + n2, n - n2));
}

/* Field i of w bits OR-ed into zeroed shared words (fields end to end from bit 0, little-endian). */
__device__ __forceinline__ void put_field_(unsigned *words, int i, int w, unsigned value) {
    const int pos = i * w;
    const unsigned long long t = (unsigned long long)value << (pos & 31);
    atomicOr(&words[pos >> 5], (unsigned)t);
    if (t >> 32) atomicOr(&words[(pos >> 5) + 1], (unsigned)(t >> 32));
}

/* Field j of w bits (w <= 24) of a section, as _codecs_topk.c's get_field. */
__device__ __forceinline__ unsigned get_field_(const unsigned char *p, long long j, int w) {
    const long long pos = j * w, last = (pos + w - 1) >> 3;
    unsigned long long t = 0;
    for (long long b = last; b >= pos >> 3; --b) t = t << 8 | p[b];
    return (unsigned)(t >> (pos & 7)) & ((1u << w) - 1);
}

/* Bytes [0, nbytes) of the shared words to p, the block's threads a byte each. */
__device__ __forceinline__ void store_bytes_(unsigned char *p, const unsigned *words, int nbytes) {
    for (int b = threadIdx.x; b < nbytes; b += blockDim.x) p[b] = (unsigned char)(words[b >> 2] >> (8 * (b & 3)));
}

/* _codecs_topk.c's topk_chunk, chunk c = blockIdx.x (at most blockDim.x * ITEMS entries, thread t's from t * per):
 * e = e * beta + x (fold 2) or e + x (fold 1); the kk = min(n, k) largest |e|, ties to the lowest index, NaN last;
 * their scale (the pairwise mean of |value| in float64, as float32), level codes and sign bits; e -= the decoded
 * values (feedback).  Every chunk's fields start on a byte (k * bits and k * index_bits multiples of 8), so a block
 * writes its own bytes of each section. */
__global__ void topk_encode(long long d, int chunk, int k, int fold, int feedback, float beta, float *e, const float *x,
                            int bits, int index_bits, double low, double spacing, const float *table,
                            unsigned char *scales, unsigned char *indices, unsigned char *values) {
    __shared__ int picked[MAX_SENT];
    __shared__ float sent[MAX_SENT];
    __shared__ double magnitudes[MAX_SENT];
    __shared__ unsigned index_words[MAX_SENT * 24 / 32 + 2], value_words[MAX_SENT * 8 / 32 + 2];
    __shared__ float scale;
    const long long c = blockIdx.x, c0 = c * chunk;
    const int n = (int)min((long long)chunk, d - c0), kk = min(n, k);
    const int per = (chunk + blockDim.x - 1) / blockDim.x, first = threadIdx.x * per;
    const int mine = max(0, min(per, n - first));
    const int index_bytes = (kk * index_bits + 7) / 8, value_bytes = (kk * bits + 7) / 8;
    for (int i = threadIdx.x; i < (index_bytes + 3) / 4 + 1; i += blockDim.x) index_words[i] = 0;
    for (int i = threadIdx.x; i < (value_bytes + 3) / 4 + 1; i += blockDim.x) value_words[i] = 0;
    float v[ITEMS];
    unsigned keys[ITEMS];
#pragma unroll
    for (int q = 0; q < ITEMS; ++q) {
        v[q] = 0.0f;
        keys[q] = 0;
        if (q < mine) {
            const long long i = c0 + first + q;
            float y = e[i];
            if (fold == 2) y = add_(mul_(y, beta), x[i]);
            else if (fold == 1) y = add_(y, x[i]);
            if (fold) e[i] = y;
            v[q] = y;
            keys[q] = key_(y);
        }
    }
    int ties;
    const unsigned kth = kth_key_<unsigned>(keys, mine, kk, &ties);
    bool keep[ITEMS];
    int at = kept_<unsigned>(keys, mine, kth, ties, keep);
#pragma unroll
    for (int q = 0; q < ITEMS; ++q)
        if (keep[q]) {
            picked[at] = first + q;
            sent[at] = v[q];
            ++at;
        }
    __syncthreads();
    for (int i = threadIdx.x; i < kk; i += blockDim.x) magnitudes[i] = fabs(widen_(sent[i]));
    __syncthreads();
    if (threadIdx.x == 0) {
        const float s = narrow_(div_(pairwise_(magnitudes, kk), (double)kk));
        const unsigned u = __float_as_uint(s);
        for (int b = 0; b < 4; ++b) scales[4 * c + b] = (unsigned char)(u >> (8 * b));
        scale = s;
    }
    __syncthreads();
    const float s = scale;
    /* s == 0 read from the bits: under -ftz a subnormal s would compare equal to 0 */
    const double unit = (__float_as_uint(s) & 0x7fffffffu) == 0 ? 1.0 : widen_(s), last = (double)((1 << (bits - 1)) - 1);
    for (int i = threadIdx.x; i < kk; i += blockDim.x) {
        /* the nearest level: clip, then rint (half to even by 2**52); NaN -> 0, as nan_to_num */
        double r = div_(sub_(div_(magnitudes[i], unit), low), spacing);
        r = r > last ? last : r;
        r = r < 0.0 ? 0.0 : r;
        const unsigned code = (unsigned)(r == r ? sub_(add_(r, 0x1p52), 0x1p52) : 0.0) | (__float_as_uint(sent[i]) >> 31) << (bits - 1);
        if (feedback) e[c0 + picked[i]] = sub_(sent[i], mul_(table[code], s));
        put_field_(value_words, i, bits, code);
        put_field_(index_words, i, index_bits, (unsigned)picked[i]);
    }
    __syncthreads();
    store_bytes_(indices + c * k * index_bits / 8, index_words, index_bytes);
    store_bytes_(values + c * k * bits / 8, value_words, value_bytes);
}

/* _codecs_topk.c's topk_decode_part, chunk c = blockIdx.x: out = (+0.0, or out with add) + every row's decoded values
 * in row order (a row's indices are distinct: its adds run in parallel), then / divisor (correctly rounded, as the
 * C loop's product by an exact reciprocal or its quotient); with use_counts, counts = each entry's senders (at least
 * 1) and out their mean instead, a float64 quotient rounded to float32. */
__global__ void topk_decode(long long d, int chunk, int k, int bits, int index_bits, long long rows, long long nbytes,
                            long long indices_at, long long values_at, const unsigned char *payloads, const float *table,
                            float *out, int add, float divisor, int use_counts, int *counts) {
    const long long c = blockIdx.x, c0 = c * chunk, j0 = c * k;
    const int n = (int)min((long long)chunk, d - c0), kk = min(n, k);
    float *o = out + c0;
    int *senders = counts + c0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        if (!add) o[i] = 0.0f;
        if (use_counts) senders[i] = 0;
    }
    __syncthreads();
    for (long long r = 0; r < rows; ++r) {
        const unsigned char *row = payloads + r * nbytes;
        const float s = __uint_as_float((unsigned)row[4 * c] | (unsigned)row[4 * c + 1] << 8 | (unsigned)row[4 * c + 2] << 16
                                        | (unsigned)row[4 * c + 3] << 24);
        for (int i = threadIdx.x; i < kk; i += blockDim.x) {
            const unsigned at = get_field_(row + indices_at, j0 + i, index_bits);
            const float value = mul_(table[get_field_(row + values_at, j0 + i, bits)], s);
            if (at < (unsigned)n) { /* a payload of this codec always holds at < n */
                o[at] = add_(o[at], value);
                if (use_counts) ++senders[at];
            }
        }
        __syncthreads();
    }
    if (use_counts)
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            senders[i] = max(senders[i], 1);
            o[i] = narrow_(div_(widen_(o[i]), (double)senders[i]));
        }
    else if (divisor != 1.0f)
        for (int i = threadIdx.x; i < n; i += blockDim.x) o[i] = div_(o[i], divisor);
}
"""

#: The topk codec's kernels (float32 only, as the C loops).
TOPK = _cuda.Program(_SOURCE, (), ("topk_encode", "topk_decode"))


def takes_topk(chunk: int, k: int, bits: int, index_bits: int, vectors: Tuple[Any, ...], payloads: Any) -> bool:
    """Whether the kernels encode or decode with these parameters: a chunk one block holds, at most :data:`MAX_SENT`
    sent, values of at most 8 bits (the shared value words' size), every chunk's fields on whole bytes, C-contiguous cupy float32 ``vectors`` and uint8 ``payloads``."""
    fits = chunk <= MAX_CHUNK and k <= MAX_SENT and bits <= 8 and index_bits <= _MAX_INDEX_BITS and (k * bits) % 8 == 0 and (k * index_bits) % 8 == 0
    typed = [(a, np.float32) for a in vectors] + [(payloads, np.uint8)]
    kinds = all(array_module(a) is not np and a.dtype == dtype and a.flags.c_contiguous for a, dtype in typed)
    return fits and kinds and _cuda.compiled(TOPK)


def _layout(d: int, chunk: int, k: int, bits: int, index_bits: int) -> Tuple[int, int, int]:
    """(indices' offset, values' offset, bytes) of a topk payload: scales, indices, values, as ``topk_layout`` in C."""
    count = d // chunk * k + min(d % chunk, k)
    indices_at = 4 * -(-d // chunk)
    values_at = indices_at + -(-count * index_bits // 8)
    return indices_at, values_at, values_at + -(-count * bits // 8)


def _table(table: np.ndarray) -> Any:
    import cupy

    return cached(cupy, ("topk_table", table.tobytes()), lambda: table)


def topk_encode(
    e: Any, x: Any, beta: float, payload: Any, chunk: int, k: int, bits: int, index_bits: int, low: float, spacing: float,
    table: np.ndarray, feedback: bool,
) -> bool:
    """``_codecsc.topk_encode`` on cupy arrays: False (nothing done) where :func:`takes_topk` says no."""
    if not takes_topk(chunk, k, bits, index_bits, (e,) if x is None else (e, x), payload):
        return False
    d = e.shape[0]
    indices_at, values_at, nbytes = _layout(d, chunk, k, bits, index_bits)
    if payload.shape != (nbytes,):
        raise ValueError(f"topk: payload of {payload.shape} bytes, the codec's is ({nbytes},)")
    fold = 0 if x is None else 2 if beta != 1.0 else 1
    args = (
        np.int64(d), np.int32(chunk), np.int32(k), np.int32(fold), np.int32(feedback), np.float32(beta), e, e if x is None else x,
        np.int32(bits), np.int32(index_bits), np.float64(low), np.float64(spacing), _table(table),
        payload, payload[indices_at:], payload[values_at:],
    )
    _cuda.launch(TOPK, "topk_encode", None, -(-d // chunk), args)
    return True


def topk_decode(
    payloads: Any, rows: int, out: Any, chunk: int, k: int, bits: int, index_bits: int, table: np.ndarray, add: bool, divisor: float,
    counts: Any = None,
) -> bool:
    """``_codecsc.topk_decode`` on cupy arrays (``payloads`` one row or ``rows`` of them; ``counts`` None or cupy
    int32): False where it cannot run."""
    if not takes_topk(chunk, k, bits, index_bits, (out,), payloads):
        return False
    if counts is not None and (array_module(counts) is np or counts.dtype != np.int32 or counts.shape != out.shape or not counts.flags.c_contiguous):
        return False
    if counts is not None and (add or divisor != 1.0):
        raise ValueError("topk: counts take neither add nor a divisor")
    d = out.shape[0]
    indices_at, values_at, nbytes = _layout(d, chunk, k, bits, index_bits)
    if payloads.size != rows * nbytes:
        raise ValueError(f"topk: {payloads.size} payload bytes, not {rows} rows of the codec's {nbytes}")
    args = (
        np.int64(d), np.int32(chunk), np.int32(k), np.int32(bits), np.int32(index_bits), np.int64(rows), np.int64(nbytes),
        np.int64(indices_at), np.int64(values_at), payloads, _table(table), out, np.int32(add), np.float32(divisor),
        np.int32(counts is not None), out if counts is None else counts,  # out stands in for counts, never written
    )
    _cuda.launch(TOPK, "topk_decode", None, -(-d // chunk), args)
    return True
