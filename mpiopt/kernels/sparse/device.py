"""Top-k selection on the GPU: ``_sparsec.scan`` as two CUDA kernels (RegTop-k's factors applied on the way, its ratio and
sample scaling as two more), the k best of its candidates in CuPy, and the ``topk`` codec's per-chunk selection as one kernel.

The same result as the numpy path's (:func:`~mpiopt.kernels.sparse.topk_indices`, the C scan): the candidates
are the entries whose score reaches a sampled threshold, ascending, with ``x += g`` done on the way; the k of
highest score among them are kept, the lowest indices first among ties at the k-th place.  The C scan is the
twin the CPU suite runs; tests/unit/test_sparse_device.py compares the two on a lent GPU.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from ...arrays import array_module, to_numpy
from .. import _cuda
from .._backend import C_FLOATS
from .selection import FeedbackSelection, _workspace_plan

__all__ = ["DeviceTopkWorkspace", "BLOCK_SELECT", "SELECT", "MAX_CHUNK", "chunk_topk", "take_zero", "keep_best"]

# Entries per thread: one block scans THREADS * _ITEMS adjacent entries, its candidates counted, then written in order.
_ITEMS = 16

#: What a kernel that selects in one block shares: the rounding helpers, block sums, rank keys, the k-th key.
BLOCK_SELECT = _cuda.HELPERS + r"""
#define ITEMS 16

template <typename T> __device__ __forceinline__ T score_(T v, int absolute) { return absolute ? abs_(v) : v; }

/* An exclusive sum over the block's threads of v (blockDim.x a multiple of 32, at most 1024); *total gets the whole sum. */
__device__ __forceinline__ int block_scan_(int v, int *total) {
    __shared__ int warp_sums[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    int x = v;
    for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    if (lane == 31) warp_sums[warp] = x;
    __syncthreads();
    if (warp == 0) {
        int w = lane < warps ? warp_sums[lane] : 0;
        for (int o = 1; o < 32; o <<= 1) {
            const int y = __shfl_up_sync(0xffffffffu, w, o);
            if (lane >= o) w += y;
        }
        warp_sums[lane] = w;
    }
    __syncthreads();
    const int before = warp ? warp_sums[warp - 1] : 0;
    *total = warp_sums[warps - 1];
    __syncthreads(); /* warp_sums is written again by the next call */
    return before + x - v;
}

/* The rank key of |v|: magnitudes in order, NaN below them all (as -inf in the array code), +-0.0 equal. */
template <typename T> struct Key;
template <> struct Key<float> { typedef unsigned type; };
template <> struct Key<double> { typedef unsigned long long type; };
template <typename T> __device__ __forceinline__ typename Key<T>::type key_(T v) {
    typedef typename Key<T>::type K;
    const K u = bits_(v) & ~ieee<K>::sign;
    return u > ieee<K>::inf ? (K)0 : u + 1;
}

/* The k-th largest of the block's keys (thread t's are keys[0, mine), entries t * per onwards) by a radix select, a
 * byte a round from the top; *ties gets how many keys equal to it are among the k largest. */
template <typename K>
__device__ __forceinline__ K kth_key_(const K (&keys)[ITEMS], int mine, int k, int *ties) {
    __shared__ int bins[256];
    __shared__ K chosen;
    __shared__ int still;
    K prefix = 0, mask = 0;
    int remaining = k, total;
    for (int shift = 8 * (int)sizeof(K) - 8; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < 256; b += blockDim.x) bins[b] = 0;
        __syncthreads();
#pragma unroll
        for (int q = 0; q < ITEMS; ++q)
            if (q < mine && (keys[q] & mask) == prefix) atomicAdd(&bins[(keys[q] >> shift) & 255], 1);
        __syncthreads();
        /* bin 255 - threadIdx.x: the entries in higher bins, and whether the remaining-th largest is in this one */
        const int bin = 255 - (int)threadIdx.x, count = threadIdx.x < 256 ? bins[bin & 255] : 0;
        const int above = block_scan_(count, &total);
        if (threadIdx.x < 256 && above < remaining && remaining <= above + count) {
            chosen = prefix | ((K)bin << shift);
            still = remaining - above;
        }
        __syncthreads();
        prefix = chosen;
        remaining = still;
        mask |= (K)255 << shift;
        __syncthreads();
    }
    *ties = remaining;
    return prefix;
}

