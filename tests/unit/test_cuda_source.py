"""The CUDA kernels compile, every kernel for every dtype, without a GPU: NVRTC (the compiler CuPy uses) from the
nvidia-cuda-nvrtc-cu12 wheel of the test extra.  Their bits are checked against the C loops where a GPU is lent
(tests/unit/test_cuda_kernels.py, the suite's ``xp`` fixture)."""

import ctypes
import glob
import os

import pytest

from mpiopt.kernels import _codecs_cuda, _codecs_dense_cuda, _cuda
from mpiopt.kernels.sparse.device import SELECT
from mpiopt.kernels.sparse.device_aggregation import AGGREGATE

# The GPUs users train on: A100 (sm_80), H100 and H200 (sm_90).
ARCHITECTURES = ("compute_80", "compute_90")


def nvrtc():
    """libnvrtc from the nvidia-cuda-nvrtc-cu12 wheel, or a skip naming what is missing."""
    try:
        import nvidia.cuda_nvrtc
    except ImportError:
        pytest.skip("no NVRTC: pip install nvidia-cuda-nvrtc-cu12 (in mpiopt[test] on Linux x86-64)")
    paths = [p for folder in nvidia.cuda_nvrtc.__path__ for p in glob.glob(os.path.join(folder, "lib", "libnvrtc.so*"))]
    if not paths:
        pytest.skip(f"nvidia.cuda_nvrtc has no lib/libnvrtc.so* under {list(nvidia.cuda_nvrtc.__path__)}")
    return ctypes.CDLL(sorted(paths)[0])


def compile_kernels(lib, source, names, architecture):
    """NVRTC's result code, its log and the PTX's size for ``source`` with every name in ``names`` instantiated."""
    program = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(program), source.encode(), b"mpiopt_kernels.cu", 0, None, None) == 0
    try:
        for name in names:
            assert lib.nvrtcAddNameExpression(program, name.encode()) == 0, name
        options = [f"--gpu-architecture={architecture}".encode(), b"-std=c++17"]
        result = lib.nvrtcCompileProgram(program, len(options), (ctypes.c_char_p * len(options))(*options))
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(program, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(program, log)
        ptx = ctypes.c_size_t()
        if result == 0:
            assert lib.nvrtcGetPTXSize(program, ctypes.byref(ptx)) == 0
        return result, log.value.decode(errors="replace"), ptx.value
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(program))


@pytest.mark.parametrize("program", [_cuda.UPDATE, SELECT, _codecs_cuda.TOPK, _codecs_dense_cuda.DENSE, AGGREGATE], ids=["update", "select", "topk-codec", "dense-codecs", "aggregate"])
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_every_kernel_compiles_for_every_dtype(architecture, program):
    lib = nvrtc()
    names = program.names()
    result, log, ptx = compile_kernels(lib, program.source, names, architecture)
    assert result == 0, f"the CUDA kernels do not compile for {architecture}:\n{log}"
    assert ptx > 1000 * len(names), f"PTX of {ptx} bytes for {len(names)} kernels"


def test_a_broken_kernel_is_caught():
    """The check fails where it should: a kernel that does not compile is reported with NVRTC's log."""
    lib = nvrtc()
    result, log, _ = compile_kernels(lib, _cuda._SOURCE + "\n__global__ void broken() { undeclared(); }\n", [], "compute_90")
    assert result != 0 and "undeclared" in log


def test_a_block_has_a_thread_for_every_bin_of_the_radix_select():
    """kth_key_ (the one-block selections: chunk_topk, topk's codec) gives each of its 256 bins a thread."""
    assert _cuda.THREADS >= 256 and _cuda.THREADS % 32 == 0 and _cuda.THREADS <= 1024
