"""Comm: results of every wrapped call, and ledger bytes equal to the buffer sizes."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from mpi4py import MPI

from mpiopt.comm import Comm, SetupMismatchError
from mpiopt.comm import waiting
from mpiopt.comm.ledger import NONBLOCKING_OPS

pytestmark = pytest.mark.mpi


@pytest.fixture
def comm():
    c = Comm()
    yield c
    c.Free()


def one(ledger, op):
    """The single recorded call of ``op`` (asserting there was exactly one)."""
    stats = ledger[f"world.{op}"]
    assert stats.calls == 1, f"{op}: {stats.calls} calls recorded"
    return stats.bytes_sent, stats.bytes_recv


def rank_data(rank: int, n: int, dtype=np.float32) -> np.ndarray:
    return (np.arange(n) + 1000 * rank).astype(dtype)


@pytest.mark.parametrize("n", [1, 13, 1000])
@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_allreduce(comm, n, kind):
    P, r = comm.size, comm.rank
    data = rank_data(r, n)
    buf = torch.from_numpy(data.copy()) if kind == "torch" else data.copy()
    comm.Allreduce(buf)
    expect = sum(rank_data(q, n, np.float64) for q in range(P))
    out = np.zeros(n, np.float32)
    comm.Allreduce(data, out=out, op=MPI.MAX)
    result = buf.numpy() if kind == "torch" else buf
    np.testing.assert_allclose(result, expect, rtol=1e-6)
    np.testing.assert_array_equal(out, rank_data(P - 1, n))
    stats = comm.ledger["world.Allreduce"]
    wire = 4 * n if P > 1 else 0
    assert (stats.calls, stats.bytes_sent, stats.bytes_recv) == (2, 2 * wire, 2 * wire)


def test_iallreduce_records_on_completion(comm):
    P = comm.size
    buf = rank_data(comm.rank, 100)
    out = np.empty_like(buf)
    req = comm.Iallreduce(buf, out=out)
    while not req.Test():
        pass
    req.Wait()  # a second completion is a no-op
    np.testing.assert_allclose(out, sum(rank_data(q, 100, np.float64) for q in range(P)))
    assert one(comm.ledger, "Iallreduce") == ((400, 400) if P > 1 else (0, 0))
    assert comm.ledger["world.Iallreduce"].seconds > 0


def test_allgather_and_allgatherv(comm):
    P, r = comm.size, comm.rank
    send = np.full(7, r, dtype=np.uint8)
    recv = np.empty(7 * P, dtype=np.uint8)
    comm.Allgather(send, recv)
    np.testing.assert_array_equal(recv, np.repeat(np.arange(P), 7))
    assert one(comm.ledger, "Allgather") == ((7 if P > 1 else 0), 7 * (P - 1))

    counts = [q + 1 for q in range(P)]
    sendv = np.full(counts[r], r, dtype=np.int32)
    recvv = np.empty(sum(counts), dtype=np.int32)
    comm.Allgatherv(sendv, recvv, counts)
    np.testing.assert_array_equal(recvv, np.repeat(np.arange(P), counts))
    assert one(comm.ledger, "Allgatherv") == ((4 * counts[r] if P > 1 else 0), 4 * (sum(counts) - counts[r]))


def test_alltoall_and_alltoallv(comm):
    P, r = comm.size, comm.rank
    send = (np.arange(P * 3) + 100 * r).astype(np.float64)
    recv = np.empty_like(send)
    comm.Alltoall(send, recv)
    expect = np.concatenate([(np.arange(3) + 3 * r + 100 * q) for q in range(P)])
    np.testing.assert_array_equal(recv, expect)
    assert one(comm.ledger, "Alltoall") == (8 * 3 * (P - 1),) * 2

    # Rank r sends q+1 copies of r to rank q.
    sendcounts = [q + 1 for q in range(P)]
    sendv = np.full(sum(sendcounts), r, dtype=np.int64)
    recvcounts = [r + 1] * P
    recvv = np.empty(sum(recvcounts), dtype=np.int64)
    comm.Alltoallv(sendv, sendcounts, recvv, recvcounts)
    np.testing.assert_array_equal(recvv, np.repeat(np.arange(P), r + 1))
    assert one(comm.ledger, "Alltoallv") == (8 * (sum(sendcounts) - sendcounts[r]), 8 * (r + 1) * (P - 1))


def test_reduce_scatter(comm):
    P, r = comm.size, comm.rank
    send = np.arange(P * 5, dtype=np.float32) * (r + 1)
    recv = np.empty(5, dtype=np.float32)
    comm.Reduce_scatter(send, recv)
    total = P * (P + 1) / 2
    np.testing.assert_allclose(recv, np.arange(5 * r, 5 * r + 5) * total)
    assert one(comm.ledger, "Reduce_scatter") == (20 * (P - 1),) * 2


@pytest.mark.parametrize("root_from_end", [0, 1])
def test_bcast(comm, root_from_end):
    P, r = comm.size, comm.rank
    root = max(0, P - 1 - root_from_end)
    buf = np.full(11, r, dtype=np.float32)
    comm.Bcast(buf, root=root)
    np.testing.assert_array_equal(buf, np.full(11, root))
    n = 44 if P > 1 else 0
    assert one(comm.ledger, "Bcast") == ((n, 0) if r == root else (0, n))


def test_elect_min_ties_to_lowest_rank(comm):
    P, r = comm.size, comm.rank
    value, leader = comm.elect_min(5.0 if r % 2 else 1.0)
    assert (value, leader) == (1.0, 0)
    value, leader = comm.elect_min(float("nan") if r == 0 else float(P - r))
    assert (value, leader) == ((1.0, P - 1) if P > 1 else (np.inf, 0))
    assert comm.ledger["world.elect_min"].bytes_sent == (2 * 16 if P > 1 else 0)


def test_point_to_point_ring(comm):
    P, r = comm.size, comm.rank
    send = np.full(9, r, dtype=np.float32)
    recv = np.empty(9, dtype=np.float32)
    rreq = comm.Irecv(recv, source=(r - 1) % P, tag=3)
    sreq = comm.Isend(send, dest=(r + 1) % P, tag=3)
    sreq.Wait()
    rreq.Wait()
    np.testing.assert_array_equal(recv, np.full(9, (r - 1) % P))
    assert one(comm.ledger, "Isend") == (36, 0)
    assert one(comm.ledger, "Irecv") == (0, 36)


def test_object_variants(comm):
    P, r = comm.size, comm.rank
    assert comm.allreduce_obj(r + 1) == P * (P + 1) // 2
    assert comm.allgather_obj(("r", r)) == [("r", q) for q in range(P)]
    assert comm.bcast_obj({"x": r} if r == 0 else None) == {"x": 0}
    assert comm.ledger["world.allgather_obj"].calls == 1


def test_ledger_totals_and_reset(comm):
    P = comm.size
    comm.Allreduce(np.ones(10, np.float32))
    totals = comm.ledger_totals()
    wire = 40 * P if P > 1 else 0
    assert (totals["world.Allreduce"].calls, totals["world.Allreduce"].bytes_sent) == (P, wire)
    before = comm.ledger.snapshot()
    comm.Allreduce(np.ones(3, np.float64))
    delta = comm.ledger.since(before)
    assert list(delta) == ["world.Allreduce"] and delta.bytes_sent == (24 if P > 1 else 0)
    comm.ledger.reset()
    assert comm.ledger.total().calls == 0


def test_bad_arguments_name_the_problem(comm):
    with pytest.raises(ValueError, match="root must be a rank"):
        comm.Bcast(np.zeros(2), root=comm.size)
    with pytest.raises(ValueError, match="recvbuf has"):
        comm.Allgather(np.zeros(2), np.zeros(2 * comm.size + 1))
    with pytest.raises(ValueError, match="C-contiguous"):
        comm.Allreduce(np.zeros((4, 4))[:, 0])
    with pytest.raises(TypeError, match="numpy/cupy array or a torch tensor"):
        comm.Allreduce([1.0, 2.0])


def test_agree_passes_when_equal(comm):
    comm.agree({"num_params": 10, "dtype": "float32", "algorithm": "sgd", "hyper": {"lr": 0.1}})


@pytest.mark.mpi(min_size=2)
def test_agree_mismatch_same_error_on_every_rank(comm):
    r = comm.rank
    sig = {"num_params": 1000 + (r == 1), "dtype": "float32", "algorithm": "sgd", "hyper": {"lr": 0.1}}
    with pytest.raises(SetupMismatchError) as err:
        comm.agree(sig, what="test set-up")
    message = str(err.value)
    everyone = comm.allgather_obj(message)
    assert all(m == message for m in everyone), everyone
    assert "num_params" in message and "rank 1: 1001" in message and "rank 0: 1000" in message
    assert "dtype" not in message


def test_gpu_aware_override(comm, monkeypatch):
    from mpiopt.comm.buffers import gpu_aware_mpi

    assert gpu_aware_mpi(True) == (True, "argument")
    monkeypatch.setenv("MPIOPT_GPU_AWARE", "0")
    assert gpu_aware_mpi() == (False, "MPIOPT_GPU_AWARE=0")
    monkeypatch.setenv("MPIOPT_GPU_AWARE", "maybe")
    with pytest.raises(ValueError, match="MPIOPT_GPU_AWARE"):
        gpu_aware_mpi()


def test_a_cuda_aware_answer_without_the_driver_is_staged(comm, monkeypatch):
    """MPIX_Query_cuda_support's 1 (Open MPI 4.1's is compiled in) counts only where the CUDA driver loads."""
    import ctypes

    from mpiopt.comm import buffers

    monkeypatch.delenv("MPIOPT_GPU_AWARE", raising=False)

    class Library:  # an MPI library whose MPIX_Query_cuda_support answers 1; the driver as named below
        def __init__(self, name):
            if name == "libnothere.so.1":
                raise OSError(f"{name}: cannot open shared object file")
            self.MPIX_Query_cuda_support = lambda: 1

    monkeypatch.setattr(ctypes, "CDLL", Library)
    monkeypatch.setattr(buffers, "_CUDA_DRIVER", "libnothere.so.1")
    aware, reason = buffers.gpu_aware_mpi()
    assert not aware and "libnothere.so.1 does not load" in reason
    monkeypatch.setattr(buffers, "_CUDA_DRIVER", "libthere.so.1")
    assert buffers.gpu_aware_mpi() == (True, "MPIX_Query_cuda_support")


def test_requests_in_flight_get_their_own_staging_lanes(comm):
    """Two nonblocking calls of one kind in flight use different staging buffers; a finished lane is reused."""
    P, r = comm.size, comm.rank
    sends = [np.full(5, 10 * r + j, np.float32) for j in range(2)]
    recvs = [np.empty(5, np.float32) for _ in range(2)]
    first = [comm.Irecv(recvs[j], source=(r - 1) % P, tag=j) for j in range(2)]
    assert comm._busy_lanes["Irecv"] == {0, 1}
    for j in range(2):
        comm.Isend(sends[j], dest=(r + 1) % P, tag=j).Wait()
    for req in first:
        req.Wait()
    assert comm._busy_lanes["Irecv"] == set() and comm._busy_lanes["Isend"] == set()
    for j in range(2):
        np.testing.assert_array_equal(recvs[j], 10 * ((r - 1) % P) + j)


def test_nonblocking_allgather_and_alltoall_match_the_blocking_ones(comm):
    """Iallgather/Ialltoall in flight together: the blocking calls' results and ledger bytes, under their own names."""
    P, r = comm.size, comm.rank
    send_g = np.full(7, r, dtype=np.uint8)
    recv_g = np.empty(7 * P, dtype=np.uint8)
    send_a = (np.arange(P * 3) + 100 * r).astype(np.float64)
    recv_a = np.empty_like(send_a)
    requests = [comm.Iallgather(send_g, recv_g), comm.Ialltoall(send_a, recv_a)]
    for req in reversed(requests):  # completion order need not be posting order
        req.Wait()
    np.testing.assert_array_equal(recv_g, np.repeat(np.arange(P), 7))
    np.testing.assert_array_equal(recv_a, np.concatenate([(np.arange(3) + 3 * r + 100 * q) for q in range(P)]))
    assert one(comm.ledger, "Iallgather") == ((7 if P > 1 else 0), 7 * (P - 1))
    assert one(comm.ledger, "Ialltoall") == (8 * 3 * (P - 1),) * 2
    assert "world.Allgather" not in comm.ledger.ops and "world.Alltoall" not in comm.ledger.ops
    for op in ("Iallgather", "Ialltoall"):
        assert op in NONBLOCKING_OPS
        assert comm.ledger[f"world.{op}"].seconds >= comm.ledger[f"world.{op}"].wait_seconds >= 0