/* Which of this thread's keys are among the k largest (keep[q]): those above kth, and the first `ties` equal to it in
 * index order; returns this thread's first place among the kept, which ascend with the index. */
template <typename K>
__device__ __forceinline__ int kept_(const K (&keys)[ITEMS], int mine, K kth, int ties, bool (&keep)[ITEMS]) {
    int equal = 0, total;
#pragma unroll
    for (int q = 0; q < ITEMS; ++q) equal += q < mine && keys[q] == kth;
    int tie = block_scan_(equal, &total), kept = 0;
#pragma unroll
    for (int q = 0; q < ITEMS; ++q) {
        const bool at_kth = q < mine && keys[q] == kth;
        keep[q] = q < mine && (keys[q] > kth || (at_kth && tie < ties));
        tie += at_kth;
        kept += keep[q];
    }
    return block_scan_(kept, &total);
}

"""

_SOURCE = BLOCK_SELECT + r"""
/* RegTop-k's factors at last step's entries over[0, n_over) (ascending): those in this block's tile of blockDim.x *
 * ITEMS entries from lo are over[*first, *last), found by two threads. */
__device__ __forceinline__ void tile_overrides_(const int *over, int n_over, long long lo, int *first, int *last) {
    __shared__ int range[2];
    if (threadIdx.x < 2) {
        const long long bound = lo + (long long)threadIdx.x * blockDim.x * ITEMS;
        int a = 0, b = n_over;
        while (a < b) {
            const int m = (a + b) >> 1;
            if (over[m] < bound) a = m + 1; else b = m;
        }
        range[threadIdx.x] = a;
    }
    __syncthreads();
    *first = range[0];
    *last = range[1];
}

/* Score s of entry i, times its factor where i is among over[first, last) (the C scan's product, rounded). */
template <typename T>
__device__ __forceinline__ T scaled_(T s, long long i, const int *over, const T *factors, int first, int last) {
    int a = first, b = last;
    while (a < b) {
        const int m = (a + b) >> 1;
        if (over[m] < i) a = m + 1; else b = m;
    }
    return a < last && over[a] == i ? mul_(factors[a], s) : s;
}

/* A tile is blockDim.x * ITEMS adjacent entries, one block a tile.  Pass 1 over tile b (read coalesced, entry
 * q * blockDim.x + t by thread t): x += g first where add (bad flags a NaN or +-inf in g), then counts[b] = the
 * tile's entries whose score, |x| (absolute) or x, times its factor at over, is >= *t (never NaN). */
template <typename T>
__global__ void scan_count(long long n, T *x, const T *g, const T *t, int absolute, int add, const int *over,
                           const T *factors, int n_over, int *counts, int *bad) {
    const long long base = (long long)blockIdx.x * blockDim.x * ITEMS + threadIdx.x;
    const T threshold = *t;
    int count = 0, first = 0, last = 0;
    if (n_over) tile_overrides_(over, n_over, base - threadIdx.x, &first, &last);
    bool ok = true;
#pragma unroll
    for (int q = 0; q < ITEMS; ++q) {
        const long long i = base + (long long)q * blockDim.x;
        if (i < n) {
            T v = x[i];
            if (add) {
                const T gi = g[i];
                ok &= finite_(gi);
                v = add_(v, gi);
                x[i] = v;
            }
            const T s = score_(v, absolute);
            count += ge_(first < last ? scaled_(s, i, over, factors, first, last) : s, threshold);
        }
    }
    int total;
    block_scan_(count, &total);
    if (threadIdx.x == 0) counts[blockIdx.x] = total;
    if (!ok) *bad = 1;
}

