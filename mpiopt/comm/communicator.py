"""``Comm``: the one place where mpiopt talks MPI.

It wraps a ``Dup()`` of an mpi4py intracommunicator and records every call's bytes and time in a
:class:`~mpiopt.comm.Ledger`; nothing passes through unrecorded, or the figures would lie.  Buffers: numpy,
torch or cupy (:mod:`.buffers`); collective decisions: :mod:`.decisions`.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np
from mpi4py import MPI

from .decisions import MISSING, Decisions, Failure, first_failure, SetupMismatchError, differing_lines, plain, raise_own_or_name_them
from .buffers import HostStaging, as_mpi_buffer, check_buffer, copy_bytes, gpu_aware_mpi, nbytes
from .staging import CHUNK_ENV, GpuPath, gpu_path, staged, staged_call, staging_chunk_bytes
from .ledger import Ledger
from .objects import ObjectCalls
from .survival import INJECTION, Survivable
from .waiting import Backoff, check_wait_policy, wait_policy_here

__all__ = ["Comm", "Request", "SetupMismatchError", "Failure", "ELECTION_BYTES", "raise_own_or_name_them", "MISSING", "plain", "differing_lines", "SUM", "MAX", "MIN", "ANY_SOURCE", "ANY_TAG"]

SUM, MAX, MIN = MPI.SUM, MPI.MAX, MPI.MIN
ANY_SOURCE, ANY_TAG = MPI.ANY_SOURCE, MPI.ANY_TAG

# (value, rank) pairs for leader election: float64 + int32, padded like the C struct.
_DOUBLE_INT = np.dtype([("value", np.float64), ("rank", np.int32)], align=True)
#: Bytes one rank contributes to an election (:meth:`Comm.elect_min`).
ELECTION_BYTES = _DOUBLE_INT.itemsize
#: Longest sleep between two polls of ``Comm.Barrier(sleeping=True)`` (seconds): how late its end may be noticed.
SLEEPING_BARRIER_PAUSE = 0.01


class Request:
    """Handle of a nonblocking operation.

    The operation's wall time (posting to completion) and the time spent
    blocked in :meth:`Wait` are added to the ledger when it completes (and
    told to its listener as an ``"inflight"`` and a ``"wait"`` span); staged
    GPU buffers are copied back at that moment.
    """

    def __init__(
        self,
        ledger: Ledger,
        op: str,
        request: MPI.Request,
        writebacks: List[Callable[[], None]],
        started: float,
        release: Callable[[], None],
        passive: bool = False,
        faults: Optional[Survivable] = None,
        peer: Optional[int] = None,
    ):
        self._ledger = ledger
        self._faults = faults or Survivable()
        self.peer = peer  # a point-to-point call's other rank, None for a collective
        self._passive = passive
        self._op = op
        self._request = request
        self._writebacks = writebacks
        self._started = started
        self._release = release
        self.done = False

    def _complete(self, waited: float) -> None:
        for writeback in self._writebacks:
            writeback()
        self._release()
        self.done = True
        ended = time.perf_counter()
        self._ledger.add_time(self._op, ended - self._started, waited)
        listener = self._ledger.listener
        if listener is not None:
            listener(self._op, self._started, ended, "inflight")
            if waited > 0:
                listener(self._op, ended - waited, ended, "wait")

    def Test(self) -> bool:
        """Advance the operation; True once it has completed."""
        with self._faults.guard(self._op, self.peer):
            if not self.done and self._request.Test():
                self._complete(0.0)
        return self.done

    def Wait(self, longest_pause: Optional[float] = None) -> None:
        """Block until the operation completes: spinning in MPI, or polling and sleeping (:mod:`~mpiopt.comm.waiting`)
        under the passive policy or, whatever the policy, when ``longest_pause`` (seconds between polls) is given."""
        if self.done:
            return
        t0 = time.perf_counter()
        with self._faults.guard(self._op, self.peer):
            if self._passive or longest_pause is not None:
                backoff = Backoff() if longest_pause is None else Backoff(longest=longest_pause)
                while not self._request.Test():
                    backoff.pause()
            else:
                self._request.Wait()
        self._complete(time.perf_counter() - t0)


class Comm(ObjectCalls, Decisions):
    """An MPI intracommunicator with a byte/time ledger.

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm, optional
        The communicator to wrap (default ``MPI.COMM_WORLD``).  It is
        duplicated unless ``dup=False``.
    name : str
        Prefix of the ledger's operation names (``"world"``, ``"group"``, ...).
    ledger : Ledger, optional
        Shared ledger; a new one by default.
    gpu_aware : bool, optional
        Whether the MPI library takes GPU memory directly; detected when
        omitted (see :func:`mpiopt.comm.buffers.gpu_aware_mpi`).
    dup : bool
        Duplicate ``comm`` (default).  Communicators made by :meth:`Split` are
        new already and are not duplicated again.
    wait_policy : {"auto", "active", "passive"}, optional
        How :meth:`Request.Wait` waits (:mod:`mpiopt.comm.waiting`): spinning
        in ``MPI_Wait`` or polling and sleeping, or ``auto``: polling and
        sleeping where this node's ranks outnumber its CPUs and the bytes
        cross a network; default: the environment variable
        ``MPIOPT_WAIT_POLICY``, else ``"auto"``.  Checked collectively and
        resolved at construction; sub-communicators inherit the choice.

    staging_chunk : int or str, optional
        Bytes per chunk of a GPU buffer staged through host memory (``"8M"``
        = 8 MiB); default ``MPIOPT_STAGING_CHUNK``, else 8 MiB.  The same on
        every rank (checked).  See :mod:`mpiopt.comm.staging`.
    stage_host : bool
        Stage numpy and torch CPU buffers as if they were GPU buffers (the
        CPU tests and dry runs of the staged path).

    Attributes
    ----------
    wait_policy : str
        ``"active"`` or ``"passive"`` (``auto`` resolved).
    """

    def __init__(
        self,
        comm: Optional[MPI.Intracomm] = None,
        *,
        name: str = "world",
        ledger: Optional[Ledger] = None,
        gpu_aware: Optional[bool] = None,
        dup: bool = True,
        wait_policy: Optional[str] = None,
        staging_chunk: Any = None,
        stage_host: bool = False,
        faults: Optional[Survivable] = None,
    ) -> None:
        self.faults = faults or Survivable()  # a topology's: where ULFM's news of a lost rank goes (comm/survival.py)
        base = MPI.COMM_WORLD if comm is None else comm
        if not isinstance(base, MPI.Intracomm):
            raise TypeError(f"comm must be an mpi4py Intracomm, got {type(base).__name__}")
        self._comm = base.Dup() if dup else base
        self.name = name
        try:
            asked_chunk = staging_chunk if staging_chunk is not None else os.environ.get(CHUNK_ENV)
            self.wait_policy, (self.staging_chunk, self._chunk_reason) = self.decide(
                lambda: (check_wait_policy(wait_policy), staging_chunk_bytes(staging_chunk)), "communication settings",
                error=first_failure(ValueError), agree_on={"staging_chunk": asked_chunk},
            )
            if self.wait_policy == "auto":
                self.wait_policy = wait_policy_here(self._comm)
            self._passive = self.wait_policy == "passive"
        except ValueError:
            if dup:
                self._comm.Free()
            raise
        self.ledger = Ledger() if ledger is None else ledger
        self.gpu_aware, self.gpu_aware_reason = gpu_aware_mpi(gpu_aware)
        self._staging = HostStaging()
        self._stage_host = bool(stage_host)
        # Nonblocking calls in flight at once need their own staging buffers:
        # lane n of an operation is busy from posting until completion.
        self._busy_lanes: Dict[str, Set[int]] = {}

    # -- identity --------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._comm.Get_rank()

    @property
    def size(self) -> int:
        return self._comm.Get_size()

    @property
    def thread_multiple(self) -> bool:
        """Whether MPI runs with ``MPI_THREAD_MULTIPLE`` (calls from several threads at once are allowed)."""
        return MPI.Query_thread() >= MPI.THREAD_MULTIPLE

    def __repr__(self) -> str:
        return f"Comm(name={self.name!r}, rank={self.rank}, size={self.size})"

    def Free(self) -> None:
        """Release the underlying communicator."""
        if self._comm != MPI.COMM_NULL:
            self._comm.Free()

    def mpi_comm_for_io(self) -> MPI.Intracomm:
        """The wrapped mpi4py communicator, for opening a file collectively (h5py's ``mpio`` driver).

        For MPI-IO only, never for messages: what MPI-IO moves between ranks
        is not recorded in the ledger.
        """
        return self._comm

    def Split(self, color: int, key: int, name: str) -> Optional["Comm"]:
        """Sub-communicator of ranks with the same ``color``; None where ``color`` is negative."""
        with self.faults.guard(self.name):
            raw = self._comm.Split(MPI.UNDEFINED if color < 0 else color, key)
        if raw == MPI.COMM_NULL:
            return None
        return self._sub(raw, name)

    def Split_shared(self, name: str) -> "Comm":
        """Sub-communicator of the ranks that share memory (one node)."""
        with self.faults.guard(self.name):
            raw = self._comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        return self._sub(raw, name)

    def _sub(self, raw: MPI.Intracomm, name: str) -> "Comm":
        """A new communicator of some of our ranks, sharing our ledger and settings."""
        return Comm(
            raw, name=name, ledger=self.ledger, gpu_aware=self.gpu_aware, dup=False, wait_policy=self.wait_policy,
            staging_chunk=self.staging_chunk, stage_host=self._stage_host, faults=self.faults,
        )

    def gpu_path(self) -> GpuPath:
        """How GPU buffers travel on this communicator (world of one, CUDA-aware, staged in chunks) and why."""
        return gpu_path(self.size, self.gpu_aware, self.gpu_aware_reason, self.staging_chunk, self._chunk_reason)

    # -- the shared code path ------------------------------------------------------
    def _run(
        self,
        op: str,
        sent: int,
        recv: int,
        call: Callable[..., Any],
        buffers: Sequence[Tuple[Any, bool, bool]],
        nonblocking: bool = False,
        *,
        local: Optional[Callable[..., None]] = None,
        chunked: Optional[Callable[..., MPI.Request]] = None,
        peer: Optional[int] = None,
    ) -> Any:
        """Stage ``buffers`` (``(buf, read, write)`` triples), run ``call`` on them, record.

        For nonblocking calls ``call`` returns an ``MPI.Request`` and a
        :class:`Request` is returned whose completion records the time.  At a
        world of one, ``local(*buffers)`` does a collective's work instead (a
        copy on the buffers' device, or nothing): no MPI call, no staging.
        ``chunked(*host_chunks)`` starts the call on one chunk (a nonblocking
        MPI call): staged buffers then go in pipelined chunks (:mod:`.staging`).  ``peer``: a point-to-point call's
        other rank (:meth:`Survivable.guard`).
        """
        started = time.perf_counter()
        writebacks: List[Callable[[], None]] = []
        release: Callable[[], None] = lambda: None
        if self.size == 1 and local is not None:
            for buf, _, _ in buffers:
                check_buffer(buf)  # the errors MPI's path gives
            local(*(buf for buf, _, _ in buffers))
            result = MPI.REQUEST_NULL if nonblocking else None
        else:
            INJECTION.reached("exchange")
            busy = self._busy_lanes.setdefault(op, set())
            lane = min(set(range(len(busy) + 1)) - busy) if nonblocking else 0
            if nonblocking:
                busy.add(lane)
                release = lambda: busy.discard(lane)  # noqa: E731
            slots = [f"{op}:{lane}:{i}" for i in range(len(buffers))]
            with self.faults.guard(self.name, peer):
                if chunked is not None and staged(buffers, self.gpu_aware, self._stage_host):
                    result = staged_call(buffers, chunked, self._staging, slots, self.staging_chunk)
                    if not nonblocking:
                        result = result.Wait()
                else:
                    mpi_bufs = []
                    for slot, (buf, read, write) in zip(slots, buffers):
                        mpi_buf, writeback = as_mpi_buffer(
                            buf, gpu_aware=self.gpu_aware, staging=self._staging, slot=slot, read=read, write=write
                        )
                        mpi_bufs.append(mpi_buf)
                        if writeback is not None:
                            writebacks.append(writeback)
                    result = call(*mpi_bufs)
        name = f"{self.name}.{op}"
        if nonblocking:
            self.ledger.record(name, sent, recv)
            return Request(self.ledger, name, result, writebacks, started, release, passive=self._passive, faults=self.faults,
                           peer=peer)
        for writeback in writebacks:
            writeback()
        ended = time.perf_counter()
        self.ledger.record(name, sent, recv, ended - started)
        if self.ledger.listener is not None:
            self.ledger.listener(name, started, ended, "blocking")
        return result

    def _others(self, n: int) -> int:
        """Bytes exchanged with other ranks: none at a world size of one."""
        return n if self.size > 1 else 0

    # -- reductions ------------------------------------------------------------------
    def _allreduce(self, buf: Any, out: Optional[Any], op: MPI.Op, nonblocking: bool) -> Any:
        n = self._others(nbytes(buf))
        fn = self._comm.Iallreduce if nonblocking else self._comm.Allreduce
        name = "Iallreduce" if nonblocking else "Allreduce"
        chunk = self._comm.Iallreduce
        if out is None:
            return self._run(
                name, n, n, lambda b: fn(MPI.IN_PLACE, b, op), [(buf, True, True)], nonblocking,
                local=lambda b: None, chunked=lambda b: chunk(MPI.IN_PLACE, b, op),
            )
        if nbytes(out) != nbytes(buf):
            raise ValueError(f"out has {nbytes(out)} bytes, buf has {nbytes(buf)}: they must match")
        return self._run(
            name, n, n, lambda b, o: fn(b, o, op), [(buf, True, False), (out, False, True)], nonblocking,
            local=lambda b, o: copy_bytes(o, b), chunked=lambda b, o: chunk(b, o, op),
        )

    def Allreduce(self, buf: Any, out: Optional[Any] = None, op: MPI.Op = SUM) -> None:
        """Reduce ``buf`` over all ranks into ``out`` (in place when ``out`` is None)."""
        self._allreduce(buf, out, op, nonblocking=False)

    def Iallreduce(self, buf: Any, out: Optional[Any] = None, op: MPI.Op = SUM) -> Request:
        """Nonblocking :meth:`Allreduce`; the buffers must not be touched until the request completes."""
        return self._allreduce(buf, out, op, nonblocking=True)

    def Reduce_scatter(self, sendbuf: Any, recvbuf: Any, op: MPI.Op = SUM) -> None:
        """Reduce ``sendbuf`` (``size`` equal blocks) and leave block ``rank`` in ``recvbuf``."""
        block = nbytes(recvbuf)
        if nbytes(sendbuf) != block * self.size:
            raise ValueError(f"sendbuf has {nbytes(sendbuf)} bytes; expected size x recvbuf = {block * self.size}")
        others = block * (self.size - 1)
        self._run(
            "Reduce_scatter", others, others,
            lambda s, r: self._comm.Reduce_scatter_block(s, r, op), [(sendbuf, True, False), (recvbuf, False, True)],
            local=lambda s, r: copy_bytes(r, s),
        )

    def elect_min(self, value: float) -> Tuple[float, int]:
        """Smallest ``value`` over all ranks and the rank holding it (ties: lowest rank).

        One Allreduce with ``MPI.MINLOC`` of a (float64, int32) pair.  NaN
        counts as larger than any number, so a diverged rank is never elected.
        """
        pair = np.zeros(1, dtype=_DOUBLE_INT)
        pair["value"] = np.inf if np.isnan(value) else value
        pair["rank"] = self.rank
        n = self._others(pair.nbytes)
        self._run("elect_min", n, n, lambda b: self._comm.Allreduce(MPI.IN_PLACE, [b, MPI.DOUBLE_INT], MPI.MINLOC), [(pair, True, True)], local=lambda b: None)
        return float(pair["value"][0]), int(pair["rank"][0])

    # -- gathers and scatters -----------------------------------------------------------------
    def _allgather(self, sendbuf: Any, recvbuf: Any, nonblocking: bool) -> Any:
        s = nbytes(sendbuf)
        if nbytes(recvbuf) != s * self.size:
            raise ValueError(f"recvbuf has {nbytes(recvbuf)} bytes; expected size x sendbuf = {s * self.size}")
        fn, name = (self._comm.Iallgather, "Iallgather") if nonblocking else (self._comm.Allgather, "Allgather")
        buffers = [(sendbuf, True, False), (recvbuf, False, True)]
        return self._run(name, self._others(s), s * (self.size - 1), fn, buffers, nonblocking, local=lambda s, r: copy_bytes(r, s))

    def Allgather(self, sendbuf: Any, recvbuf: Any) -> None:
        """Gather every rank's ``sendbuf`` into ``recvbuf`` (``size`` blocks, rank order)."""
        self._allgather(sendbuf, recvbuf, nonblocking=False)

    def Iallgather(self, sendbuf: Any, recvbuf: Any) -> Request:
        """Nonblocking :meth:`Allgather`; the buffers must not be touched until the request completes."""
        return self._allgather(sendbuf, recvbuf, nonblocking=True)

    def Allgatherv(self, sendbuf: Optional[Any], recvbuf: Any, counts: Sequence[int]) -> None:
        """Gather blocks of different lengths; ``counts[r]`` elements from rank ``r``, packed in rank order.

        ``sendbuf`` None: in place, this rank's block already where it belongs in ``recvbuf``.
        """
        counts = [int(c) for c in counts]
        if len(counts) != self.size:
            raise ValueError(f"counts has {len(counts)} entries; expected one per rank ({self.size})")
        item = nbytes(recvbuf) // max(1, _numel(recvbuf))
        if sendbuf is not None and _numel(sendbuf) != counts[self.rank]:
            raise ValueError(f"sendbuf has {_numel(sendbuf)} elements but counts[{self.rank}] = {counts[self.rank]}")
        if _numel(recvbuf) < sum(counts):
            raise ValueError(f"recvbuf has {_numel(recvbuf)} elements; counts need {sum(counts)}")
        sent, recv = self._others(counts[self.rank] * item), (sum(counts) - counts[self.rank]) * item
        if sendbuf is None:
            call = lambda r: self._comm.Allgatherv(MPI.IN_PLACE, [r, counts])  # noqa: E731
            self._run("Allgatherv", sent, recv, call, [(recvbuf, True, True)], local=lambda r: None)
            return
        self._run(
            "Allgatherv", sent, recv,
            lambda s, r: self._comm.Allgatherv(s, [r, counts]), [(sendbuf, True, False), (recvbuf, False, True)],
            local=lambda s, r: copy_bytes(r, s),
        )

    def _alltoall(self, sendbuf: Any, recvbuf: Any, nonblocking: bool) -> Any:
        if nbytes(sendbuf) != nbytes(recvbuf) or nbytes(sendbuf) % self.size:
            raise ValueError(
                f"Alltoall needs equal send and receive sizes divisible by {self.size}; got {nbytes(sendbuf)} and {nbytes(recvbuf)}"
            )
        others = nbytes(sendbuf) // self.size * (self.size - 1)
        fn, name = (self._comm.Ialltoall, "Ialltoall") if nonblocking else (self._comm.Alltoall, "Alltoall")
        buffers = [(sendbuf, True, False), (recvbuf, False, True)]
        return self._run(name, others, others, fn, buffers, nonblocking, local=lambda s, r: copy_bytes(r, s))

    def Alltoall(self, sendbuf: Any, recvbuf: Any) -> None:
        """Send block ``j`` of ``sendbuf`` to rank ``j``; receive rank ``j``'s block ``rank`` into block ``j``."""
        self._alltoall(sendbuf, recvbuf, nonblocking=False)

    def Ialltoall(self, sendbuf: Any, recvbuf: Any) -> Request:
        """Nonblocking :meth:`Alltoall`; the buffers must not be touched until the request completes."""
        return self._alltoall(sendbuf, recvbuf, nonblocking=True)

    def Alltoallv(self, sendbuf: Any, sendcounts: Sequence[int], recvbuf: Any, recvcounts: Sequence[int]) -> None:
        """Alltoall with per-rank element counts (blocks packed in rank order)."""
        sendcounts, recvcounts = [int(c) for c in sendcounts], [int(c) for c in recvcounts]
        if len(sendcounts) != self.size or len(recvcounts) != self.size:
            raise ValueError(f"sendcounts and recvcounts need {self.size} entries; got {len(sendcounts)} and {len(recvcounts)}")
        item = nbytes(sendbuf) // max(1, _numel(sendbuf))
        sent = (sum(sendcounts) - sendcounts[self.rank]) * item
        recv = (sum(recvcounts) - recvcounts[self.rank]) * item
        self._run(
            "Alltoallv", sent, recv,
            lambda s, r: self._comm.Alltoallv([s, sendcounts], [r, recvcounts]), [(sendbuf, True, False), (recvbuf, False, True)],
            local=lambda s, r: copy_bytes(r, s, sendcounts[0] * item),
        )

    def Bcast(self, buf: Any, root: int = 0) -> None:
        """Copy the root's ``buf`` into every rank's ``buf``."""
        self._check_rank(root, "root")
        n = self._others(nbytes(buf))
        is_root = self.rank == root
        self._run(
            "Bcast", n if is_root else 0, 0 if is_root else n, lambda b: self._comm.Bcast(b, root), [(buf, is_root, not is_root)],
            local=lambda b: None, chunked=lambda b: self._comm.Ibcast(b, root),
        )

    def Barrier(self, *, sleeping: bool = False) -> None:
        """Wait for every rank.

        ``sleeping``: an ``Ibarrier`` waited for with sleeps of up to :data:`SLEEPING_BARRIER_PAUSE` between polls,
        whatever the wait policy.  For a wait that one rank's long work sets (rank 0's report): MPICH's blocking
        wait spins, taking the cores that work needs where ranks outnumber cores.  Not for a step: it ends late.
        """
        if not sleeping:
            self._run("Barrier", 0, 0, self._comm.Barrier, [], local=lambda: None)
            return
        self._run("Ibarrier", 0, 0, self._comm.Ibarrier, [], True, local=lambda: None).Wait(SLEEPING_BARRIER_PAUSE)

    # -- point to point -----------------------------------------------------------------------
    def Send(self, buf: Any, dest: int, tag: int = 0) -> None:
        """Blocking send of ``buf`` to ``dest``."""
        self._check_rank(dest, "dest")
        self._run("Send", nbytes(buf), 0, lambda b: self._comm.Send(b, dest, tag), [(buf, True, False)], peer=dest)

    def Isend(self, buf: Any, dest: int, tag: int = 0) -> Request:
        """Nonblocking send; ``buf`` must not change until the request completes."""
        self._check_rank(dest, "dest")
        return self._run("Isend", nbytes(buf), 0, lambda b: self._comm.Isend(b, dest, tag), [(buf, True, False)], True, peer=dest)

    def Recv(self, buf: Any, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> MPI.Status:
        """Blocking receive into ``buf``; returns the status (source, tag)."""
        status = MPI.Status()
        self._run("Recv", 0, nbytes(buf), lambda b: self._comm.Recv(b, source, tag, status), [(buf, False, True)],
                  peer=_specific(source))
        return status

    def Irecv(self, buf: Any, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Request:
        """Nonblocking receive into ``buf``."""
        return self._run("Irecv", 0, nbytes(buf), lambda b: self._comm.Irecv(b, source, tag), [(buf, False, True)], True,
                         peer=_specific(source))

    def Iprobe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Optional[MPI.Status]:
        """Status of a pending message matching ``source`` and ``tag``, or None."""
        status = MPI.Status()
        with self.faults.guard(f"{self.name}.Iprobe", _specific(source)):
            return status if self._comm.Iprobe(source, tag, status) else None

    def _check_rank(self, value: int, name: str) -> None:
        if not (0 <= value < self.size):
            raise ValueError(f"{name} must be a rank in [0, {self.size}), got {value}")


def _specific(source: int) -> Optional[int]:
    """A receive's one peer, or None for any source."""
    return None if source == ANY_SOURCE else source


def _numel(buf: Any) -> int:
    return buf.numel() if hasattr(buf, "numel") and callable(buf.numel) else int(buf.size)
