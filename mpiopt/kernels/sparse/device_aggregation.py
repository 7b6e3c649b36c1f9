"""The aggregation of P Top-k payloads on the GPU: ``G = (1/N) sum_n sent_n`` as P + 2 kernels and one wait.

The array code (:func:`~mpiopt.kernels.sparse.aggregate_payloads` on cupy) checks each row's indices (three waits a
row), scatter-adds a row in three launches, sorts the rows' union and divides and updates through fancy indexing.
Here: the last call's entries are zeroed, each row is added in rank order by one kernel (its indices are unique:
no two threads meet), which also marks, in a bitmap, whether an earlier row sent the entry; a last kernel divides
``G`` and updates the parameters at each entry's first sender and clears the marks.  Bitmap payloads (k > d / 32)
are decoded first, every row at once: two kernels over the bitmaps' words and a running count between them, the
C loops' ``bitmap_indices`` in order.  The same floats as the array code; the rows' bad headers, bitmaps and
indices are found by the kernels and reported after the last one (the one wait: the headers are not read first),
the parameters then left as they were.  Rows are read at any alignment (a bitmap row's length is any number of bytes).
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from .. import _cuda
from .._backend import C_FLOATS
from .device import BLOCK_SELECT
from .payload import encoded_nbytes, payload_format, payload_header

__all__ = ["AGGREGATE", "DeviceAggregation"]

_SOURCE = BLOCK_SELECT + r"""
/* The U (unsigned or unsigned long long) whose little-endian bytes start at p, at any alignment. */
template <typename U> __device__ __forceinline__ U bytes_(const unsigned char *p) {
    U u = 0;
#pragma unroll
    for (int b = 0; b < (int)sizeof(U); ++b) u |= (U)p[b] << (8 * b);
    return u;
}
__device__ __forceinline__ float from_bits_(unsigned u) { return __uint_as_float(u); }
__device__ __forceinline__ double from_bits_(unsigned long long u) { return __longlong_as_double((long long)u); }

/* Word w of a bitmap of d bits (bit i at byte i / 8, bit i % 8), its bits from d on cleared (the array code reads d). */
__device__ __forceinline__ unsigned bitmap_word_(const unsigned char *bitmap, long long w, long long d) {
    unsigned word = 0;
#pragma unroll
    for (int b = 0; b < 4; ++b)
        if (8 * (4 * w + b) < d) word |= (unsigned)bitmap[4 * w + b] << (8 * b);
    const long long rest = d - 32 * w;
    return rest >= 32 ? word : rest > 0 ? word & ((1u << rest) - 1u) : 0u;
}

/* A bitmap's decode, pass 1, block b = row * tiles + tile: counts[b] = the set bits in the row's words
 * [tile * blockDim.x, (tile + 1) * blockDim.x), a word a thread; the row's bitmap starts at byte `offset`. */
__global__ void bitmap_count(long long d, int tiles, long long row_bytes, long long offset, const unsigned char *payloads,
                             int *counts) {
    const long long row = blockIdx.x / tiles, w = (long long)(blockIdx.x % tiles) * blockDim.x + threadIdx.x;
    int total;
    block_scan_(__popc(bitmap_word_(payloads + row * row_bytes + offset, w, d)), &total);
    if (threadIdx.x == 0) counts[blockIdx.x] = total;
}

/* Pass 2: the set bits' positions, ascending, into decoded[row * k + j] for j from ends[b] - counts[b] on, below k
 * (ends: each row's running sum of its tiles' counts; add_row checks its last against k). */
__global__ void bitmap_write(long long d, int k, int tiles, long long row_bytes, long long offset,
                             const unsigned char *payloads, const int *counts, const int *ends, int *decoded) {
    if (counts[blockIdx.x] == 0) return; /* the whole block: nothing to write */
    const long long row = blockIdx.x / tiles, w = (long long)(blockIdx.x % tiles) * blockDim.x + threadIdx.x;
    unsigned word = bitmap_word_(payloads + row * row_bytes + offset, w, d);
    int total;
    long long at = (long long)ends[blockIdx.x] - counts[blockIdx.x] + block_scan_(__popc(word), &total);
    for (; word && at < k; word &= word - 1, ++at) decoded[row * k + at] = (int)(32 * w + __ffs(word) - 1);
}

/* The entries the last call's rows sent (duplicates among rows do no harm), zeroed. */
template <typename T>
__global__ void zero_sent(long long n, const int *sent, T *out) {
    FOR_EACH(i, n) out[sent[i]] = (T)0;
}

