"""Fixtures for the tests without MPI; the CUDA kernels run on the CPU (``emulated``, ``as_device``)."""

import ctypes
import os
import re
import shutil
import subprocess
import types

import numpy as np
import pytest

from mpiopt.kernels import _codecs_cuda, _codecs_dense_cuda, _cuda, threads
from mpiopt.kernels._backend import array_modules
from mpiopt.kernels.sparse import device, device_aggregation


@pytest.fixture(params=array_modules(), ids=lambda xp: xp.__name__)
def xp(request):
    """Each array module present: numpy, and cupy where a GPU is."""
    return request.param


@pytest.fixture
def kernel_threads():
    """Set the C kernels' thread count within a test (call it with the count); restored afterwards."""
    saved = threads.get_num_threads()
    yield threads.set_num_threads
    threads.set_num_threads(saved)


# ---- the CUDA kernels' own source on the CPU: a block's threads as fibers (cuda_on_cpu.h) ----------------------

HERE = os.path.dirname(os.path.abspath(__file__))
_CTYPES = {np.int64: ctypes.c_longlong, np.int32: ctypes.c_int, np.float32: ctypes.c_float, np.float64: ctypes.c_double}
_TYPES = {np.dtype(np.float32): "float", np.dtype(np.float64): "double", None: ""}


def _signature(program, name):
    """Kernel ``name``'s parameter list, whitespace collapsed."""
    match = re.search(r"__global__ void " + name + r"\((.*?)\)\s*\{", program.source, re.S)
    return " ".join(match.group(1).split())


def _shims(program):
    """A C launcher ``run_<kernel>_<type>(blocks, its parameters)`` for every kernel of ``program``, from its signature."""
    out = []
    for name, types_ in [(k, ("float", "double")) for k in program.templated] + [(k, ("",)) for k in program.plain]:
        params = _signature(program, name)
        for t in types_:
            typed = re.sub(r"\bT\b", t, params) if t else params
            names = ", ".join(re.findall(r"(\w+)\s*(?:,|$)", typed))
            call = f"{name}<{t}>" if t else name
            out.append(f'extern "C" void run_{name}_{t}(unsigned blocks, {typed}) {{ emu::launch(blocks, {_cuda.THREADS}, [=] {{ {call}({names}); }}); }}')
    return "\n".join(out)


@pytest.fixture(scope="session")
def emulated(tmp_path_factory):
    """Every CUDA program built for the CPU (tests/unit/cuda_on_cpu.h), once a session: a function ``launch(program, name, dtype, blocks, args, flag)``
    standing in for ``_cuda.launch`` (numpy arrays for cupy's)."""
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        pytest.skip("no C++ compiler (g++) to build the kernels for the CPU")
    folder = tmp_path_factory.mktemp("cuda_on_cpu")
    libraries = {}
    programs = (("select", device.SELECT), ("topk", _codecs_cuda.TOPK), ("dense", _codecs_dense_cuda.DENSE),
                ("aggregate", device_aggregation.AGGREGATE), ("update", _cuda.UPDATE))
    for key, program in programs:
        source = program.source.replace(_cuda.ROUNDING, "\nROUNDING_ON_CPU\n")
        assert "ROUNDING_ON_CPU" in source
        path = folder / f"{key}.cpp"
        path.write_text(f'#include "cuda_on_cpu.h"\n{source}\n{_shims(program)}\n')
        lib = folder / f"{key}.so"
        built = subprocess.run(
            [compiler, "-std=c++20", "-O1", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC", f"-I{HERE}", "-o", str(lib), str(path)],
            capture_output=True, text=True,
        )
        assert built.returncode == 0, built.stderr[-3000:]
        libraries[program] = ctypes.CDLL(str(lib))

    def launch(program, name, dtype, blocks, args, flag=None):
        args = list(args)
        if flag is not None:
            raised = np.zeros(1, np.int32)
            args.append(raised)
        function = getattr(libraries[program], f"run_{name}_{_TYPES[None if dtype is None else np.dtype(dtype)]}")
        pointers = ["*" in param for param in _signature(program, name).split(",")]
        # numpy's a[i] is a scalar where cupy's is a 0-d array: one that a pointer parameter takes becomes an array
        args = [np.asarray(a) if pointer and isinstance(a, np.generic) else a for a, pointer in zip(args, pointers)]
        converted = [ctypes.c_uint(blocks)]
        for a in args:
            converted.append(ctypes.c_void_p(a.ctypes.data) if isinstance(a, np.ndarray) else _CTYPES[type(a)](a))
        function(*converted)
        return bool(raised[0]) if flag else None

    return launch


@pytest.fixture
def as_device(emulated, monkeypatch):
    """numpy arrays taken for cupy ones by the kernels' wrappers, their launches run on the CPU."""
    monkeypatch.setattr(_cuda, "launch", emulated)
    monkeypatch.setattr(_cuda, "compiled", lambda program: True)
    monkeypatch.setattr(_codecs_cuda, "array_module", lambda a: types.SimpleNamespace())
    monkeypatch.setattr(_codecs_dense_cuda, "array_module", lambda a: types.SimpleNamespace())
    monkeypatch.setattr(device, "array_module", lambda a: types.SimpleNamespace())
    monkeypatch.setattr(_codecs_cuda, "_table", lambda table: table)
    return emulated
