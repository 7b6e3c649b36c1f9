"""The CUDA kernels (mpiopt.kernels._cuda) give the CPU's bits: each fused GPU pass against the C loop
(or numpy's passes) on a host copy of the same data, with NaN, +-inf, +-0.0 and subnormals, at awkward sizes.

Skipped, with the reason, on machines without cupy and a CUDA GPU.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from mpiopt.kernels import _cuda
from mpiopt.kernels._backend import array_modules
from mpiopt.kernels.signs import apply_signs, momentum_signs, pack_signs, packed_nbytes, sign_float
from mpiopt.kernels.update import Merge, all_finite, elastic_pull, fused_update_available, merge_average, sgd_update

if len(array_modules()) < 2:
    pytest.skip("no cupy with a CUDA GPU on this machine (the CUDA kernels run on a GPU machine only)", allow_module_level=True)

import cupy  # noqa: E402 - only where a GPU is

DTYPES = [np.float32, np.float64]
# Not multiples of 8, 64, the block (256) or a grid's stride; the last spans several grid strides.
SIZES = [1, 7, 9, 1000, 3 * 2**18 + 13]


def awkward(rng: np.random.Generator, d: int, dtype, scale: float = 1.0) -> np.ndarray:
    """Normal values with NaN, +-inf, +-0.0, subnormals and values near the smallest normal sprinkled in."""
    x = (rng.standard_normal(d) * scale).astype(dtype)
    info = np.finfo(dtype)
    tiny = np.array([0.0, -0.0, np.nan, np.inf, -np.inf, info.smallest_subnormal, -info.smallest_subnormal,
                     info.tiny / 3, -info.tiny / 5, info.tiny, -info.tiny * 1.5], dtype=dtype)
    where = rng.choice(d, size=min(d, 2 * len(tiny)), replace=False)
    x[where] = np.resize(tiny, len(where))
    return x


def subnormal_heavy(rng: np.random.Generator, d: int, dtype) -> np.ndarray:
    """Values around the smallest normal, so products and sums land among the subnormals."""
    info = np.finfo(dtype)
    return (rng.standard_normal(d) * float(info.tiny) * 4).astype(dtype)


def same_bits(gpu, host: np.ndarray) -> None:
    """``gpu`` (cupy) holds ``host``'s bits, NaN payloads aside."""
    got = gpu.get()
    assert got.dtype == host.dtype and got.shape == host.shape
    nan = np.isnan(host)
    np.testing.assert_array_equal(np.isnan(got), nan)
    kind = {4: np.uint32, 8: np.uint64}[host.dtype.itemsize]
    mismatch = np.flatnonzero(got.view(kind)[~nan] != host.view(kind)[~nan])
    assert mismatch.size == 0, f"{mismatch.size} elements differ, first at {mismatch[:5]}: {got[~nan][mismatch[:5]]} vs {host[~nan][mismatch[:5]]}"


def test_the_kernels_take_contiguous_cupy_floats_only():
    x = cupy.zeros(10, dtype=np.float32)
    assert _cuda.takes(x) and fused_update_available(x)
    assert not _cuda.takes(x[::2]) and not _cuda.takes(x.astype(np.float16)) and not _cuda.takes(np.zeros(10, np.float32))


