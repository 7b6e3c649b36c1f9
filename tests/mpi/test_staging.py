"""Staging through Comm on host arrays: a world of one neither stages nor calls MPI; pipelined chunks give one call's bits."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mpi4py import MPI

from mpiopt.comm import Comm

pytestmark = pytest.mark.mpi


class NoMPI:
    """Stands in for the mpi4py communicator of a world of one: any call that would move data fails the test."""

    def __init__(self, comm):
        self._comm = comm

    def __getattr__(self, name):
        if name in ("Get_size", "Get_rank", "Free"):
            return getattr(self._comm, name)

        def called(*args, **kwargs):
            raise AssertionError(f"a world of one called MPI's {name}")

        return called


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("stage_host", [False, True])
def test_a_world_of_one_copies_locally(kind, stage_host, monkeypatch):
    comm = Comm(MPI.COMM_SELF, stage_host=stage_host)
    raw = comm._comm
    monkeypatch.setattr(comm, "_comm", NoMPI(raw))
    arr = (lambda a: torch.from_numpy(a)) if kind == "torch" else (lambda a: a)
    data = np.random.default_rng(0).standard_normal(1001).astype(np.float32)
    buf, out = arr(data.copy()), arr(np.zeros(1001, np.float32))
    comm.Allreduce(buf)
    comm.Allreduce(buf, out=out)
    comm.Iallreduce(buf, out=out).Wait()
    request = comm.Iallreduce(buf)
    assert request.Test()
    gathered, exchanged, scattered = (arr(np.zeros(1001, np.float32)) for _ in range(3))
    comm.Allgather(buf, gathered)
    comm.Iallgather(buf, gathered).Wait()
    comm.Alltoall(buf, exchanged)
    comm.Reduce_scatter(buf, scattered)
    comm.Bcast(buf)
    comm.Barrier()
    variable = arr(np.zeros(1005, np.float32))
    comm.Allgatherv(buf, variable, [1001])
    for result in (buf, out, gathered, exchanged, scattered, variable[:1001]):
        assert np.asarray(result).tobytes() == data.tobytes()
    assert comm.elect_min(3.0) == (3.0, 0)
    assert len(comm._staging) == 0
    totals = comm.ledger.total()
    assert (totals.bytes_sent, totals.bytes_recv) == (0, 0) and comm.ledger["world.Allreduce"].calls == 2
    assert str(comm.gpu_path()).startswith("world of one")
    monkeypatch.setattr(comm, "_comm", raw)
    comm.Free()


def rank_data(rank: int, n: int, dtype) -> np.ndarray:
    return np.random.default_rng(rank).standard_normal(n).astype(dtype) * 10.0 ** (rank - 2)


@pytest.mark.parametrize("n", [1, 7, 1000, 12_345])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_pipelined_chunks_give_the_bits_of_one_call(n, dtype):
    whole, staged = Comm(), Comm(stage_host=True, staging_chunk=4100)  # 4100: no multiple of 8, fewer items than 12,345
    P, r = whole.size, whole.rank
    data = rank_data(r, n, dtype)
    expect = data.copy()
    whole.Allreduce(expect)
    root_data = np.full(n, r, dtype)
    whole.Bcast(root_data, root=P - 1)

    in_place = data.copy()
    staged.Allreduce(in_place)
    out = np.zeros_like(data)
    staged.Allreduce(data, out=out, op=MPI.SUM)
    later = np.zeros_like(data)
    request = staged.Iallreduce(data, out=later)
    while not request.Test():
        pass
    torch_buf = torch.from_numpy(data.copy())
    staged.Iallreduce(torch_buf).Wait()
    bcast = np.full(n, r, dtype)
    staged.Bcast(bcast, root=P - 1)
    for result in (in_place, out, later, torch_buf.numpy()):
        assert result.tobytes() == expect.tobytes()
    assert bcast.tobytes() == root_data.tobytes()
    wire = n * np.dtype(dtype).itemsize if P > 1 else 0
    assert (staged.ledger["world.Allreduce"].calls, staged.ledger["world.Allreduce"].bytes_sent) == (2, 2 * wire)
    assert staged.ledger["world.Iallreduce"].bytes_recv == 2 * wire
    assert len(staged._staging) == (0 if P == 1 else 5)  # reused: two slots of Allreduce, two of Iallreduce (lane 0), Bcast's
    whole.Free()
    staged.Free()


def test_chunk_size_must_agree():
    from mpiopt.comm import SetupMismatchError

    if MPI.COMM_WORLD.size == 1:
        pytest.skip("one rank agrees with itself")
    with pytest.raises(SetupMismatchError, match="staging_chunk"):
        Comm(staging_chunk=4096 * (1 + MPI.COMM_WORLD.rank))
    with pytest.raises(ValueError, match="staging_chunk must be a positive number of bytes.* got 'x'"):
        Comm(staging_chunk="x")


def test_the_staging_benchmark_dry_run():
    from mpiopt.bench.staging import CASES, measure
    from mpiopt.comm import Topology

    topology = Topology()
    seconds = measure(topology, 40_000, 4096, 1, "cpu", "torch")
    assert sorted(seconds) == sorted(CASES) and all(len(s) == 1 and s[0] > 0 for s in seconds.values())
    topology.Free()


def _gpu_backends():
    backends = ["torch"] if torch.cuda.is_available() else []
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            backends.append("cupy")
    except Exception:  # noqa: BLE001 - no cupy, or no driver
        pass
    return backends


@pytest.mark.skipif(not _gpu_backends(), reason="no CUDA GPU on this machine (the CUDA paths run on a GPU machine only)")
@pytest.mark.parametrize("backend", _gpu_backends() or ["none"])
def test_gpu_buffers_staged_in_chunks_and_at_a_world_of_one(backend):
    def device(host):
        if backend == "torch":
            return torch.from_numpy(host).cuda()
        import cupy

        return cupy.asarray(host)

    def host(buf):
        return buf.cpu().numpy() if backend == "torch" else buf.get()

    whole, staged = Comm(), Comm(gpu_aware=False, staging_chunk=40_000)
    P, r = whole.size, whole.rank
    data = rank_data(r, 123_457, np.float32)
    expect = data.copy()
    whole.Allreduce(expect)
    buf = device(data / 2)
    buf *= 2  # a kernel on the current stream writes the buffer just before it is staged
    staged.Allreduce(buf)
    out = device(np.zeros_like(data))
    request = staged.Iallreduce(device(data), out=out)
    while not request.Test():
        pass
    bcast = device(np.full(1000, r, np.float32))
    staged.Bcast(bcast, root=P - 1)
    assert host(buf).tobytes() == expect.tobytes() and host(out).tobytes() == expect.tobytes()
    assert host(bcast).tobytes() == np.full(1000, P - 1, np.float32).tobytes()
    alone = Comm(MPI.COMM_SELF, gpu_aware=False)
    copied = device(np.zeros_like(data))
    alone.Allreduce(device(data), out=copied)
    assert host(copied).tobytes() == data.tobytes() and len(alone._staging) == 0
    for comm in (whole, staged, alone):
        comm.Free()