/* Pass 2: tile b's candidates (index, score), ascending, from ends[b] - counts[b] on (those below capacity),
 * thread t's from entry t * ITEMS of the tile: its place from the candidates of the threads before it. */
template <typename T>
__global__ void scan_write(long long n, const T *x, const T *t, int absolute, const int *over, const T *factors,
                           int n_over, const int *counts, const int *ends, long long capacity, int *idx, T *scores) {
    const long long first = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * ITEMS;
    const T threshold = *t;
    if (counts[blockIdx.x] == 0) return; /* the whole block: nothing to write */
    int lo = 0, hi = 0;
    if (n_over) tile_overrides_(over, n_over, (long long)blockIdx.x * blockDim.x * ITEMS, &lo, &hi);
    T s[ITEMS];
    unsigned hits = 0;
#pragma unroll
    for (int q = 0; q < ITEMS; ++q) {
        s[q] = first + q < n ? score_(x[first + q], absolute) : (T)0;
        if (lo < hi) s[q] = scaled_(s[q], first + q, over, factors, lo, hi);
        hits |= (unsigned)(first + q < n && ge_(s[q], threshold)) << q;
    }
    int total;
    long long at = (long long)ends[blockIdx.x] - counts[blockIdx.x] + block_scan_(__popc(hits), &total);
#pragma unroll
    for (int q = 0; q < ITEMS; ++q) {
        if ((hits >> q) & 1) {
            if (at < capacity) {
                idx[at] = (int)(first + q);
                scores[at] = s[q];
            }
            ++at;
        }
    }
}

/* The top k of |x| in each row of chunk (<= blockDim.x * ITEMS) entries, one block a row: flat[row * k + j], the j-th
 * selected flat index, ascending; of equal magnitudes at the k-th place the lowest indices. */
template <typename T>
__global__ void chunk_topk(long long rows, int chunk, int k, const T *x, long long *flat) {
    typedef typename Key<T>::type K;
    const long long row = blockIdx.x;
    const int per = (chunk + blockDim.x - 1) / blockDim.x, first = threadIdx.x * per;
    const int mine = max(0, min(per, chunk - first));
    K keys[ITEMS];
#pragma unroll
    for (int q = 0; q < ITEMS; ++q) keys[q] = q < mine ? key_(x[row * chunk + first + q]) : (K)0;
    int remaining;
    const K kth = kth_key_<K>(keys, mine, k, &remaining);
    bool keep[ITEMS];
    int at = kept_<K>(keys, mine, kth, remaining, keep);
#pragma unroll
    for (int q = 0; q < ITEMS; ++q)
        if (keep[q]) flat[row * k + at++] = row * chunk + first + q;
}

/* RegTop-k's |1 + delta| / mu at the k entries sent last step (the C loops' regtopk_ratio on a dense G_prev):
 * own = sent w; delta = (G_prev[idx] - own) / own, or q where own is 0. */
template <typename T>
__global__ void regtopk_ratio(long long k, const T *prev, const int *idx, const T *sent, T w, T q, T mu, T *out) {
    FOR_EACH(i, k) {
        const T own = mul_(sent[i], w);
        const T delta = bits_(own) << 1 ? div_(sub_(prev[idx[i]], own), own) : q; /* own != 0, -ftz-proof */
        out[i] = div_(abs_(add_(delta, (T)1)), mu);
    }
}

/* sample[j / stride] = factor * it for the sent entries j that the strided sample holds (idx unique). */
template <typename T>
__global__ void scale_sampled(long long k, long long n, long long stride, const int *idx, const T *factors, T *sample) {
    FOR_EACH(p, k) {
        const long long j = idx[p];
        if (j % stride == 0 && j / stride < n) sample[j / stride] = mul_(factors[p], sample[j / stride]);
    }
}

