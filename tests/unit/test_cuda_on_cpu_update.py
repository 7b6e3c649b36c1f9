"""The update program's CUDA kernels (``_cuda.UPDATE``) run on the CPU (``cuda_on_cpu.h``) against the C loops:
the fused SGD step, DaSGD's merge, EASGD's pull, DiLoCo's outer step, the finite check, the sign pack, vote and
apply, through ``_cuda``'s own wrappers where they have one (their arguments checked too), with aligned (whole
16-byte vectors) and misaligned arrays and lengths around a vector's and a grid-stride loop's turns.  A lent GPU
runs the same comparisons for real (tests/unit/test_cuda_kernels.py)."""

import numpy as np
import pytest

from mpiopt.kernels import _cuda, signs
from mpiopt.kernels.update import _updatec
from test_codecs import _same_bits_but_nans

pytestmark = pytest.mark.skipif(_updatec is None or signs._signsc is None, reason="the C loops are not built")

LENGTHS = (1, 3, 4, 5, 8, 1003)


@pytest.fixture
def kernels(emulated, monkeypatch):
    """``_cuda``'s wrappers on numpy arrays, their launches run on the CPU in at most 3 blocks (so the loops turn)."""

    def launch(name, dtype, items, args, flag=None, program=_cuda.UPDATE, blocks=None):
        if not items:
            return False if flag else None
        return emulated(program, name, dtype, blocks or min(-(-items // _cuda.THREADS), 3), args, flag)

    monkeypatch.setattr(_cuda, "_launch", launch)
    monkeypatch.setattr(_cuda, "_wide", lambda *arrays: all(a.ctypes.data % 16 == 0 for a in arrays))
    return _cuda


def _vectors(count, n, dtype, aligned, seed):
    """``count`` vectors of length n: normal values with +-0.0, subnormals and a large one, 16-byte aligned or not."""
    rng, out = np.random.default_rng(seed), []
    for _ in range(count):
        buffer = np.empty(n + 4 * 16, dtype)
        start = (-buffer.ctypes.data % 16) // buffer.itemsize + (0 if aligned else 1)
        v = buffer[start : start + n]
        v[...] = rng.standard_normal(n)
        v[::7], v[1::11], v[2::13] = 0.0, -0.0, np.finfo(dtype).tiny * 0.25
        v[n // 2] = 1e30
        out.append(v)
    return out


def _same(got, expected):
    return all(_same_bits_but_nans(None, a.shape[0], a, b) for a, b in zip(got, expected))


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "misaligned"])
def test_sgd_kernel_gives_the_c_loops_bits(dtype, aligned, kernels):
    """The fused step: weight decay, a divisor, momentum (first step and after, dampening, Nesterov), copies, the
    finite flag (an inf in the gradient) and both of DaSGD's merges."""
    cases = [  # divisor, wd, mom, dampening, nesterov, copies, merge (None, "delayed" or a proportion)
        (1, 0.0, 0.0, 0.0, False, 0, None), (4, 0.01, 0.9, 0.0, False, 1, None), (1, 0.0, 0.9, 0.1, False, 2, None),
        (2, 0.01, 0.9, 0.0, True, 0, None), (1, 0.0, 0.9, 0.0, False, 0, "delayed"), (3, 0.0, 0.0, 0.0, False, 0, 0.3),
    ]
    for n in LENGTHS:
        for case, (divisor, wd, mom, dampening, nesterov, copies, merge) in enumerate(cases):
            for first in (True, False):
                x, g, b, c, c2, snapshot, total = _vectors(7, n, dtype, aligned, n + case)
                if case == 1:
                    g[-1] = np.inf
                c_merge = None if merge is None else (snapshot, total, 4, None if merge == "delayed" else merge)
                ours = [a.copy() for a in (x, b, c, c2)]
                outputs = [c, c2][:copies] + [None] * (2 - copies)
                finite = _updatec.sgd(x, g, b if mom else None, *outputs, c_merge, divisor, 0.1, wd, mom, dampening, nesterov, first, 1)
                ours_merge = None if merge is None else (snapshot, total.copy(), 4, c_merge[3])
                got = kernels.sgd(ours[0], g, ours[1] if mom else None, tuple(ours[2:2 + copies]), ours_merge, divisor, 0.1, wd, mom,
                                  dampening, nesterov, first, True)
                assert got == finite == (case != 1), (n, case, first)
                assert _same(ours, [x, b, c, c2]), (n, case, first)


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "misaligned"])
def test_outer_step_merge_and_pull_kernels_give_the_c_loops_bits(dtype, aligned, kernels):
    """DiLoCo's outer step (momentum, Nesterov; no copy, a copy, Streaming DiLoCo's mix), two steps in a row; DaSGD's
    merge (both rules) and EASGD's pull."""
    for n in LENGTHS:
        for mom, nesterov in ((0.0, False), (0.9, False), (0.9, True)):
            for alpha, copy in ((0.0, False), (0.0, True), (0.3, True)):
                x, total, b, out = _vectors(4, n, dtype, aligned, n)
                b[...] = 0
                ours = [a.copy() for a in (x, b, out)]
                for _ in range(2):
                    _updatec.outer_sgd(x, total, b if mom else None, out if copy else None, 4.0, 0.7, mom, alpha, nesterov, 1)
                    kernels.outer_sgd(ours[0], total, ours[1] if mom else None, ours[2] if copy else None, 4, 0.7, mom, alpha, nesterov)
                assert _same(ours, [x, b, out]), (n, mom, nesterov, alpha, copy)
        for proportion in (None, 0.3):
            x, snapshot, total = _vectors(3, n, dtype, aligned, n + 1)
            ours = x.copy()
            _updatec.merge_average(x, snapshot, total, 4.0, proportion, 1)
            kernels.merge_average(ours, snapshot, total, 4, proportion)
            assert _same([ours], [x]), (n, proportion)
        x, center, total = _vectors(3, n, dtype, aligned, n + 2)
        ours = [x.copy(), center.copy()]
        _updatec.elastic_pull(x, center, total, 4.0, 0.1, 0.05, 1)
        kernels.elastic_pull(*ours, total, 4, 0.1, 0.05)
        assert _same(ours, [x, center]), n


