"""Survival without communication: which launches can survive a lost rank, where ULFM's news of one goes, and the
test hook's spec."""

from __future__ import annotations

import pytest
from mpi4py import MPI

from mpiopt.comm.survival import LAUNCH, FaultInjection, INJECT_ENV, IslandLeft, PeerLost, RankLost, Survivable, han_caveat, ulfm_problem

OPEN_MPI = "Open MPI v5.0.11, package: Open MPI ..."
ULFM = {"OMPI_MCA_mpi_ft_enable": "true", "OMPI_MCA_btl": "tcp,self"}


def test_ulfm_launch_is_accepted():
    assert ulfm_problem(OPEN_MPI, ULFM) is None
    assert ulfm_problem(OPEN_MPI, {**ULFM, "OMPI_MCA_btl": "tcp"}) is None


@pytest.mark.parametrize("library, environ, says", [
    ("MPICH Version:      5.0.2", ULFM, "this is MPICH Version:      5.0.2"),
    (OPEN_MPI, {"OMPI_MCA_btl": "tcp,self"}, "only `mpiexec --with-ft ulfm` turns on"),
    (OPEN_MPI, {**ULFM, "OMPI_MCA_mpi_ft_enable": "0"}, "only `mpiexec --with-ft ulfm` turns on"),
    (OPEN_MPI, {"OMPI_MCA_mpi_ft_enable": "1"}, "btl is its default"),
    (OPEN_MPI, {**ULFM, "OMPI_MCA_btl": "sm,tcp,self"}, "btl is sm,tcp,self"),
    (OPEN_MPI, {**ULFM, "OMPI_MCA_btl": "^sm"}, "btl is ^sm"),
])
def test_each_launch_that_cannot_survive_is_named_with_the_fix(library, environ, says):
    problem = ulfm_problem(library, environ)
    assert says in problem and LAUNCH in problem


@pytest.mark.parametrize("spans_nodes, library, coll, caveat", [
    (True, OPEN_MPI, None, True),  # han is Open MPI's choice for a world on several nodes
    (True, OPEN_MPI, "^han", False),
    (True, OPEN_MPI, "^ hcoll, han", False),
    (True, OPEN_MPI, "^hcoll", True),
    (True, OPEN_MPI, "tuned,basic,libnbc,self", False),  # a list of its own, without han
    (True, OPEN_MPI, "han,tuned,basic,libnbc,self", True),
    (False, OPEN_MPI, None, False),  # one node: han is not chosen
    (True, "MPICH Version:      5.0.2", None, False),
])
def test_a_surviving_run_on_several_nodes_is_told_to_leave_open_mpis_hierarchical_collectives_out(spans_nodes, library, coll, caveat):
    environ = {**ULFM, **({} if coll is None else {"OMPI_MCA_coll": coll})}
    said = han_caveat(spans_nodes, library, environ)
    assert (said is not None) == caveat
    assert said is None or "`--mca coll ^han`" in said


@pytest.mark.parametrize("spec, expected", [
    ("", set()),
    ("2@7", {(2, 7, "step")}),
    ("0@3:exchange, 1@9", {(0, 3, "exchange"), (1, 9, "step")}),
])
def test_injection_spec(monkeypatch, spec, expected):
    monkeypatch.setenv(INJECT_ENV, spec)
    hook = FaultInjection()
    assert hook.points == expected
    hook.current = 7
    hook.reached("exchange", 2)  # not an injected point: returns at once


def _guarded(faults, error_class, peer=None):
    with faults.guard("world", peer):
        raise MPI.Exception(error_class)


def test_a_lost_peer_is_only_tolerated_where_asked_for_and_named():
    revoked = []
    faults = Survivable()
    faults.on_fault = lambda: revoked.append(True)
    with faults.tolerating():
        with pytest.raises(PeerLost) as lost:
            _guarded(faults, MPI.ERR_PROC_FAILED, peer=3)
        assert lost.value.rank == 3 and not revoked  # the caller goes on with the other peers
        with pytest.raises(RankLost) as collective:
            _guarded(faults, MPI.ERR_PROC_FAILED)  # no one peer: every communicator revoked
        assert not isinstance(collective.value, PeerLost) and revoked == [True]
    with pytest.raises(RankLost) as outside:
        _guarded(faults, MPI.ERR_PROC_FAILED, peer=3)
    assert not isinstance(outside.value, PeerLost) and revoked == [True, True]
    with pytest.raises(MPI.Exception):
        _guarded(faults, MPI.ERR_TRUNCATE, peer=3)  # not a fault: as MPI raised it
    assert len(revoked) == 2


@pytest.mark.skipif(MPI.ERR_REVOKED == MPI.ERR_PROC_FAILED, reason="this MPI has no error class of its own for a revoked communicator")
def test_a_revoked_communicator_is_never_a_lost_peer():
    revoked = []
    faults = Survivable()
    faults.on_fault = lambda: revoked.append(True)
    with faults.tolerating(), pytest.raises(RankLost) as lost:
        _guarded(faults, MPI.ERR_REVOKED, peer=2)
    assert not isinstance(lost.value, PeerLost) and revoked == [True]