def test_nonblocking_gathers_check_sizes(comm):
    with pytest.raises(ValueError, match="recvbuf has 3 bytes; expected size x sendbuf"):
        comm.Iallgather(np.zeros(2, np.uint8), np.zeros(3, np.uint8))
    with pytest.raises(ValueError, match="Alltoall needs equal send and receive sizes"):
        comm.Ialltoall(np.zeros(2 * comm.size, np.uint8), np.zeros(2 * comm.size + 1, np.uint8))


def test_a_sleeping_barrier_waits_for_the_last_rank_and_sleeps_meanwhile(comm):
    """``Barrier(sleeping=True)``: no rank leaves before rank 0 arrives 0.5 s late; the ranks waiting for it use a
    small part of that time on a CPU (MPICH's blocking Barrier spins through all of it); one Ibarrier of 0 bytes."""
    late = 0.5
    comm.Barrier()
    cpu, wall = time.process_time(), time.perf_counter()
    if comm.rank == 0:
        time.sleep(late)
    comm.Barrier(sleeping=True)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    assert one(comm.ledger, "Ibarrier") == (0, 0)
    assert comm.ledger["world.Ibarrier"].wait_seconds > 0 or comm.size == 1
    if comm.size > 1 and comm.rank != 0:
        assert wall > 0.8 * late
        assert cpu < 0.25 * wall, f"{cpu:.3f} s on a CPU while waiting {wall:.3f} s"


