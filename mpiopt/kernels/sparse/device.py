"""Top-k selection on the GPU: ``_sparsec.scan`` as two CUDA kernels, and the k best of its candidates in CuPy.

The same result as the numpy path's (:func:`~mpiopt.kernels.sparse.topk_indices`, the C scan): the candidates
are the entries whose score reaches a sampled threshold, ascending, with ``x += g`` done on the way; the k of
highest score among them are kept, the lowest indices first among ties at the k-th place.  The C scan is the
twin the CPU suite runs; tests/unit/test_sparse_device.py compares the two on a lent GPU.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from .. import _cuda
from .._backend import C_FLOATS, check_count
from .index_sets import _MAX_LENGTH
from .selection import FeedbackSelection, _sample_plan

__all__ = ["DeviceTopkWorkspace", "SCAN"]

# Entries per thread: one block scans THREADS * _ITEMS adjacent entries, its candidates counted, then written in order.
_ITEMS = 16

_SOURCE = _cuda.HELPERS + r"""
#define ITEMS 16

template <typename T> __device__ __forceinline__ T score_(T v, int absolute) { return absolute ? fabs(v) : v; }

/* Pass 1 over tile b (blockDim.x * ITEMS entries from b * blockDim.x * ITEMS): x += g first where add (bad
 * flags a NaN or +-inf in g), then counts[b] = the tile's entries whose score, |x| (absolute) or x, is >= *t
 * (never NaN). */
template <typename T>
__global__ void scan_count(long long n, T *x, const T *g, const T *t, int absolute, int add, int *counts, int *bad) {
    const long long base = (long long)blockIdx.x * blockDim.x * ITEMS + threadIdx.x;
    const T threshold = *t;
    int count = 0;
    bool ok = true;
    for (int q = 0; q < ITEMS; ++q) {
        const long long i = base + (long long)q * blockDim.x;
        bool hit = false;
        if (i < n) {
            T v = x[i];
            if (add) {
                const T gi = g[i];
                ok &= finite_(gi);
                v = add_(v, gi);
                x[i] = v;
            }
            hit = score_(v, absolute) >= threshold;
        }
        count += __syncthreads_count(hit);
    }
    if (threadIdx.x == 0) counts[blockIdx.x] = count;
    if (!ok) *bad = 1;
}

/* Pass 2: tile b's candidates (index, score), ascending, from ends[b] - counts[b] on (those below capacity):
 * a warp's place from its ballot, a thread's from the lanes below it. */
