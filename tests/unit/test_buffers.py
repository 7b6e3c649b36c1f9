"""Buffer adaptation: zero-copy CPU paths, staging of GPU arrays, GPU-awareness flags."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mpiopt.comm.buffers import HostStaging, as_mpi_buffer, is_gpu_array, nbytes


def adapt(buf, gpu_aware=False, read=True, write=True):
    return as_mpi_buffer(buf, gpu_aware=gpu_aware, staging=HostStaging(), slot="s", read=read, write=write)


def test_numpy_passes_through_without_copy():
    a = np.arange(10, dtype=np.float32)
    out, writeback = adapt(a)
    assert out is a and writeback is None


def test_torch_cpu_is_a_zero_copy_view():
    t = torch.arange(6, dtype=torch.float32, requires_grad=True)
    out, writeback = adapt(t)
    assert writeback is None and isinstance(out, np.ndarray)
    out[0] = 42.0
    assert t[0].item() == 42.0
    assert nbytes(t) == 24 and not is_gpu_array(t)


def test_non_contiguous_rejected():
    with pytest.raises(ValueError, match="C-contiguous"):
        adapt(np.zeros((3, 3))[:, 1])
    with pytest.raises(ValueError, match="contiguous"):
        adapt(torch.zeros(3, 3).t())


def test_unsupported_type_and_dtype():
    with pytest.raises(TypeError, match="numpy/cupy array or a torch tensor"):
        nbytes([1, 2])


def test_staging_grows_and_reuses():
    staging = HostStaging()
    a = staging.get("x", 100)
    b = staging.get("x", 50)
    assert a.nbytes == 100 and b.nbytes == 50 and np.shares_memory(a, b)
    c = staging.get("x", 1000)
    assert c.nbytes == 1000


def _gpu():
    try:
        import cupy  # noqa: F401

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001
        return torch.cuda.is_available()


needs_gpu = pytest.mark.skipif(not _gpu(), reason="no CUDA GPU on this machine (the CUDA paths run on a GPU machine only)")


@needs_gpu
@pytest.mark.parametrize("gpu_aware", [False, True])
def test_torch_cuda_staging_round_trip(gpu_aware):
    t = torch.arange(8, dtype=torch.float32, device="cuda")
    out, writeback = adapt(t, gpu_aware=gpu_aware)
    if gpu_aware:
        assert writeback is None and out.is_cuda
        return
    assert isinstance(out, np.ndarray)
    np.testing.assert_array_equal(out, np.arange(8))
    out[:] = -1
    writeback()
    assert torch.all(t == -1).item()


@needs_gpu
def test_cupy_staging_round_trip():
    cupy = pytest.importorskip("cupy")
    a = cupy.arange(8, dtype=cupy.float32)
    out, writeback = adapt(a)
    np.testing.assert_array_equal(out, np.arange(8))
    out[:] = 3
    writeback()
    assert bool((a == 3).all())