def test_sub_communicators_inherit_the_wait_policy():
    for policy in ("active", "passive"):
        c = Comm(wait_policy=policy)
        assert c.wait_policy == policy
        for sub in (c.Split(c.rank % 2, c.rank, "half"), c.Split_shared("node")):
            assert sub.wait_policy == policy
            sub.Free()
        c.Free()


def test_the_wait_policy_is_auto_unless_asked(monkeypatch):
    monkeypatch.delenv("MPIOPT_WAIT_POLICY", raising=False)
    c = Comm()
    hosts = c.allgather_obj(MPI.Get_processor_name())
    node = c.Split_shared("node")
    here = hosts.count(hosts[c.rank])
    assert c.wait_policy == waiting.auto_wait_policy(here, len(set(hosts)) > 1 or node.size < here)
    node.Free()
    c.Free()
    monkeypatch.setenv("MPIOPT_WAIT_POLICY", " Passive ")
    c = Comm()
    assert c.wait_policy == "passive"
    c.Free()
    c = Comm(wait_policy="active")  # the argument before the environment
    assert c.wait_policy == "active"
    c.Free()
    with pytest.raises(ValueError, match=r"wait_policy must be one of auto, active, passive; got 'spin' on rank 0"):
        Comm(wait_policy="spin")


def test_auto_waits_passively_only_on_oversubscribed_nodes_whose_bytes_cross_a_network(monkeypatch):
    for name in ("MPIR_CVAR_NOLOCAL", "MPIR_CVAR_CH4_NOLOCAL", "OMPI_MCA_btl"):
        monkeypatch.delenv(name, raising=False)
    assert waiting.auto_wait_policy(4, crosses_network=True, cpus=2) == "passive"
    assert waiting.auto_wait_policy(2, crosses_network=True, cpus=2) == "active"  # a core per rank: spinning costs nobody
    assert waiting.auto_wait_policy(4, crosses_network=False, cpus=2) == "active"  # shared memory needs both sides polling
    monkeypatch.setenv("MPIR_CVAR_NOLOCAL", "1")  # one node, but MPICH told to use its network transport
    assert waiting.auto_wait_policy(4, crosses_network=False, cpus=2) == "passive"
    cases = {"tcp,self": True, "self,sm,tcp": False, "^sm": True, "^tcp": False, "vader,self": False}
    for btl, network in cases.items():
        assert waiting.network_only({"OMPI_MCA_btl": btl}) is network, btl


