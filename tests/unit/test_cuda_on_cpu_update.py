"""The update program's CUDA kernels (``_cuda.UPDATE``) run on the CPU (``cuda_on_cpu.h``) against the C loops: the
sign pack, vote and apply.  A lent GPU runs the same comparisons for real (tests/unit/test_signs.py)."""

import numpy as np
import pytest

from mpiopt.kernels import _cuda, signs
from test_codecs import _same_bits_but_nans

pytestmark = pytest.mark.skipif(signs._signsc is None, reason="the C loops are not built")


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