def test_without_survival_the_error_passes_as_mpi_raised_it():
    faults = Survivable()
    assert not faults.survives
    with faults.tolerating(), pytest.raises(MPI.Exception):
        _guarded(faults, MPI.ERR_PROC_FAILED, peer=1)


def test_a_server_kill_point_counts_its_messages_over_runs():
    hook = FaultInjection()
    hook.points = {(MPI.COMM_WORLD.Get_rank() + 1, 5, "step")}  # another rank's point: never pauses here
    for _ in range(7):
        hook.served()
    assert hook.messages == 7 and hook.current == 7


def test_islands_take_shrink_and_respawn_and_fp16_is_refused_naming_why():
    """An island that lost a rank leaves whole (Topology.recover): shrink goes on with the whole ones, respawn starts
    processes in the whole island's places.  fp16's loss scaler votes outside the rollback: refused, named."""
    from mpiopt.training.config import TrainConfig, UsageError

    for on_failure in ("shrink", "respawn"):
        TrainConfig(algorithm="diloco", islands=True, on_failure=on_failure).validate(["diloco"])
    with pytest.raises(UsageError, match=r"--on-failure respawn takes no --precision fp16 yet: the scaler's vote is not rolled back"):
        TrainConfig(algorithm="diloco", precision="fp16", on_failure="respawn").validate(["diloco"])


def test_an_error_point_raises_at_its_step_only(monkeypatch):
    monkeypatch.setenv(INJECT_ENV, f"{MPI.COMM_WORLD.Get_rank()}@3:error")
    hook = FaultInjection()
    hook.at(2)
    with pytest.raises(RuntimeError, match="the test's error at step 3"):
        hook.at(3)
    hook.at(4)


class _Links:
    """A session's topology and links that record what is done to them."""

    def __init__(self):
        self.done = []

    def Free(self):
        self.done.append("free")


def _raising(error):
    def body():
        raise error
    return body


@pytest.mark.parametrize("body, code, closed", [
    (lambda: None, 0, True),
    (_raising(IslandLeft([1], [0], 2)), 0, True),
    (_raising(ValueError("a bug on this rank")), None, False),
])
def test_a_session_closes_its_respawn_links_only_where_every_rank_ends_alike(monkeypatch, body, code, closed):
    """The links to a respawn's jobs are closed collectively: after the endings every rank shares, never on the way of
    an error of this rank to the abort hook (the others would never reach the close)."""
    import mpiopt.comm.joining as joining
    from mpiopt.cli.session import Session

    topology = _Links()
    monkeypatch.setattr(joining, "disconnect", lambda links: topology.done.append(("disconnect", list(links))))
    session = Session(topology, None, "out", "train", 0.0, links=["link"])
    if code is None:
        with pytest.raises(ValueError, match="a bug on this rank"):
            session.to_the_end(body, lambda stop: "")
    else:
        assert session.to_the_end(body, lambda stop: "") == code
    assert topology.done == (["free", ("disconnect", ["link"])] if closed else [])


class _Spawner:
    """A stand-in survivors' communicator: records each spawn's placement, refuses those named in ``refuse``."""

    def __init__(self, refuse=()):
        self.refuse, self.calls = set(refuse), []

    def Spawn(self, command, args, maxprocs, root, info=None):
        placed = info is not None
        self.calls.append((maxprocs, {k: info.Get(k) for k in ("host", "map_by", "bind_to")} if placed else None))
        if ("placed" if placed else "launcher") in self.refuse:
            raise MPI.Exception(MPI.ERR_SPAWN)
        return "placed link" if placed else "launcher's link"


ON_NODE1 = {"host": "node1", "map_by": ":OVERSUBSCRIBE", "bind_to": "none"}
SPAWN_ERROR = MPI.Exception(MPI.ERR_SPAWN).Get_error_string()


@pytest.mark.parametrize("hosts, refuse, link, why, misplaced, calls", [
    # on their lost ranks' host, oversubscribed and unbound (the launcher still counts the dead processes' slots)
    (["node1", "node1"], (), "placed link", "", None, [(2, ON_NODE1)]),
    # that host refused: the launcher's own placement, and why it was not the host
    (["node1"], ("placed",), "launcher's link", "", SPAWN_ERROR, [(1, ON_NODE1), (1, None)]),
    # nowhere: no link, MPI's reason
    (["node1"], ("placed", "launcher"), None, SPAWN_ERROR, SPAWN_ERROR, [(1, ON_NODE1), (1, None)]),
    # ranks on several hosts (one spawn maps onto a host list in its own order), or one unknown: the launcher's
    (["node1", "node0"], (), "launcher's link", "", "they were on 2 hosts", [(2, None)]),
    (["node1", None], (), "launcher's link", "", "they were on 2 hosts", [(2, None)]),
])
def test_replacements_start_on_the_lost_ranks_host_before_where_the_launcher_puts_them(hosts, refuse, link, why, misplaced, calls):
    from mpiopt.comm.joining import spawn_replacements

    comm = _Spawner(refuse)
    assert spawn_replacements(comm, ["-m", "x"], hosts) == (link, why, misplaced)
    assert comm.calls == calls