/* Error feedback's send: values[i] = e[idx[i]], then e[idx[i]] = 0 (idx unique). */
template <typename T>
__global__ void take_zero(long long k, const int *idx, T *e, T *values) {
    FOR_EACH(i, k) {
        values[i] = e[idx[i]];
        e[idx[i]] = (T)0;
    }
}

/* The k candidates of highest score (scores[0, n), no NaN; *kth the k-th highest), the lowest index first among ties
 * at the k-th, into selected in index order, in two passes over tiles of blockDim.x * ITEMS, a block a tile.
 * Pass 1: tile b's candidates above *kth in counts[b], equal to it in counts[gridDim.x + b]. */
template <typename T>
__global__ void keep_count(long long n, const T *kth, const T *scores, int *counts) {
    const T t = *kth;
    const long long tile = (long long)blockIdx.x * blockDim.x * ITEMS;
    int above = 0, equal = 0, total;
#pragma unroll
    for (int q = 0; q < ITEMS; ++q) {
        const long long i = tile + (long long)q * blockDim.x + threadIdx.x; /* coalesced: a count needs no order */
        if (i < n) {
            const T v = scores[i];
            above += !ge_(t, v); /* > t: -ftz-proof */
            equal += ge_(v, t) && ge_(t, v);
        }
    }
    block_scan_(above, &total);
    if (threadIdx.x == 0) counts[blockIdx.x] = total;
    block_scan_(equal, &total);
    if (threadIdx.x == 0) counts[gridDim.x + blockIdx.x] = total;
}

/* Pass 2 (ends: each half's running sums of counts): tile b's kept candidates at their places, thread t's ITEMS
 * adjacent ones in order; kept are those above *kth and, of those equal to it, the first k - (all above). */