@pytest.mark.mpi(min_size=2)
def test_a_bad_wait_policy_on_one_rank_raises_on_every_rank(monkeypatch):
    if MPI.COMM_WORLD.rank == 1:
        monkeypatch.setenv("MPIOPT_WAIT_POLICY", "spin")
    else:
        monkeypatch.setenv("MPIOPT_WAIT_POLICY", "passive")
    with pytest.raises(ValueError, match=r"MPIOPT_WAIT_POLICY must be one of auto, active, passive; got 'spin' on rank 1"):
        Comm()
    with pytest.raises(ValueError, match=r"wait_policy must be one of auto, active, passive; got 'busy' on rank 0"):
        Comm(wait_policy="busy" if MPI.COMM_WORLD.rank == 0 else "active")


@pytest.mark.parametrize("policy", ["active", "passive"])
def test_a_passive_wait_polls_and_sleeps_and_completes_the_same_operation(policy, monkeypatch):
    from mpiopt.comm import communicator

    pauses = []

    class Counting(communicator.Backoff):
        def pause(self):
            pauses.append(1)
            super().pause()

    monkeypatch.setattr(communicator, "Backoff", Counting)
    c = Comm(wait_policy=policy)
    P = c.size
    buf = rank_data(c.rank, 1000)
    out = np.empty_like(buf)
    if c.rank == 0:
        time.sleep(0.05)  # the others wait for rank 0's contribution
    request = c.Iallreduce(buf, out=out)
    request.Wait()
    np.testing.assert_allclose(out, sum(rank_data(q, 1000, np.float64) for q in range(P)))
    waited = c.ledger["world.Iallreduce"].wait_seconds
    polled = c.allgather_obj(len(pauses))
    if policy == "active":
        assert polled == [0] * P
    elif P > 1:
        assert all(n > 0 for n in polled[1:]), polled  # they polled while rank 0 slept
        assert c.allgather_obj(waited)[1] > 0.02
    c.Free()


