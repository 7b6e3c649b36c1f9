"""The aggregation of P Top-k payloads on the GPU: ``G = (1/N) sum_n sent_n`` as P + 2 kernels and one wait.

The array code (:func:`~mpiopt.kernels.sparse.aggregate_payloads` on cupy) checks each row's indices (three waits a
row), scatter-adds a row in three launches, sorts the rows' union and divides and updates through fancy indexing.
Here: the last call's entries are zeroed, each row is added in rank order by one kernel (its indices are unique:
no two threads meet), which also marks, in a bitmap, whether an earlier row sent the entry; a last kernel divides
``G`` and updates the parameters at each entry's first sender and clears the marks.  The same floats as the
array code; the rows' bad headers and indices are found by the kernels and reported after the last one (the one
wait for pairs payloads: the headers are not read first; a bitmap's decode waits once a row), the parameters then
left as they were.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from .. import _cuda
from .._backend import C_FLOATS
from .payload import encoded_nbytes, payload_header

__all__ = ["AGGREGATE", "DeviceAggregation"]

_SOURCE = _cuda.HELPERS + r"""
/* The entries the last call's rows sent (duplicates among rows do no harm), zeroed. */
template <typename T>
__global__ void zero_sent(long long n, const int *sent, T *out) {
    FOR_EACH(i, n) out[sent[i]] = (T)0;
}

/* Row `row` of the payloads: out[idx[i]] += v[i], kept[i] = idx[i], and first[i] = whether no earlier row sent it (its
 * bit in marks was clear).  A header other than `expected` (8 bytes), or indices not ascending or out of [0, d)
 * (skipped) flag bad = row + 1, unless an earlier row did. */
template <typename T>
__global__ void add_row(long long k, long long d, int row, const unsigned char *header, const unsigned char *expected,
                        const int *idx, const T *v, T *out, unsigned *marks, int *kept, unsigned char *first, int *bad) {
    if (blockIdx.x == 0 && threadIdx.x < 8 && header[threadIdx.x] != expected[threadIdx.x]) atomicCAS(bad, 0, row + 1);
    FOR_EACH(i, k) {
        const int j = idx[i];
        if (j < 0 || j >= d || (i > 0 && idx[i - 1] >= j)) {
            atomicCAS(bad, 0, row + 1);
            kept[i] = 0;
            first[i] = 0;
            continue;
        }
        out[j] = add_(out[j], v[i]);
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

AGGREGATE = _cuda.Program(_SOURCE, ("zero_sent", "add_row", "settle_rows"))


class DeviceAggregation:
    """Buffers for aggregating ``rows`` payloads of ``k`` entries of a length-``d`` vector on the GPU, made once.

    ``kept`` holds the last call's rows' indices (what :meth:`aggregate` returns as the entries ``G`` may be non-zero
    at, duplicates included), ``marks`` a bitmap of d bits that is all clear between calls.  Built by :meth:`create`.
    """

    def __init__(self, rows: int, k: int, d: int) -> None:
        import cupy

        self.rows, self.k, self.d = rows, k, d
        self.marks = cupy.zeros(-(-d // 32), np.uint32)
        self.kept = cupy.empty((rows, k), np.int32)
        self.first = cupy.empty((rows, k), np.uint8)
        self.bad = cupy.zeros(1, np.int32)
        #: What every row's header must be (decode reads the rows by it; the kernels check the rows' own).
        self.header = payload_header(k, d)
        self._expected = cupy.asarray(self.header)
        self._marked = False  # True from a call's first kernel to its last, which clears every mark the call set

    @classmethod
    def create(cls, rows: int, k: int, d: int) -> Optional["DeviceAggregation"]:
        """Buffers on the current device, or None where the kernels do not compile."""
        return cls(rows, k, d) if _cuda.compiled(AGGREGATE) else None

    def takes(self, payloads: Any, out: Any, params: Optional[Any]) -> bool:
        """Whether :meth:`aggregate` runs on these payloads: ``rows`` device rows of :func:`encode`'s bytes for ``k`` of
        ``d`` entries in ``out``'s dtype, each row's values aligned, ``out`` (and ``params``) contiguous float32 or
        float64 vectors of length ``d`` on the device."""
        arrays = [out] + ([] if params is None else [params])
        return (
            type(payloads) is type(self.kept) and payloads.ndim == 2 and payloads.flags.c_contiguous
            and payloads.shape == (self.rows, encoded_nbytes(self.k, self.d, out.dtype)) and out.dtype in C_FLOATS
            and payloads.shape[1] % out.dtype.itemsize == 0
            and all(type(a) is type(self.kept) and a.flags.c_contiguous and a.dtype == out.dtype and a.shape == (self.d,) for a in arrays)
        )

    def aggregate(self, payloads: Any, decoded: list, out: Any, stale: Optional[Any], params: Optional[Any], lr: float) -> Any:
        """``out = (1/P) sum of the rows`` where sent (``stale``, or all of ``out`` for None, cleared first), and
        ``params -= lr out`` there when given; returns ``kept`` flattened.  ``decoded``: each payload's (indices,
        values), read by :attr:`header`, which the kernels check.  ``ValueError`` naming the first row whose header
        is not that or whose indices are not unique, ascending and in ``[0, d)`` (``params`` then unchanged)."""
        dtype, n = out.dtype, self.rows * self.k
        if self._marked:
            self.marks.fill(0)
        self._marked = True
        if stale is None:
            out[...] = 0
        elif stale.shape[0]:
            _cuda.launch(AGGREGATE, "zero_sent", dtype, -(-stale.shape[0] // _cuda.THREADS), (np.int64(stale.shape[0]), stale, out))
        self.bad.fill(0)
        blocks = -(-self.k // _cuda.THREADS)
        for row, (indices, values) in enumerate(decoded):
            _cuda.launch(
                AGGREGATE, "add_row", dtype, blocks,
                (np.int64(self.k), np.int64(self.d), np.int32(row), payloads[row], self._expected, indices, values, out,
                 self.marks, self.kept[row], self.first[row], self.bad),
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
            raise ValueError(
                f"payload row {bad - 1} is not {self.k} of {self.d} entries: its header must be {self.header.tolist()} and "
                f"its indices unique, ascending and in [0, {self.d})"
            )
        return self.kept.reshape(n)