template <typename T>
__global__ void keep_write(long long n, int k, const T *kth, const int *candidates, const T *scores, const int *counts,
                           const int *ends, int *selected) {
    const long long tiles = gridDim.x, b = blockIdx.x;
    const long long ties = max(0LL, (long long)k - ends[tiles - 1]); /* equal ones kept, the lowest indices first */
    const long long equal_before = ends[tiles + b] - counts[tiles + b];
    if (counts[b] == 0 && (counts[tiles + b] == 0 || equal_before >= ties)) return; /* the whole block: none kept */
    const T t = *kth;
    const long long first = b * blockDim.x * ITEMS + (long long)threadIdx.x * ITEMS;
    const int mine = (int)max(0LL, min((long long)ITEMS, n - first));
    int equal = 0, kept = 0, total;
    T v[ITEMS];
#pragma unroll
    for (int q = 0; q < ITEMS; ++q) {
        v[q] = q < mine ? scores[first + q] : t;
        equal += q < mine && ge_(v[q], t) && ge_(t, v[q]);
    }
    long long tie = equal_before + block_scan_(equal, &total);
    bool keep[ITEMS];
#pragma unroll
    for (int q = 0; q < ITEMS; ++q) {
        const bool at_kth = q < mine && ge_(v[q], t) && ge_(t, v[q]);
        keep[q] = q < mine && (!ge_(t, v[q]) || (at_kth && tie < ties));
        tie += at_kth;
        kept += keep[q];
    }
    long long at = ends[b] - counts[b] + min(equal_before, ties) + block_scan_(kept, &total);
#pragma unroll
    for (int q = 0; q < ITEMS; ++q)
        if (keep[q] && at < k) selected[at++] = candidates[first + q]; /* k at most, whatever the scores */
}
"""

SELECT = _cuda.Program(_SOURCE, ("scan_count", "scan_write", "chunk_topk", "regtopk_ratio", "scale_sampled", "take_zero", "keep_count", "keep_write"))
#: The longest row :func:`chunk_topk` selects in (one block of THREADS threads, ITEMS entries each).
MAX_CHUNK = _cuda.THREADS * _ITEMS


def chunk_topk(rows: Any, k: int, out: Any) -> bool:
    """The top ``k`` ``|rows|`` of every row into ``out`` (int64, ``rows.shape[0] * k``): flat indices, ascending; lowest
    index first among ties, NaN below every number.  False (nothing written) where the kernel cannot run: numpy or
    non-contiguous rows, rows longer than :data:`MAX_CHUNK`, or kernels that do not compile."""
    n, chunk = rows.shape
    if not 1 <= k <= chunk:  # the kernel's radix select finds no k-th key then, and would write past out
        raise ValueError(f"k must be in [1, chunk = {chunk}], got {k}")
    if type(rows) is np.ndarray or rows.dtype not in C_FLOATS or not rows.flags.c_contiguous or chunk > MAX_CHUNK:
        return False
    if not _cuda.compiled(SELECT):
        return False
    _cuda.launch(SELECT, "chunk_topk", rows.dtype, n, (np.int64(n), np.int32(chunk), np.int32(k), rows, out))
    return True


def take_zero(error: Any, indices: Any, values: Any) -> bool:
    """``values[:] = error[indices]; error[indices] = 0`` in one kernel (``indices`` unique int32, ``values`` their length);
    False (nothing done) for numpy arrays or where the kernels do not compile."""
    arrays = (error, indices, values)
    if array_module(error) is np or any(type(a) is not type(error) or not a.flags.c_contiguous for a in arrays):
        return False
    if error.dtype not in C_FLOATS or values.dtype != error.dtype or indices.dtype != np.int32 or not _cuda.compiled(SELECT):
        return False
    k = indices.shape[0]
    _cuda.launch(SELECT, "take_zero", error.dtype, -(-k // _cuda.THREADS), (np.int64(k), indices, error, values))
    return True


def keep_best(kth: Any, candidates: Any, scores: Any, k: int, counts: Any, ends: Any, selected: Any) -> None:
    """The k of ``candidates`` of highest ``scores`` (numbers only; ``kth``: a device array starting at the k-th
    highest), the lowest index first among ties at the k-th, into ``selected`` in index order: two kernels over
    tiles of ``THREADS * ITEMS`` candidates, a block a tile, and each tile's counts' running sums between
    (``counts``, ``ends``: int32 scratch of at least twice the tiles)."""
    n = scores.shape[0]
    tiles = -(-n // (_cuda.THREADS * _ITEMS))
    counts, ends = counts[: 2 * tiles], ends[: 2 * tiles]
    _cuda.launch(SELECT, "keep_count", scores.dtype, tiles, (np.int64(n), kth, scores, counts))
    counts.reshape(2, tiles).cumsum(axis=1, out=ends.reshape(2, tiles))
    _cuda.launch(SELECT, "keep_write", scores.dtype, tiles, (np.int64(n), np.int32(k), kth, candidates, scores, counts, ends, selected))


class DeviceTopkWorkspace:
    """:class:`~mpiopt.kernels.sparse.TopkWorkspace` for cupy arrays: buffers made once, the scan (with RegTop-k's
    factors) as CUDA kernels.

    Sized for twice the expected candidates, as the numpy one; more (or fewer than k) fall back to the general code.
    Built by :meth:`create`, which returns None where the kernels do not compile.
    """

    def __init__(self, d: int, k: int, dtype: Any) -> None:
        import cupy

        d, k, dtype, n, capacity = _workspace_plan(d, k, dtype)
        tiles = -(-d // (_cuda.THREADS * _ITEMS))
        self.d, self.k, self.dtype = d, k, dtype
        self.sample = cupy.empty(n, dtype)
        self.counts = cupy.empty(tiles, np.int32)
        self.ends = cupy.empty(tiles, np.int32)
        self.status = cupy.empty(2, np.int32)  # whether the gradient was finite, and the candidates' count: one read
        self.candidates = cupy.empty(capacity, np.int32)
        self.scores = cupy.empty(capacity, dtype)
        self.order = cupy.empty(capacity, dtype)
        self.selected = cupy.empty(k, np.int32)
        self.keep_counts = cupy.empty(2 * -(-capacity // (_cuda.THREADS * _ITEMS)), np.int32)  # keep_best's scratch
        self.keep_ends = cupy.empty_like(self.keep_counts)
        self.rows = cupy.empty((3, k), dtype)  # RegTop-k's k-sized temporaries, as the numpy workspace's

    @classmethod
    def create(cls, d: int, k: int, dtype: Any) -> Optional["DeviceTopkWorkspace"]:
        """A workspace on the current device, or None where the scan kernels do not compile (or the dtype is not theirs)."""
        if np.dtype(dtype) not in C_FLOATS or not _cuda.compiled(SELECT):
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

        Entries at ``over`` (ascending int32) score ``over_factors`` times their usual score.  ``indices`` is None (the
        caller selects with the general code) when fewer than k or more candidates than the workspace holds reach
        it, or ``grad`` is not finite (then ``finite`` is False).
        """
        d, dtype, add = values.shape[0], values.dtype, grad is not None
        tiles = self.counts.shape[0]
        factors = (values, values, np.int32(0)) if over is None else (over, over_factors, np.int32(over.shape[0]))
        self.status.fill(0)
        _cuda.launch(
            SELECT, "scan_count", dtype, tiles,
            (np.int64(d), values, grad if add else values, threshold, np.int32(absolute), np.int32(add), *factors, self.counts,
             self.status),
        )
        self.counts.cumsum(out=self.ends)
        self.status[1:] = self.ends[-1:]
        bad, n = (int(v) for v in to_numpy(self.status))  # one wait for the device: the flag and the candidates' count
        if bad:
            return FeedbackSelection(None, False)
        capacity = self.candidates.shape[0]
        if not k <= n <= capacity:
            return FeedbackSelection(None, True)
        _cuda.launch(
            SELECT, "scan_write", dtype, tiles,
            (np.int64(d), values, threshold, np.int32(absolute), *factors, self.counts, self.ends, np.int64(capacity),
             self.candidates, self.scores),
        )
        return FeedbackSelection(self._best(n, k), True)

    def regtopk_ratio(
        self, prev: Any, sent_indices: Any, sent_values: Any, out: Any, w: float, q: float, mu: float, support: Any = None,
    ) -> bool:
        """RegTop-k's ``|1 + delta| / mu`` at last step's entries into ``out`` from the dense ``G_prev`` (one kernel, the
        C loop's roundings); False (nothing written) for ``G_prev`` given at a ``support``."""
        if support is not None:
            return False
        k, dtype = sent_indices.shape[0], out.dtype.type
        _cuda.launch(
            SELECT, "regtopk_ratio", out.dtype, -(-k // _cuda.THREADS),
            (np.int64(k), prev, sent_indices, sent_values, dtype(w), dtype(q), dtype(mu), out),
        )
        return True

    def scale_sampled(self, sample: Any, sent_indices: Any, sent_factors: Any, stride: int) -> None:
        """``sample[j / stride] *= factor`` for the sent entries ``j`` that the strided ``sample`` holds (one kernel)."""
        k = sent_indices.shape[0]
        _cuda.launch(
            SELECT, "scale_sampled", sample.dtype, -(-k // _cuda.THREADS),
            (np.int64(k), np.int64(sample.shape[0]), np.int64(stride), sent_indices, sent_factors, sample),
        )

    def _best(self, n: int, k: int) -> Any:
        """The k candidates of highest score (numbers only), lowest index first among ties, into ``selected``: CuPy's
        sort finds the k-th score, :func:`keep_best` keeps the k in index order."""
        order = self.order[:n]
        order[...] = self.scores[:n]
        order.sort()
        keep_best(order[n - k :], self.candidates[:n], self.scores[:n], k, self.keep_counts, self.keep_ends, self.selected)
        return self.selected
