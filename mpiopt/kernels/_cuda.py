"""The C loops' fused passes for cupy arrays: one CUDA kernel each, with the CPU's bits, subnormals included.

The float helpers are explicit round-to-nearest PTX without ``.ftz``, because CuPy flushes subnormals and
contracts FMAs (docs/internals-kernels.md, "Bits").  Compiled on first use per device.
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, NamedTuple, Optional, Tuple

import numpy as np

from ..arrays import array_module
from ._backend import C_FLOATS

__all__ = ["Program", "ROUNDING", "HELPERS", "THREADS", "compiled", "launch", "takes", "takes_bytes", "sgd", "outer_sgd", "merge_average", "elastic_pull", "all_finite", "pack_signs", "momentum_signs", "apply_signs", "vote"]

# Threads per block; a grid of at most _BLOCKS_PER_SM blocks per multiprocessor strides over longer arrays.
THREADS = 256
_BLOCKS_PER_SM = 16
# Bytes one wide access moves (sgd's and all_finite's kernels, where every array they touch is aligned to them).
_WIDE = 16

#: The arithmetic every kernel rounds with: each operation rounded to nearest, never contracted into an FMA, float32
#: subnormals kept (no ``.ftz``, which CuPy's ``-ftz=true`` would add), and float32 to float64 and back likewise;
#: ``abs_`` and the comparison ``ge_`` keep them too.
ROUNDING = r"""
__device__ __forceinline__ float add_(float a, float b) { float r; asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r; }
__device__ __forceinline__ float sub_(float a, float b) { float r; asm("sub.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r; }
__device__ __forceinline__ float mul_(float a, float b) { float r; asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r; }
__device__ __forceinline__ float div_(float a, float b) { float r; asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r; }
__device__ __forceinline__ double add_(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ double sub_(double a, double b) { return __dsub_rn(a, b); }
__device__ __forceinline__ double mul_(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ double div_(double a, double b) { return __ddiv_rn(a, b); }
__device__ __forceinline__ double widen_(float v) { double r; asm("cvt.f64.f32 %0, %1;" : "=d"(r) : "f"(v)); return r; }
__device__ __forceinline__ float narrow_(double v) { float r; asm("cvt.rn.f32.f64 %0, %1;" : "=f"(r) : "d"(v)); return r; }
__device__ __forceinline__ float abs_(float v) { float r; asm("abs.f32 %0, %1;" : "=f"(r) : "f"(v)); return r; }
__device__ __forceinline__ double abs_(double v) { return fabs(v); }
__device__ __forceinline__ bool ge_(float a, float b) { unsigned r; asm("{ .reg .pred p; setp.ge.f32 p, %1, %2; selp.u32 %0, 1, 0, p; }" : "=r"(r) : "f"(a), "f"(b)); return r; }
__device__ __forceinline__ bool ge_(double a, double b) { return a >= b; }
"""

# What every program's kernels share: the rounding arithmetic, IEEE tests, the grid-strided loop.
HELPERS = ROUNDING + r"""

/* |v| without the sign bit, as an unsigned integer, and the same for +inf: v is finite iff the first is
 * below the second, NaN iff above; v >= 0 iff v is +0.0..+inf (sign bit clear, not NaN) or -0.0. */
__device__ __forceinline__ unsigned bits_(float v) { return __float_as_uint(v); }
__device__ __forceinline__ unsigned long long bits_(double v) { return (unsigned long long)__double_as_longlong(v); }
template <typename U> struct ieee;
template <> struct ieee<unsigned> { static constexpr unsigned sign = 0x80000000u, inf = 0x7f800000u; };
template <> struct ieee<unsigned long long> {
    static constexpr unsigned long long sign = 0x8000000000000000ull, inf = 0x7ff0000000000000ull;
};
template <typename T> __device__ __forceinline__ bool finite_(T v) {
    auto u = bits_(v);
    return (u & ~ieee<decltype(u)>::sign) < ieee<decltype(u)>::inf;
}
template <typename T> __device__ __forceinline__ bool nan_(T v) {
    auto u = bits_(v);
    return (u & ~ieee<decltype(u)>::sign) > ieee<decltype(u)>::inf;
}
template <typename T> __device__ __forceinline__ bool nonnegative_(T v) {
    auto u = bits_(v);
    return u <= ieee<decltype(u)>::inf || u == ieee<decltype(u)>::sign;
}

#define FOR_EACH(i, n) for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < (n); \
                            i += (long long)blockDim.x * gridDim.x)
"""

_SOURCE = HELPERS + r"""

enum { NO_MERGE, DELAYED, PROPORTION };

/* _updatec.c's merge_one: (y - snapshot) + sum / P, or y * p + (sum / P) * q. */
template <typename T>
__device__ __forceinline__ T merge_one(T y, T snapshot, T sum, T mdiv, T mp, T mq, int rule) {
    const T a = div_(sum, mdiv);
    if (rule == PROPORTION) return add_(mul_(y, mp), mul_(a, mq));
    return add_(sub_(y, snapshot), a);
}

/* The update's scalars and flags; the flags are the same for every thread (no divergence). */
template <typename T> struct Step {
    T lr, wd, mom, scale, div, mdiv, mp, mq;
    int divide, merge, decay, momentum, first, damp, nesterov;
};

/* _updatec.c's loop body for one element: returns the new x, updates bi (read only after the first
 * step) and clears ok on a non-finite gradient. */
template <typename T>
__device__ __forceinline__ T sgd_one(const Step<T> &a, T xi, T gi, T &bi, T snapshot, T sum, bool &ok) {
    ok &= finite_(gi);
    if (a.divide) gi = div_(gi, a.div);
    T d = gi;
    if (a.decay) d = add_(mul_(xi, a.wd), gi);
    T s = d;
    if (a.momentum) {
        if (a.first) bi = d;
        else bi = a.damp ? add_(mul_(bi, a.mom), mul_(d, a.scale)) : add_(mul_(bi, a.mom), d);
        s = a.nesterov ? add_(d, mul_(bi, a.mom)) : bi;
    }
    T y = sub_(xi, mul_(s, a.lr));
    return a.merge ? merge_one(y, snapshot, sum, a.mdiv, a.mp, a.mq, a.merge) : y;
}

/* 16 bytes of T: one load or store instruction moves 4 floats or 2 doubles. */
template <typename T> struct Wide;
template <> struct Wide<float> { typedef float4 type; };
template <> struct Wide<double> { typedef double2 type; };

/* The part of [0, n) that goes in whole 16-byte vectors: with wide, body(k) for every vector k (grid-
 * strided); returns the elements done, after which the caller goes one element at a time. */
template <typename T, typename F>
__device__ __forceinline__ long long in_vectors(long long n, int wide, F body) {
    if (!wide) return 0;
    constexpr long long W = sizeof(typename Wide<T>::type) / sizeof(T);
    FOR_EACH(k, n / W) body(k);
    return n / W * W;
}

/* The whole update.  With wide (every array 16-byte aligned) each thread moves whole 16-byte
 * vectors, which brings the kernel near the memory bandwidth; the elements after the last whole
 * vector, and every element without wide, go one at a time.  Arrays a flag leaves unused are
 * never read or written (the caller passes x in their place). */
template <typename T>
__global__ void sgd(long long n, T *x, const T *g, T *b, T *c, T *c2, const T *snapshot, const T *sum, T lr, T wd,
                    T mom, T scale, T div, T mdiv, T mp, T mq, int divide, int copies, int merge, int decay,
                    int momentum, int first, int damp, int nesterov, int wide, int *bad) {
    const Step<T> a = {lr, wd, mom, scale, div, mdiv, mp, mq, divide, merge, decay, momentum, first, damp, nesterov};
    typedef typename Wide<T>::type V;
    bool ok = true;
    const long long done = in_vectors<T>(n, wide, [&](long long k) {
        V xv = ((const V *)x)[k], gv = ((const V *)g)[k], bv = xv, sv = xv, tv = xv;
        if (momentum && !first) bv = ((const V *)b)[k];
        if (merge) tv = ((const V *)sum)[k];
        if (merge == DELAYED) sv = ((const V *)snapshot)[k];
        T *xe = (T *)&xv, *ge = (T *)&gv, *be = (T *)&bv, *se = (T *)&sv, *te = (T *)&tv;
#pragma unroll
        for (int j = 0; j < (int)(sizeof(V) / sizeof(T)); ++j) xe[j] = sgd_one(a, xe[j], ge[j], be[j], se[j], te[j], ok);
        ((V *)x)[k] = xv;
        if (momentum) ((V *)b)[k] = bv;
        if (copies >= 1) ((V *)c)[k] = xv;
        if (copies == 2) ((V *)c2)[k] = xv;
    });
    FOR_EACH(t, n - done) {
        const long long i = done + t;
        T bi = momentum && !first ? b[i] : (T)0;
        const T y = sgd_one(a, x[i], g[i], bi, merge == DELAYED ? snapshot[i] : (T)0, merge ? sum[i] : (T)0, ok);
        x[i] = y;
        if (momentum) b[i] = bi;
        if (copies >= 1) c[i] = y;
        if (copies == 2) c2[i] = y;
    }
    if (!ok) *bad = 1;
}

template <typename T>
__global__ void merge_average(long long n, T *x, const T *snapshot, const T *sum, T mdiv, T mp, T mq, int rule) {
    FOR_EACH(i, n) x[i] = merge_one(x[i], rule == DELAYED ? snapshot[i] : (T)0, sum[i], mdiv, mp, mq, rule);
}

/* _updatec.c's pull: m = sum / P; x -= (x - c) * alpha; c += (m - c) * beta, from the same x and c. */
template <typename T>
__global__ void elastic_pull(long long n, T *x, T *c, const T *sum, T p, T alpha, T beta) {
    FOR_EACH(i, n) {
        const T m = div_(sum[i], p), ci = c[i], xi = x[i];
        x[i] = sub_(xi, mul_(sub_(xi, ci), alpha));
        c[i] = add_(ci, mul_(sub_(m, ci), beta));
    }
}

/* _updatec.c's outer_sgd for element i: d = x - sum / P, torch.optim.SGD's momentum and Nesterov on d. */
template <typename T>
__device__ __forceinline__ T outer_one(T xi, T si, T &bi, T p, T lr, T mom, int momentum, int nesterov) {
    const T d = sub_(xi, div_(si, p));
    T s = d;
    if (momentum) {
        bi = add_(mul_(bi, mom), d);
        s = nesterov ? add_(d, mul_(bi, mom)) : bi;
    }
    return sub_(xi, mul_(s, lr));
}

enum { NO_COPY, COPY, MIX };

/* DiLoCo's outer step in one pass over (x, sum, b), as sgd's kernel: whole 16-byte vectors with wide; c gets
 * nothing, a copy of x, or Streaming DiLoCo's mix c * keep + x * take. */
template <typename T>
__global__ void outer_sgd(long long n, T *x, const T *sum, T *b, T *c, T p, T lr, T mom, T keep, T take, int momentum,
                          int nesterov, int copy, int wide) {
    typedef typename Wide<T>::type V;
    const long long done = in_vectors<T>(n, wide, [&](long long k) {
        V xv = ((const V *)x)[k], sv = ((const V *)sum)[k], bv = xv;
        if (momentum) bv = ((const V *)b)[k];
        T *xe = (T *)&xv, *se = (T *)&sv, *be = (T *)&bv;
#pragma unroll
        for (int j = 0; j < (int)(sizeof(V) / sizeof(T)); ++j) xe[j] = outer_one(xe[j], se[j], be[j], p, lr, mom, momentum, nesterov);
        ((V *)x)[k] = xv;
        if (momentum) ((V *)b)[k] = bv;
        if (copy == MIX) {
            V cv = ((const V *)c)[k];
            T *ce = (T *)&cv;
#pragma unroll
            for (int j = 0; j < (int)(sizeof(V) / sizeof(T)); ++j) ce[j] = add_(mul_(ce[j], keep), mul_(xe[j], take));
            ((V *)c)[k] = cv;
        } else if (copy == COPY) {
            ((V *)c)[k] = xv;
        }
    });
    FOR_EACH(t, n - done) {
        const long long i = done + t;
        T bi = momentum ? b[i] : (T)0;
        const T y = outer_one(x[i], sum[i], bi, p, lr, mom, momentum, nesterov);
        x[i] = y;
        if (momentum) b[i] = bi;
        if (copy == MIX) c[i] = add_(mul_(c[i], keep), mul_(y, take));
        else if (copy == COPY) c[i] = y;
    }
}

/* With wide (x 16-byte aligned) whole 16-byte vectors first, as sgd's kernel reads them. */
template <typename T>
__global__ void all_finite(long long n, const T *x, int wide, int *bad) {
    typedef typename Wide<T>::type V;
    bool ok = true;
    const long long done = in_vectors<T>(n, wide, [&](long long k) {
        const V v = ((const V *)x)[k];
        const T *e = (const T *)&v;
#pragma unroll
        for (int j = 0; j < (int)(sizeof(V) / sizeof(T)); ++j) ok &= finite_(e[j]);
    });
    FOR_EACH(t, n - done) ok &= finite_(x[done + t]);
    if (!ok) *bad = 1;
}

/* Bit j of out[k] is (v[8k + j] >= 0); pad bits 0.  One entry per lane, read and written coalesced; a warp's ballot
 * is the 4 bytes of its 32 entries (little-endian: entry 8k + j at bit j of byte k).  With momentum (m != 0)
 * v = m = m * beta + g * omb is formed and stored first (_signsc.c's momentum_signs); bad flags a NaN. */
template <typename T>
__global__ void pack_signs(long long n, T *v, const T *g, T beta, T omb, int momentum, unsigned char *out, int *bad) {
    bool nan = false;
    const long long nbytes = (n + 7) / 8, whole = (n + 31) / 32 * 32; /* every lane of a warp loops alike */
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < whole; i += (long long)blockDim.x * gridDim.x) {
        bool bit = false;
        if (i < n) {
            T vi = v[i];
            if (momentum) {
                vi = add_(mul_(vi, beta), mul_(g[i], omb));
                v[i] = vi;
            }
            bit = nonnegative_(vi);
            nan |= nan_(vi);
        }
        const unsigned word = __ballot_sync(0xffffffffu, bit);
        const long long at = (i >> 5) * 4 + (threadIdx.x & 31);
        if ((threadIdx.x & 31) < 4 && at < nbytes) out[at] = (unsigned char)(word >> (8 * (threadIdx.x & 31)));
    }
    if (nan) *bad = 1;
}

/* _signsc.c's apply_signs: x = x * decay - (+-lr), the product skipped for decay == 1. */
template <typename T>
__global__ void apply_signs(long long n, const unsigned char *packed, T *x, T lr, T f, int decay) {
    FOR_EACH(i, n) {
        const T y = decay ? mul_(x[i], f) : x[i];
        x[i] = (packed[i >> 3] >> (i & 7)) & 1 ? sub_(y, lr) : add_(y, lr); /* y - (-lr) without a negation */
    }
}

/* Word w (8 bytes from byte 8w) of a packed row of nbytes bytes: one load where aligned and whole, else bytewise
 * with the bytes past the end as zeros. */
__device__ __forceinline__ unsigned long long word_(const unsigned char *row, long long at, long long nbytes, int aligned) {
    if (aligned && nbytes - at >= 8) return *(const unsigned long long *)(row + at);
    unsigned long long v = 0;
    for (int j = 0; j < 8 && at + j < nbytes; ++j) v |= (unsigned long long)row[at + j] << (8 * j);
    return v;
}

/* _signsc.c's vote: bit i of out is whether at least threshold of the voters' rows (stride bytes apart) have
 * bit i set.  One 64-bit word per thread, its count kept in bit planes (levels = bit_length(voters) <= 32) to
 * which each row is added with a ripple carry; then count >= threshold, compared from the top plane down. */
__global__ void vote(long long voters, long long stride, long long nbytes, long long threshold, int levels,
                     int aligned, const unsigned char *rows, unsigned char *out) {
    FOR_EACH(w, (nbytes + 7) / 8) {
        const long long at = 8 * w;
        unsigned long long count[32];
#pragma unroll
        for (int b = 0; b < 32; ++b) count[b] = 0;
        for (long long r = 0; r < voters; ++r) {
            unsigned long long carry = word_(rows + r * stride, at, nbytes, aligned);
#pragma unroll
            for (int b = 0; b < 32; ++b) {
                if (b < levels) {
                    const unsigned long long sum = count[b] ^ carry;
                    carry &= count[b];
                    count[b] = sum;
                }
            }
        }
        unsigned long long greater = 0, equal = ~0ull;
#pragma unroll
        for (int b = 31; b >= 0; --b) {
            if (b < levels) {
                if ((threshold >> b) & 1) equal &= count[b];
                else greater |= equal & count[b];
            }
        }
        const unsigned long long voted = greater | equal;
        if (aligned && nbytes - at >= 8) *(unsigned long long *)(out + at) = voted;
        else for (int j = 0; j < 8 && at + j < nbytes; ++j) out[at + j] = (unsigned char)(voted >> (8 * j));
    }
}
"""

_KERNELS = ("sgd", "outer_sgd", "merge_average", "elastic_pull", "all_finite", "pack_signs", "apply_signs")
_TYPES = {np.dtype(np.float32): "float", np.dtype(np.float64): "double"}
# Kernels on bytes, not templated on a float type.
_PLAIN_KERNELS = ("vote",)


class Program(NamedTuple):
    """CUDA source and the kernels to instantiate: ``templated`` ones for float and double, ``plain`` ones as named."""

    source: str
    templated: Tuple[str, ...]
    plain: Tuple[str, ...] = ()

    def names(self) -> list:
        return [f"{k}<{t}>" for k in self.templated for t in _TYPES.values()] + list(self.plain)


class _Compiled(NamedTuple):
    """One device's kernels, its multiprocessor count, the flag a checking kernel raises, and a flag nobody reads."""

    module: Any
    multiprocessors: int
    flag: Any
    scratch: Any


UPDATE = Program(_SOURCE, _KERNELS, _PLAIN_KERNELS)
# Per device and program: its kernels, or None where they did not compile (the array code runs there instead).
_MODULES: Dict[Tuple[int, Program], Optional[_Compiled]] = {}


def takes(x: Any) -> bool:
    """Whether these kernels compute on arrays like ``x``: C-contiguous cupy float32/float64 arrays, where they compiled."""
    return array_module(x) is not np and x.dtype in C_FLOATS and x.flags.c_contiguous and compiled(UPDATE)


def takes_bytes(x: Any) -> bool:
    """Whether :func:`vote` reads ``x``: cupy uint8, its bytes (of each row) adjacent, where the kernels compiled."""
    return array_module(x) is not np and x.dtype == np.uint8 and x.strides[-1] == 1 and compiled(UPDATE)


def _device(program: Program = UPDATE) -> Optional[_Compiled]:
    """The current device's kernels of ``program``, compiled on first use; None (with a warning, once) where that failed."""
    import cupy

    device = cupy.cuda.Device()
    key = (device.id, program)
    if key not in _MODULES:
        names = program.names()
        try:
            module = cupy.RawModule(code=program.source, options=("-std=c++17",), name_expressions=names)
            module.get_function(names[0])  # compiles now, not inside a step
        except Exception as err:  # noqa: BLE001 - any compiler or driver failure: fall back, say why
            warnings.warn(f"mpiopt's CUDA kernels did not compile on device {device.id} ({err}); cupy arrays take the array code", RuntimeWarning)
            _MODULES[key] = None
        else:
            flags = cupy.zeros(2, dtype=np.int32)
            _MODULES[key] = _Compiled(module, device.attributes["MultiProcessorCount"], flags[:1], flags[1:])
    return _MODULES[key]


def compiled(program: Program) -> bool:
    """Whether ``program``'s kernels run on the current device (compiling them on first use)."""
    return _device(program) is not None


def _launch(
    name: str, dtype: Optional[np.dtype], items: int, args: Tuple[Any, ...], flag: Optional[bool] = None,
    program: Program = UPDATE, blocks: Optional[int] = None,
) -> Optional[bool]:
    """Run kernel ``name<dtype>`` (``dtype`` None: plain ``name``) of ``program`` on ``args``; ``flag=True`` passes a reset flag
    and returns whether it was raised (syncs).  ``blocks`` fixes the grid; else enough for ``items`` threads, at most
    ``_BLOCKS_PER_SM`` per multiprocessor (the kernels stride over the rest)."""
    kernels = _device(program)
    if flag is not None:
        if flag:
            kernels.flag.fill(0)
        args += (kernels.flag if flag else kernels.scratch,)
    if blocks is None:
        blocks = min(-(-items // THREADS), kernels.multiprocessors * _BLOCKS_PER_SM)
    if items and blocks:  # an empty grid is a launch error
        kernels.module.get_function(name if dtype is None else f"{name}<{_TYPES[dtype]}>")((blocks,), (THREADS,), args)
    return bool(kernels.flag.get()[0]) if flag else None


def launch(program: Program, name: str, dtype: np.dtype, blocks: int, args: Tuple[Any, ...], flag: Optional[bool] = None) -> Optional[bool]:
    """Kernel ``name<dtype>`` of ``program`` on a grid of ``blocks`` blocks of ``THREADS`` threads (see ``_launch``'s ``flag``)."""
    return _launch(name, dtype, blocks, args, flag, program, blocks)


def _wide(*arrays: Any) -> bool:
    """Whether every one of ``arrays`` starts on a 16-byte boundary: the kernels then move whole 16-byte vectors."""
    return all(a.data.ptr % _WIDE == 0 for a in arrays)


def _items(x: Any, wide: bool) -> int:
    """Threads a kernel over ``x`` needs: one per 16-byte vector with ``wide`` (and one for a shorter tail), else one per element."""
    return -(-x.shape[0] // (_WIDE // x.dtype.itemsize)) if wide else x.shape[0]


def sgd(
    x: Any, g: Any, b: Optional[Any], copies: Tuple[Any, ...], merge: Optional[Tuple[Any, Any, int, Optional[float]]],
    divisor: int, lr: float, wd: float, mom: float, dampening: float, nesterov: bool, first: bool, check: bool,
) -> Optional[bool]:
    """``_updatec.sgd`` on the GPU (``merge`` as ``update._c_merge`` gives it); with ``check``, whether ``g`` is finite."""
    T = x.dtype.type
    snapshot, total, world, proportion = merge if merge is not None else (None, None, 1, None)
    rule = 0 if merge is None else 1 if proportion is None else 2
    p = 0.0 if proportion is None else proportion
    outputs = list(copies) + [x] * (2 - len(copies))
    args = (
        np.int64(x.shape[0]), x, g, x if b is None else b, *outputs, x if snapshot is None else snapshot, x if total is None else total,
        T(lr), T(wd), T(mom), T(1.0 - dampening), T(divisor), T(world), T(p), T(1.0 - p),
        *(np.int32(v) for v in (divisor != 1, len(copies), rule, wd != 0, mom != 0, first, dampening != 0 and not nesterov, nesterov)),
    )
    wide = _wide(x, g, *copies, *([b] if mom else []), *([total] if merge is not None else []), *([snapshot] if rule == 1 else []))
    bad = _launch("sgd", x.dtype, _items(x, wide), args + (np.int32(wide),), flag=check)
    return None if bad is None else not bad


def outer_sgd(
    x: Any, total: Any, b: Optional[Any], out: Optional[Any], world_size: int, lr: float, mom: float, alpha: float, nesterov: bool,
) -> None:
    """``_updatec.outer_sgd`` on the GPU (``b`` None without momentum, ``out`` None for no copy or mix)."""
    T = x.dtype.type
    wide = _wide(x, total, *([b] if mom else []), *([out] if out is not None else []))
    copy = 0 if out is None else 2 if alpha != 0.0 else 1
    args = (
        np.int64(x.shape[0]), x, total, x if b is None else b, x if out is None else out, T(world_size), T(lr), T(mom),
        T(alpha), T(1.0 - alpha), *(np.int32(v) for v in (mom != 0, nesterov and mom != 0, copy, wide)),
    )
    _launch("outer_sgd", x.dtype, _items(x, wide), args)


def merge_average(x: Any, snapshot: Optional[Any], total: Any, world_size: int, proportion: Optional[float]) -> None:
    """``_updatec.merge_average`` on the GPU (``proportion`` None: the delayed rule)."""
    T = x.dtype.type
    p = 0.0 if proportion is None else proportion
    rule = 1 if proportion is None else 2
    _launch("merge_average", x.dtype, x.shape[0], (np.int64(x.shape[0]), x, x if snapshot is None else snapshot, total, T(world_size), T(p), T(1.0 - p), np.int32(rule)))


def elastic_pull(x: Any, center: Any, total: Any, world_size: int, alpha: float, beta: float) -> None:
    """``_updatec.elastic_pull`` on the GPU."""
    T = x.dtype.type
    _launch("elastic_pull", x.dtype, x.shape[0], (np.int64(x.shape[0]), x, center, total, T(world_size), T(alpha), T(beta)))


def all_finite(x: Any) -> bool:
    """Whether every element of ``x`` is finite (one pass, then a sync to read the answer)."""
    wide = _wide(x)
    return not _launch("all_finite", x.dtype, _items(x, wide), (np.int64(x.shape[0]), x, np.int32(wide)), flag=True)


def pack_signs(x: Any, out: Any, check_nan: bool = True) -> bool:
    """Pack the signs of ``x`` into ``out``; with ``check_nan``, whether ``x`` holds a NaN (a sync), else False (none)."""
    T = x.dtype.type
    args = (np.int64(x.shape[0]), x, x, T(0), T(0), np.int32(0), out)
    return bool(_launch("pack_signs", x.dtype, x.shape[0], args, flag=check_nan))


def momentum_signs(m: Any, g: Any, beta: float, out: Any) -> None:
    """``m = m * beta + g * (1 - beta)``, then its signs packed into ``out``, in one pass (no sync)."""
    T = m.dtype.type
    args = (np.int64(m.shape[0]), m, g, T(beta), T(1.0 - beta), np.int32(1), out)
    _launch("pack_signs", m.dtype, m.shape[0], args, flag=False)


def apply_signs(packed: Any, x: Any, lr: float, decay: float) -> None:
    """``x = x * decay - lr * sign`` from the packed signs, in one pass."""
    T = x.dtype.type
    _launch("apply_signs", x.dtype, x.shape[0], (np.int64(x.shape[0]), packed, x, T(lr), T(decay), np.int32(decay != 1.0)))


def vote(rows: Any, voters: int, nbytes: int, threshold: int, out: Any) -> None:
    """``_signsc.vote`` on the GPU: bytes ``[0, nbytes)`` of ``out`` get the bitwise ``count >= threshold`` over the rows."""
    if not 0 <= threshold <= voters:  # the count has voters' bits: a higher threshold's would go unread
        raise ValueError(f"vote: threshold must be in [0, voters = {voters}], got {threshold}")
    stride, levels = rows.strides[0], int(voters).bit_length()
    aligned = rows.data.ptr % 8 == 0 and stride % 8 == 0 and out.data.ptr % 8 == 0
    args = (np.int64(voters), np.int64(stride), np.int64(nbytes), np.int64(threshold), np.int32(levels), np.int32(aligned), rows, out)
    _launch("vote", None, -(-nbytes // 8), args)