UPDATE_CASES = [
    dict(momentum=m, nesterov=n, dampening=dp, weight_decay=wd, first_step=f, grad_divisor=p)
    for m, n, dp, wd, f, p in itertools.product([0.0, 0.9], [False, True], [0.0, 0.1], [0.0, 1e-3], [False, True], [1, 3])
    if not (n and (dp or not m)) and not (f and not m)
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", SIZES)
@pytest.mark.parametrize("case", UPDATE_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_sgd_update_is_the_cpu_bits(d, dtype, case):
    rng = np.random.default_rng(d)
    x, g, b = awkward(rng, d, dtype), awkward(rng, d, dtype, 3.0), awkward(rng, d, dtype)
    if d > 100:  # a stretch where every result is subnormal or near it
        x[:64], g[:64], b[:64] = (subnormal_heavy(rng, 64, dtype) for _ in range(3))
    gx, gg, gb = (cupy.asarray(a) for a in (x, g, b))
    kwargs = dict(lr=0.05, check_finite=True, **case)
    work = []
    finite_gpu = sgd_update(gx, gg, gb, work=work, **kwargs)
    finite_cpu = sgd_update(x, g, b, **kwargs)
    assert finite_gpu is finite_cpu is bool(np.isfinite(g).all())
    assert work == []  # one pass: no scratch
    same_bits(gx, x)
    same_bits(gb, b)
    same_bits(gg, g)  # unchanged


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offsets", [(0, 0, 0, 0, 0), (1, 0, 0, 0, 0), (0, 1, 0, 0, 0), (0, 0, 3, 0, 0), (0, 0, 0, 1, 0),
                                     (0, 0, 0, 0, 1), (3, 3, 3, 3, 3)])
@pytest.mark.parametrize("merge", [False, True])
def test_sgd_update_on_unaligned_views(dtype, offsets, merge):
    # The kernel moves 16-byte vectors only where every array it touches is 16-byte aligned; views
    # that start 1 or 3 elements into a buffer take the one-element path, with the same bits.
    # The arrays: x, g, b, then the copy (or, with the merge, the snapshot) and the merge's total.
    d = 1001
    rng = np.random.default_rng(sum(offsets))
    host = [awkward(rng, d, dtype) for _ in range(5)]
    gpu = []
    for arr, offset in zip(host, offsets):
        buffer = cupy.empty(d + offset, dtype=dtype)
        buffer[offset:] = cupy.asarray(arr)
        gpu.append(buffer[offset:])
    for arrays in (gpu, host):
        x, g, b, fourth, total = arrays
        more = dict(merge=Merge(fourth, total, 3, "delayed")) if merge else dict(copy_to=fourth)
        sgd_update(x, g, b, lr=0.1, momentum=0.9, weight_decay=1e-2, grad_divisor=3, **more)
    for got, expect in zip(gpu[:4], host[:4]):  # the total is scratch: the fused passes leave it, the array code not
        same_bits(got, expect)