template <typename T>
__global__ void scan_write(long long n, const T *x, const T *t, int absolute, const int *counts, const int *ends,
                           long long capacity, int *idx, T *scores) {
    __shared__ int warp_counts[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const long long base = (long long)blockIdx.x * blockDim.x * ITEMS + threadIdx.x;
    const T threshold = *t;
    long long at = (long long)ends[blockIdx.x] - counts[blockIdx.x];
    for (int q = 0; q < ITEMS; ++q) {
        const long long i = base + (long long)q * blockDim.x;
        T s = 0;
        bool hit = false;
        if (i < n) {
            s = score_(x[i], absolute);
            hit = s >= threshold;
        }
        const unsigned ballot = __ballot_sync(0xffffffffu, hit);
        if (lane == 0) warp_counts[warp] = __popc(ballot);
        __syncthreads();
        int before = 0, total = 0;
        for (int w = 0; w < warps; ++w) {
            const int c = warp_counts[w];
            before += w < warp ? c : 0;
            total += c;
        }
        if (hit) {
            const long long k = at + before + __popc(ballot & ((1u << lane) - 1u));
            if (k < capacity) {
                idx[k] = (int)i;
                scores[k] = s;
            }
        }
        at += total;
        __syncthreads(); /* warp_counts is written again next round */
    }
}
"""

SCAN = _cuda.Program(_SOURCE, ("scan_count", "scan_write"))


class DeviceTopkWorkspace:
    """:class:`~mpiopt.kernels.sparse.TopkWorkspace` for cupy arrays: buffers made once, the scan as CUDA kernels.

    Sized for twice the expected candidates, as the numpy one; more (or fewer than k) fall back to the general code.
    Built by :meth:`create`, which returns None where the kernels do not compile.
    """

    #: RegTop-k's factors at last step's entries are applied by the C scan only (cupy: the general selection).
    takes_factors = False

    def __init__(self, d: int, k: int, dtype: Any) -> None:
        import cupy

        d, k = check_count("d", d, 1, _MAX_LENGTH), check_count("k", k, 0, d)
        dtype = np.dtype(dtype)
        stride, n, rank = _sample_plan(d, max(k, 1))
        capacity = min(d, 2 * (rank * stride + k) + 64)
        tiles = -(-d // (_cuda.THREADS * _ITEMS))
        self.d, self.k, self.dtype = d, k, dtype
        self.sample = cupy.empty(n, dtype)
        self.counts = cupy.empty(tiles, np.int32)
        self.ends = cupy.empty(tiles, np.int32)
        self.candidates = cupy.empty(capacity, np.int32)
        self.scores = cupy.empty(capacity, dtype)
        self.order = cupy.empty(capacity, dtype)
        self.selected = cupy.empty(k, np.int32)

    @classmethod
    def create(cls, d: int, k: int, dtype: Any) -> Optional["DeviceTopkWorkspace"]:
        """A workspace on the current device, or None where the scan kernels do not compile (or the dtype is not theirs)."""
        if np.dtype(dtype) not in C_FLOATS or not _cuda.compiled(SCAN):
            return None
        return cls(d, k, dtype)

    def fits(self, values: Any, k: int) -> bool:
        """Whether this workspace can select ``k`` of ``values``: a contiguous cupy vector of its length and dtype."""
        return (
            type(values) is type(self.sample) and values.dtype == self.dtype and values.shape == (self.d,)
            and k == self.k and values.flags.c_contiguous
        )

    def scan_select(
        self, values: Any, grad: Any, threshold: Any, absolute: bool, k: int, over: Any = None, over_factors: Any = None,
    ) -> FeedbackSelection:
        """``values += grad`` (where given) and the k best of the entries whose score reaches ``threshold`` (a 0-d array).

        ``indices`` is None (the caller selects with the general code) when fewer than k or more candidates than the
        workspace holds reach it, or ``grad`` is not finite (then ``finite`` is False).
        """
        if over is not None:
            raise ValueError("the device scan takes no factors (takes_factors is False)")
        d, dtype, add = values.shape[0], values.dtype, grad is not None
        tiles = self.counts.shape[0]
        bad = _cuda.launch(
            SCAN, "scan_count", dtype, tiles,
            (np.int64(d), values, grad if add else values, threshold, np.int32(absolute), np.int32(add), self.counts), flag=add,
        )
        if bad:
            return FeedbackSelection(None, False)
        self.counts.cumsum(out=self.ends)
        n = int(self.ends[-1])  # waits for the device: the candidates' count decides what follows
        capacity = self.candidates.shape[0]
        if not k <= n <= capacity:
            return FeedbackSelection(None, True)
        _cuda.launch(
            SCAN, "scan_write", dtype, tiles,
            (np.int64(d), values, threshold, np.int32(absolute), self.counts, self.ends, np.int64(capacity), self.candidates, self.scores),
        )
        return FeedbackSelection(self._best(n, k), True)

    def _best(self, n: int, k: int) -> Any:
        """The k candidates of highest score (numbers only), lowest index first among ties, into ``selected``."""
        import cupy

        scores, order = self.scores[:n], self.order[:n]
        order[...] = scores
        order.sort()
        kth = order[n - k]  # stays on the device
        keep = scores > kth
        ties = scores == kth
        missing = k - cupy.count_nonzero(keep)
        keep |= ties & (cupy.cumsum(ties, dtype=np.int32) <= missing)  # candidates ascend: the lowest tied indices
        self.selected[...] = self.candidates[:n][keep]
        return self.selected
