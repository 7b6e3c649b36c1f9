"""GPU buffers through Comm: cupy arrays and torch CUDA tensors, staged and (where the MPI allows) direct.

Skipped, with the reason, on machines without a CUDA GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mpiopt.comm import Comm, gpu_aware_mpi

pytestmark = pytest.mark.mpi


def _cupy():
    try:
        import cupy

        return cupy if cupy.cuda.runtime.getDeviceCount() > 0 else None
    except Exception:  # noqa: BLE001 - no cupy, or no driver
        return None


BACKENDS = []
if torch.cuda.is_available():
    BACKENDS.append("torch")
if _cupy() is not None:
    BACKENDS.append("cupy")
MODES = [False] + ([True] if gpu_aware_mpi()[0] else [])

if not BACKENDS:
    pytest.skip("no CUDA GPU on this machine (GPU paths run on a GPU machine only)", allow_module_level=True)


def device_array(backend: str, host: np.ndarray):
    if backend == "torch":
        return torch.from_numpy(host).cuda()
    return _cupy().asarray(host)


def to_host(buf) -> np.ndarray:
    return buf.cpu().numpy() if isinstance(buf, torch.Tensor) else buf.get()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("gpu_aware", MODES)
def test_collectives_on_gpu_buffers(backend, gpu_aware):
    comm = Comm(gpu_aware=gpu_aware)
    P, r = comm.size, comm.rank
    n = 1 << 16
    host = (np.arange(n) % 97 + r).astype(np.float32)
    buf = device_array(backend, host)
    # Produce the data with a kernel on the current stream right before MPI reads it.
    buf *= 2
    comm.Allreduce(buf)
    expect = sum(2 * ((np.arange(n) % 97) + q) for q in range(P)).astype(np.float32)
    np.testing.assert_allclose(to_host(buf), expect)

    gathered = device_array(backend, np.zeros(8 * P, np.float32))
    comm.Allgather(device_array(backend, np.full(8, r, np.float32)), gathered)
    np.testing.assert_array_equal(to_host(gathered), np.repeat(np.arange(P), 8))

    root_data = device_array(backend, np.full(5, r, np.float32))
    comm.Bcast(root_data, root=P - 1)
    np.testing.assert_array_equal(to_host(root_data), np.full(5, P - 1))

    out = device_array(backend, np.zeros(n, np.float32))
    comm.Iallreduce(device_array(backend, np.ones(n, np.float32)), out=out).Wait()
    np.testing.assert_array_equal(to_host(out), np.full(n, P))
    assert comm.ledger["world.Allreduce"].bytes_sent == (4 * n if P > 1 else 0)
    comm.Free()