def test_a_failed_compilation_falls_back_to_the_array_code(monkeypatch):
    # Where NVRTC cannot build the kernels, cupy arrays take the array code, with a warning once.
    def refuse(*args, **kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(_cuda, "_MODULES", {})
    monkeypatch.setattr(cupy, "RawModule", refuse)
    x = cupy.arange(10, dtype=np.float32)
    with pytest.warns(RuntimeWarning, match="did not compile.*no compiler here"):
        assert not _cuda.takes(x)
    assert not fused_update_available(x) and all_finite(x)
    sgd_update(x, cupy.ones(10, np.float32), lr=0.5)
    np.testing.assert_array_equal(x.get(), np.arange(10, dtype=np.float32) - 0.5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", SIZES)
@pytest.mark.parametrize("copies", [0, 1, 2])
@pytest.mark.parametrize("rule", [None, "delayed", "proportion"])
def test_sgd_update_copies_merge_and_finite_flag(d, dtype, copies, rule):
    if copies and rule:
        pytest.skip("copy_to and merge exclude each other")
    rng = np.random.default_rng(d + 1)
    host = {k: rng.standard_normal(d).astype(dtype) for k in ("x", "g", "b", "snapshot", "total")}
    host["x"][:1] = np.finfo(dtype).smallest_subnormal
    gpu = {k: cupy.asarray(v) for k, v in host.items()}
    results = []
    for arrays in (host, gpu):
        xp = np if arrays is host else cupy
        outs = [xp.full(d, 7, dtype=dtype) for _ in range(copies)]
        merge = Merge(arrays["snapshot"], arrays["total"], 3, rule, 0.3) if rule else None
        finite = sgd_update(arrays["x"], arrays["g"], arrays["b"], lr=0.1, momentum=0.9, weight_decay=1e-2, grad_divisor=4,
                            check_finite=True, copy_to=outs or None, merge=merge)
        results.append((finite, outs))
    assert results[0][0] is results[1][0] is True
    for name in ("x", "b"):  # the total is scratch: the fused passes leave it, the array code not
        same_bits(gpu[name], host[name])
    for cpu_copy, gpu_copy in zip(results[0][1], results[1][1]):
        same_bits(gpu_copy, cpu_copy)
        same_bits(gpu_copy, host["x"])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", SIZES)
@pytest.mark.parametrize("rule, proportion", [("delayed", 0.25), ("proportion", 0.25), ("proportion", 0.7)])
def test_merge_average_is_the_cpu_bits(d, dtype, rule, proportion):
    rng = np.random.default_rng(d + 2)
    host = [awkward(rng, d, dtype) for _ in range(3)]
    gpu = [cupy.asarray(a) for a in host]
    merge_average(*gpu, 4, rule, proportion)
    merge_average(*host, 4, rule, proportion)
    same_bits(gpu[0], host[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", SIZES)
def test_elastic_pull_is_the_cpu_bits(d, dtype):
    rng = np.random.default_rng(d + 3)
    host = [awkward(rng, d, dtype) for _ in range(3)]
    if d > 100:
        for a in host:
            a[:64] = subnormal_heavy(rng, 64, dtype)
    gpu = [cupy.asarray(a) for a in host]
    elastic_pull(*gpu, 3, 0.05, 0.3)
    elastic_pull(*host, 3, 0.05, 0.3)
    same_bits(gpu[0], host[0])
    same_bits(gpu[1], host[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0, 1])  # 1: an unaligned view, read one element at a time
def test_all_finite_is_exact_everywhere(dtype, offset):
    d = 3 * 2**18 + 13
    x = cupy.asarray(np.random.default_rng(4).standard_normal(d + offset).astype(dtype))[offset:]
    x[:5] = cupy.asarray(np.array([np.finfo(dtype).max, -np.finfo(dtype).max, np.finfo(dtype).smallest_subnormal, 0.0, -0.0], dtype=dtype))
    assert all_finite(x)
    for position in (0, 1, 255, 256, d // 2, d - 1):
        for bad in (np.nan, np.inf, -np.inf):
            saved = x[position].copy()
            x[position] = bad
            assert not all_finite(x), (position, bad)
            x[position] = saved
    assert all_finite(x[:0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", SIZES)
def test_signs_are_the_cpu_bits(d, dtype):
    rng = np.random.default_rng(d + 5)
    x = awkward(rng, d, dtype)
    x[np.isnan(x)] = 1.0
    np.testing.assert_array_equal(pack_signs(cupy.asarray(x)).get(), pack_signs(x))
    np.testing.assert_array_equal(sign_float(cupy.asarray(x)).get(), sign_float(x))
    with pytest.raises(ValueError, match="NaN"):
        pack_signs(cupy.asarray(np.where(np.arange(d) == d - 1, np.nan, x).astype(dtype)))

    m, g = awkward(rng, d, dtype), awkward(rng, d, dtype)
    gm, gg = cupy.asarray(m), cupy.asarray(g)
    out_gpu, out_cpu = cupy.full(packed_nbytes(d), 0xFF, dtype=np.uint8), np.empty(packed_nbytes(d), np.uint8)
    momentum_signs(gm, gg, 0.9, out_gpu)
    momentum_signs(m, g, 0.9, out_cpu)
    same_bits(gm, m)
    np.testing.assert_array_equal(out_gpu.get(), out_cpu)  # pad bits 0 too

    for decay in (1.0, 0.999):
        y = awkward(rng, d, dtype)
        gy = cupy.asarray(y)
        apply_signs(out_gpu, gy, 0.01, decay)
        apply_signs(out_cpu, y, 0.01, decay)
        same_bits(gy, y)


def test_negative_subnormals_and_zeros_sign_as_on_the_cpu():
    x = np.array([0.0, -0.0, -1e-45, 1e-45, -np.inf, np.inf, -1e-40, 1e-40], dtype=np.float32)
    np.testing.assert_array_equal(sign_float(cupy.asarray(x)).get(), [1, 1, -1, 1, -1, 1, -1, 1])