@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "misaligned"])
def test_all_finite_kernel_finds_every_non_finite_entry(aligned, kernels):
    for dtype in (np.float32, np.float64):
        for n in LENGTHS:
            for at in sorted({0, n // 2, n - 1}):
                for bad in (None, np.inf, -np.inf, np.nan):
                    (x,) = _vectors(1, n, dtype, aligned, n)
                    if bad is not None:
                        x[at] = bad
                    assert kernels.all_finite(x) == _updatec.all_finite(x, 1) == (bad is None), (dtype, n, at, bad)


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
def test_pack_signs_kernel_gives_the_c_loops_bits(dtype, emulated):
    """pack_signs (a warp's ballot a word of signs), with and without Signum's momentum, against _signsc: the packed
    bytes (pad bits 0, nothing written past them), the momentum's bits and the NaN flag, at lengths around a warp's
    32 and a grid-stride loop's turns; +-0.0, subnormals, NaN."""
    T = np.dtype(dtype).type
    for n in (1, 7, 31, 32, 33, 1000, 5003):
        rng = np.random.default_rng(n)
        x, g = rng.standard_normal(n).astype(dtype), rng.standard_normal(n).astype(dtype)
        x[::5], x[1::7], x[2::11] = 0.0, -0.0, np.finfo(dtype).tiny * T(-0.25)
        for momentum, nan in ((False, False), (True, False), (False, True), (True, True)):
            v, nbytes = x.copy(), -(-n // 8)
            if nan:
                v[n // 2] = np.nan
            expect_v, expect = v.copy(), np.zeros(nbytes, np.uint8)
            if momentum:
                signs._signsc.momentum_signs(expect_v, g, n, v.dtype.itemsize, 0.9, expect, 1)
            else:
                signs._signsc.pack_signs(expect_v, n, v.dtype.itemsize, expect, 1)
            out = np.full(nbytes + 5, 0x55, np.uint8)
            args = (np.int64(n), v, g if momentum else v, T(0.9), T(1.0 - 0.9), np.int32(momentum), out)
            raised = emulated(_cuda.UPDATE, "pack_signs", dtype, 3, args, flag=True)  # 768 threads: loops for n = 5003
            assert out[:nbytes].tobytes() == expect.tobytes() and np.all(out[nbytes:] == 0x55), (n, momentum, nan)
            assert _same_bits_but_nans(None, n, v, expect_v) and raised == nan, (n, momentum, nan)


def test_vote_and_apply_signs_kernels_give_the_c_loops_bits(emulated):
    """vote (bit planes over P rows; aligned rows and not, ragged last word) and apply_signs (with and without decay)
    against _signsc's."""
    for voters, nbytes in ((1, 1), (2, 13), (3, 64), (7, 1001)):
        rng = np.random.default_rng(voters * nbytes)
        for width in (nbytes, -(-nbytes // 8) * 8 + 8):  # rows packed end to end, and 8-byte aligned rows
            rows = rng.integers(0, 256, (voters, width), dtype=np.uint8)
            threshold = (voters + 1) // 2
            expect, out = np.zeros(nbytes, np.uint8), np.full(nbytes + 3, 0x55, np.uint8)
            signs._signsc.vote(rows, voters, width, nbytes, threshold, expect)
            aligned = rows.ctypes.data % 8 == 0 and width % 8 == 0 and out.ctypes.data % 8 == 0
            args = (np.int64(voters), np.int64(width), np.int64(nbytes), np.int64(threshold), np.int32(voters.bit_length()), np.int32(aligned), rows, out)
            emulated(_cuda.UPDATE, "vote", None, 2, args)
            assert out[:nbytes].tobytes() == expect.tobytes() and np.all(out[nbytes:] == 0x55), (voters, nbytes, width)
    for dtype in (np.float32, np.float64):
        T, n = np.dtype(dtype).type, 1003
        packed = np.random.default_rng(n).integers(0, 256, -(-n // 8), dtype=np.uint8)
        x = np.random.default_rng(1).standard_normal(n).astype(dtype)
        for decay in (1.0, 0.999):
            expect, got = x.copy(), x.copy()
            signs._signsc.apply_signs(packed, n, x.dtype.itemsize, expect, 0.01, decay, 1)
            emulated(_cuda.UPDATE, "apply_signs", dtype, 2, (np.int64(n), packed, got, T(0.01), T(decay), np.int32(decay != 1.0)))
            assert got.tobytes() == expect.tobytes(), (dtype, decay)


def test_vote_refuses_a_threshold_over_the_voters():
    """The count has the voters' bits: a threshold above them would go unread (all ones), so both the kernel's wrapper
    and the C loop refuse it, naming it."""
    rows, out = np.zeros((3, 8), np.uint8), np.zeros(8, np.uint8)
    with pytest.raises(ValueError, match=r"threshold must be in \[0, voters = 3\], got 4"):
        _cuda.vote(rows, 3, 8, 4, out)
    with pytest.raises(ValueError, match="threshold=4"):
        signs._signsc.vote(rows, 3, 8, 8, 4, out)
    signs._signsc.vote(rows, 3, 8, 8, 3, out)  # every count is 0: below 3
    assert not out.any()