/* Row `row` of the payloads (row_bytes each: a header of 8 bytes, k values, then k int32 indices, or with bitmap
 * the indices decoded[row * k, +k) and the row's count ends[row * tiles + tiles - 1]): out[idx[i]] += v[i],
 * kept[i] = idx[i], and first[i] = whether no earlier row sent it (its bit in marks was clear).  A header other
 * than `expected`, a bitmap of another count, or indices not ascending or out of [0, d) (skipped) flag
 * bad = row + 1, unless an earlier row did. */
template <typename T>
__global__ void add_row(long long k, long long d, int row, long long row_bytes, const unsigned char *payloads,
                        const unsigned char *expected, int bitmap, const int *decoded, const int *ends, int tiles, T *out,
                        unsigned *marks, int *kept, unsigned char *first, int *bad) {
    typedef decltype(bits_((T)0)) U; /* T's bits as an unsigned integer */
    const unsigned char *header = payloads + row * row_bytes, *values = header + 8, *pairs = values + sizeof(T) * k;
    if (blockIdx.x == 0 && threadIdx.x < 8 && header[threadIdx.x] != expected[threadIdx.x]) atomicCAS(bad, 0, row + 1);
    if (bitmap && blockIdx.x == 0 && threadIdx.x == 0 && ends[(long long)row * tiles + tiles - 1] != k) atomicCAS(bad, 0, row + 1);
    const int *idx = bitmap ? decoded + row * k : (const int *)pairs;
    const bool aligned = (unsigned long long)values % sizeof(T) == 0, idx_aligned = bitmap || (unsigned long long)pairs % 4 == 0;
    FOR_EACH(i, k) {
        const int j = idx_aligned ? idx[i] : (int)bytes_<unsigned>(pairs + 4 * i);
        const int before = i == 0 ? -1 : idx_aligned ? idx[i - 1] : (int)bytes_<unsigned>(pairs + 4 * (i - 1));
        if (j < 0 || j >= d || before >= j) {
            atomicCAS(bad, 0, row + 1);
            kept[i] = 0;
            first[i] = 0;
            continue;
        }
        out[j] = add_(out[j], aligned ? ((const T *)values)[i] : from_bits_(bytes_<U>(values + sizeof(T) * i)));
        const unsigned bit = 1u << (j & 31);
        first[i] = !(atomicOr(&marks[j >> 5], bit) & bit);
        kept[i] = j;
    }
}

/* After every row, at each entry's first sender: G = sum / divisor (where divisor is not 1), params -= lr G (where
 * update, and no row was bad); the entry's marks cleared (the word's other entries have read theirs already). */