def test_decide_returns_the_check_when_every_rank_passes_and_records_nothing(comm):
    assert comm.decide(lambda: comm.rank * 10, "test") == comm.rank * 10
    assert comm.decide(lambda: "same", "test", agree_on={"a": 1}) == "same"
    assert comm.ledger.bytes_sent == 0 and comm.ledger.bytes_recv == 0  # deciding is not an algorithm's traffic


def test_decide_a_failure_on_one_rank_raises_on_every_rank(comm):
    from mpiopt.comm import OtherRankError

    last = comm.size - 1

    def check():
        if comm.rank == last:
            raise ValueError("bad value 7")
        return 1

    if comm.size == 1:
        with pytest.raises(ValueError, match="bad value 7"):
            comm.decide(check, "test check")
        return
    if comm.rank == last:
        with pytest.raises(ValueError, match="^bad value 7$"):  # its own error, as raised
            comm.decide(check, "test check")
    else:
        with pytest.raises(OtherRankError, match=f"the test check failed on rank {last}:\n  rank {last}: ValueError: bad value 7"):
            comm.decide(check, "test check")
    # A caller's error: the same type and message on every rank, naming the failed ranks.
    with pytest.raises(KeyError, match=f"ranks \\[{last}\\]"):
        comm.decide(check, "test", error=lambda failures, own: KeyError(f"ranks {[f.rank for f in failures]}"))
    # What check raises outside ``catch`` is a bug, not a verdict: it propagates on its rank alone (none here).
    assert comm.decide(lambda: 2, "test", catch=(KeyError,)) == 2


@pytest.mark.mpi(min_size=2)
def test_decide_disagreement_comes_before_failures(comm):
    with pytest.raises(SetupMismatchError, match=r"ranks disagree on the test \(world communicator\):\n  x: rank 0: 0, rank 1: 1"):
        comm.decide(lambda: 1 / 0 if comm.rank == 0 else None, "test", catch=(ZeroDivisionError,), agree_on={"x": comm.rank})


def test_votes_reduce_by_maximum_and_any_rank_decides(comm):
    import mpiopt

    values = np.array([comm.rank, -comm.rank, 3.0])
    assert comm.vote(values) and values.tolist() == [comm.size - 1, 0.0, 3.0]
    topology = mpiopt.Topology()
    assert topology.any(topology.rank == topology.size - 1) is True
    assert topology.any(False) is False
    topology.Free()