template <typename T>
__global__ void settle_rows(long long n, const int *kept, const unsigned char *first, T divisor, T lr, int update,
                            T *out, T *params, unsigned *marks, const int *bad) {
    const bool good = *bad == 0;
    FOR_EACH(i, n) {
        if (!first[i]) continue;
        const int j = kept[i];
        marks[j >> 5] = 0u;
        if (!good) continue;
        const T g = divisor != (T)1 ? div_(out[j], divisor) : out[j];
        out[j] = g;
        if (update) params[j] = sub_(params[j], mul_(lr, g));
    }
}
"""

AGGREGATE = _cuda.Program(_SOURCE, ("zero_sent", "add_row", "settle_rows"), ("bitmap_count", "bitmap_write"))


class DeviceAggregation:
    """Buffers for aggregating ``rows`` payloads of ``k`` entries of a length-``d`` vector on the GPU, made once.

    ``kept`` holds the last call's rows' indices (what :meth:`aggregate` returns as the entries ``G`` may be non-zero
    at, duplicates included), ``marks`` a bitmap of d bits that is all clear between calls; for bitmap payloads,
    ``decoded`` the rows' indices and ``counts``/``ends`` their tiles' counts.  Built by :meth:`create`.
    """

    def __init__(self, rows: int, k: int, d: int) -> None:
        import cupy

        self.rows, self.k, self.d = rows, k, d
        self.marks = cupy.zeros(-(-d // 32), np.uint32)
        self.kept = cupy.empty((rows, k), np.int32)
        self.first = cupy.empty((rows, k), np.uint8)
        self.bad = cupy.zeros(1, np.int32)
        #: What every row's header must be (the kernels check the rows' own against it).
        self.header = payload_header(k, d)
        self._expected = cupy.asarray(self.header)
        self.bitmap = payload_format(k, d) == "bitmap"
        # A tile a block of the decode: THREADS words of 32 bits.
        self.tiles = -(-d // (32 * _cuda.THREADS)) if self.bitmap else 1
        self.decoded = cupy.empty((rows, k), np.int32) if self.bitmap else self.kept  # (unread for pairs)
        self.counts = cupy.empty((rows, self.tiles), np.int32)
        self.ends = cupy.empty((rows, self.tiles), np.int32)
        self._marked = False  # True from a call's first kernel to its last, which clears every mark the call set

    @classmethod
    def create(cls, rows: int, k: int, d: int) -> Optional["DeviceAggregation"]:
        """Buffers on the current device, or None where the kernels do not compile."""
        return cls(rows, k, d) if _cuda.compiled(AGGREGATE) else None

    def takes(self, payloads: Any, out: Any, params: Optional[Any]) -> bool:
        """Whether :meth:`aggregate` runs on these payloads: ``rows`` device rows of :func:`encode`'s bytes for ``k`` of
        ``d`` entries in ``out``'s dtype, ``out`` (and ``params``) contiguous float32 or float64 vectors of length ``d``
        on the device."""
        arrays = [out] + ([] if params is None else [params])
        return (
            type(payloads) is type(self.kept) and payloads.ndim == 2 and payloads.flags.c_contiguous and out.dtype in C_FLOATS
            and payloads.shape == (self.rows, encoded_nbytes(self.k, self.d, out.dtype))
            and all(type(a) is type(self.kept) and a.flags.c_contiguous and a.dtype == out.dtype and a.shape == (self.d,) for a in arrays)
        )

    def aggregate(self, payloads: Any, out: Any, stale: Optional[Any], params: Optional[Any], lr: float) -> Any:
        """``out = (1/P) sum of the rows`` where sent (``stale``, or all of ``out`` for None, cleared first), and
        ``params -= lr out`` there when given; returns ``kept`` flattened.  ``ValueError`` naming the first row whose
        header is not :attr:`header`, whose bitmap marks another count than k or whose indices are not unique,
        ascending and in ``[0, d)`` (``params`` then unchanged)."""
        dtype, n, row_bytes = out.dtype, self.rows * self.k, np.int64(payloads.shape[1])
        if self._marked:
            self.marks.fill(0)
        self._marked = True
        if stale is None:
            out[...] = 0
        elif stale.shape[0]:
            _cuda.launch(AGGREGATE, "zero_sent", dtype, -(-stale.shape[0] // _cuda.THREADS), (np.int64(stale.shape[0]), stale, out))
        self.bad.fill(0)
        if self.bitmap:  # every row's indices into decoded, in order: counts, their running sums, the positions
            layout = (np.int64(self.d), np.int32(self.tiles), row_bytes, np.int64(8 + dtype.itemsize * self.k), payloads)
            _cuda.launch(AGGREGATE, "bitmap_count", None, self.rows * self.tiles, (*layout, self.counts))
            self.counts.cumsum(axis=1, out=self.ends)
            _cuda.launch(
                AGGREGATE, "bitmap_write", None, self.rows * self.tiles,
                (layout[0], np.int32(self.k), *layout[1:], self.counts, self.ends, self.decoded),
            )
        blocks = -(-self.k // _cuda.THREADS)
        for row in range(self.rows):
            _cuda.launch(
                AGGREGATE, "add_row", dtype, blocks,
                (np.int64(self.k), np.int64(self.d), np.int32(row), row_bytes, payloads, self._expected, np.int32(self.bitmap),
                 self.decoded, self.ends, np.int32(self.tiles), out, self.marks, self.kept[row], self.first[row], self.bad),
            )
        t = dtype.type
        _cuda.launch(
            AGGREGATE, "settle_rows", dtype, -(-n // _cuda.THREADS),
            (np.int64(n), self.kept, self.first, t(self.rows), t(lr), np.int32(params is not None), out,
             out if params is None else params, self.marks, self.bad),
        )
        bad = int(self.bad[0])  # the one wait: a bad row is an error, not a quiet wrong sum
        self._marked = False  # a bad entry was never marked
        if bad:
            indices = f"its bitmap must mark k = {self.k} entries" if self.bitmap else f"its indices unique, ascending and in [0, {self.d})"
            raise ValueError(f"payload row {bad - 1} is not {self.k} of {self.d} entries: its header must be {self.header.tolist()} and {indices}")
        return self.kept.reshape(n)
