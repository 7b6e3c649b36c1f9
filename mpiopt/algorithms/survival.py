"""Going on without a lost rank: the state at a step's start, and its move to the survivors (docs/failures.md).

With ``Topology(on_failure="shrink")`` every step (and exchange) first keeps a copy of the parameters and the state;
a :class:`~mpiopt.comm.survival.RankLost` during it puts the parameters back and passes on, so that the survivors,
once :meth:`Topology.recover` shrank the world, redo the step from where it started with :meth:`Survival.recovered`.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ..arrays import array_module, to_numpy
from ..asyncrt import SERVER, ServerLost
from ..comm import RankLost
from ..comm.survival import INJECTION

__all__ = ["Carried", "Snapshot", "Survival", "PeriodicExchange", "ServerSurvival", "survivors_state", "handed_over"]


def survivors_state(rules: Mapping[str, Any], state: Mapping[str, Any], workers: Any, old_workers: int,
                    surviving: Optional[int] = None, survivor: bool = True) -> Dict[str, Any]:
    """This worker's ``state`` after workers were lost, each entry by its resize rule (:mod:`.resize`) over the
    ``workers`` (collective on them, their communicator or islands): kept, the mean of the ``surviving`` ones (by
    default all), or a sum over the old workers rescaled to them.  A replacement (not a ``survivor``) holds the state of
    the survivor it follows (:func:`handed_over`) and adds nothing to the mean."""
    surviving = workers.size if surviving is None else surviving

    def moved(key: str, value: Any) -> Any:
        rule = rules[key]
        if value is None or rule.survivors == "own":
            return rule.apply([value], workers.rank, workers.size)
        if rule.survivors == "rescale":  # the resize's own rescaling, from the old number of workers to the survivors
            return rule.apply([value] * old_workers, workers.rank, workers.size)
        # The mean of float32 entries rounds once, as a resize's does.
        total = np.array(value, dtype=np.float64) if survivor else np.zeros(np.shape(value))
        workers.Allreduce(total)
        return (total / surviving).astype(np.asarray(value).dtype)

    return {**state, "arrays": {k: moved(k, v) for k, v in sorted(state["arrays"].items())},
            "scalars": {k: moved(k, v) for k, v in sorted(state["scalars"].items())}}


@dataclass(frozen=True)
class Carried:
    """State kept outside an algorithm that a replacement takes from its survivor with the algorithm's (an inner torch
    optimizer's): ``give()`` on the survivor, picklable; ``take(given)`` on the replacement."""

    give: Callable[[], Any]
    take: Callable[[Any], None]


def handed_over(topology: Any, params: Any, state: Optional[Dict[str, Any]], old_workers: int,
                carried: Optional[Carried] = None) -> Tuple[Dict[str, Any], int]:
    """After a respawn (collective on the world): on each process that took a lost rank's place, the parameters, the
    ``state`` (and ``old_workers``) and what is ``carried`` of the survivor it follows (:meth:`Topology.joined_from`);
    a survivor keeps its own and passes them to its followers.  Each survivor and its followers share one small
    communicator."""
    group = topology.world.Split(topology.joined_from(topology.rank), topology.rank, "hand-over")
    try:
        shapes = None if state is None else {k: None if v is None else (v.shape, v.dtype.str) for k, v in state["arrays"].items()}
        given = None if state is None or carried is None else carried.give()
        header, shapes, old_workers, given = group.bcast_obj(
            None if state is None else ({**state, "arrays": {}}, shapes, old_workers, given))
        if state is None and carried is not None:
            carried.take(given)
        group.Bcast(params)
        arrays: Dict[str, Any] = {}
        for key, shape in sorted(shapes.items()):
            arrays[key] = None if shape is None else state["arrays"][key] if state is not None else np.empty(*shape)
            if shape is not None:
                group.Bcast(arrays[key])
    finally:
        group.Free()
    return {**header, "arrays": arrays}, old_workers


class Snapshot:
    """Copies of the parameters, state arrays, scalars and step count at a step's start (buffers kept for the next)."""

    def __init__(self) -> None:
        self.params: Optional[Any] = None
        self.arrays: Dict[str, Optional[Any]] = {}
        self.scalars: Dict[str, Any] = {}
        self.steps = 0
        self.workers = 0  # how many workers there were: a sum over them is rescaled to the survivors
        self.pending = False  # within a step that the survivors have not yet agreed they all completed

    @staticmethod
    def _into(buffer: Optional[Any], value: Any) -> Any:
        if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
            buffer = array_module(value).empty_like(value)
        buffer[...] = value
        return buffer

    def save(self, alg: Any, params: Any) -> None:
        """Keep ``params`` and ``alg``'s state but the entries it resets on a recovery (``survival_resets``)."""
        self.params = self._into(self.params, params)
        for key in alg.state_arrays:
            value = None if key in alg.survival_resets else getattr(alg, key)
            self.arrays[key] = None if value is None else self._into(self.arrays.get(key), value)
        self.scalars = {key: copy.deepcopy(getattr(alg, key)) for key in alg.state_scalars}
        self.steps, self.workers = alg.steps, alg.worker_count

    def state(self, alg: Any) -> Dict[str, Any]:
        """The kept state as ``state_dict()`` gives it (host copies), the resets applied."""
        arrays = {key: None if value is None else to_numpy(value).copy() for key, value in self.arrays.items()}
        scalars = dict(self.scalars)
        for key, reset in alg.survival_resets.items():
            if key in scalars:
                scalars[key] = reset
            elif reset is not None:  # an array reset to a value: its shape is the live one's
                arrays[key] = np.full_like(to_numpy(getattr(alg, key)), reset)
        return {"algorithm": alg.name, "world_size": alg.topology.size, "steps": self.steps, "lr": alg.lr,
                "hyperparameters": alg.hyperparameters(), "arrays": arrays, "scalars": scalars}


class Survival:
    """Mixin of :class:`~mpiopt.algorithms.base.Algorithm`: the step's rollback point and the recovery."""

    #: State entries in flight or pending across a step boundary, set to this value on a recovery (the exchange they
    #: await died with the lost rank): DaSGD's averaging, Streaming DiLoCo's fragments.
    survival_resets: ClassVar[Mapping[str, Any]] = {}
    #: Why this algorithm cannot go on without a lost rank (None: it can).
    survival_refusal: ClassVar[Optional[str]] = None
    #: What a replacement takes from its survivor besides this algorithm's state (set before :meth:`setup`).
    carried: Optional[Carried] = None
    name: ClassVar[str]
    state_arrays: ClassVar[Tuple[str, ...]]
    state_scalars: ClassVar[Tuple[str, ...]]
    resize_rules: ClassVar[Optional[Mapping[str, Any]]]
    resize_refusal: ClassVar[str]
    topology: Any
    steps: int
    _given: Dict[str, Any]
    _rollback: Optional[Snapshot] = None

    def _check_survival(self) -> None:
        """ValueError, before any communication, for a topology that survives lost ranks where this cannot (the
        setting is agreed by every rank, so every rank refuses)."""
        if self.topology.on_failure == "abort":
            return
        if self.survival_refusal is not None:
            raise ValueError(f"{self.name}: on_failure={self.topology.on_failure!r} is refused: {self.survival_refusal} "
                             "(docs/failures.md)")
        if self.topology.on_failure == "respawn" and self.resize_rules is None:
            raise ValueError(f"{self.name}: on_failure='respawn' is refused: the processes started in lost ranks' places "
                             f"take the survivors' state by its resize rules, and {self.resize_refusal}; "
                             "on_failure='shrink' goes on without them (docs/failures.md)")

    @property
    def unfinished_step(self) -> Optional[int]:
        """The step (counted from 1) that started and that its survivors have not agreed they all completed (a lost
        rank broke it: :meth:`recovered` then starts from its start), or None.  Counted from the step's start: a
        survivor that finished it locally has counted it already."""
        return self._rollback.steps + 1 if self._rollback is not None and self._rollback.pending else None

    def may_communicate(self) -> bool:
        """Whether the coming step (or the one under way) may make an MPI call; by default it may.  One that cannot
        needs no rollback point, here or in an inner optimizer: nothing in it can break, and a rank lost meanwhile is
        found by the next call (DiLoCo's inner steps)."""
        return True

    @contextmanager
    def _rollback_point(self, params: Any) -> Iterator[None]:
        """Around a step or an exchange: with survival on, keep its start; where a survivor did not complete it
        (:meth:`Topology.agreed`), every survivor puts the parameters back and raises RankLost."""
        if self.topology.on_failure == "abort":
            yield
            return
        if not self.may_communicate():
            calls = self.topology.faults.calls
            yield
            if self.topology.faults.calls != calls:
                raise RuntimeError(f"{self.name}: step {self.steps} made an MPI call where may_communicate() said none")
            return
        if self._rollback is None:
            self._rollback = Snapshot()
        kept = self._rollback
        kept.save(self, params)
        kept.pending = True
        with self.topology.agreed(f"{self.name}'s step {self.steps + 1}", undo=lambda: params.__setitem__(Ellipsis, kept.params)):
            yield
        kept.pending = False

    def recovered(self, params: Any, prepare: Optional[Callable[[Any], None]] = None) -> Any:
        """This algorithm again, on its topology after :meth:`Topology.recover` (collective on the survivors).

        A fresh instance of the same settings is set up on ``params`` (the parameters at the failed step's start),
        and takes this one's state from that start, each entry moved by its resize rule over the survivors
        (:func:`~mpiopt.algorithms.resize.survivors_state`).  ``prepare(fresh)`` runs before its set-up (an inner
        optimizer, parameter groups).  The failed step is then redone by the caller.  A rank lost during the move
        raises :class:`~mpiopt.comm.RankLost` on every survivor, ``params`` back at the step's start and this instance
        unchanged: recover the topology again and call this again (docs/failures.md).
        """
        if self.topology.on_failure == "abort":
            raise RuntimeError(f"{self.name}: recovered() needs a Topology(on_failure='shrink') or 'respawn'")
        if self._rollback is None or not self._rollback.pending:  # lost between steps: the state as it stands
            self._rollback = self._rollback or Snapshot()
            self._rollback.save(self, params)
        state = self._rollback.state(self)
        fresh = type(self)(self.topology, **self._given)
        fresh.carried = self.carried
        if prepare is not None:
            prepare(fresh)
        start = params.copy()
        # The survivors alone (no replacement takes part) agree that all moved the state: a rank lost meanwhile has
        # every one put the parameters back and raise RankLost, this instance unchanged, to recover and call again.
        moving = nullcontext() if self.topology.joined else self.topology.agreed(
            f"{self.name}'s move to the survivors", undo=lambda: params.__setitem__(Ellipsis, start))
        with moving:
            fresh.setup(params)
            params[...] = start  # the set-up's own start (a mean, a broadcast) gives way to the step's start
            if self.resize_rules is None:
                raise RuntimeError(f"{self.name} cannot go on without a lost rank: {self.resize_refusal}")
            INJECTION.reached("recovered")
            fresh._take_state(params, state, self._rollback.workers)
        return fresh

    def _take_state(self, params: Any, state: Optional[Dict[str, Any]], old_workers: int) -> None:
        """Load ``state`` (kept when the loss came, on ``old_workers`` workers), each entry moved by its resize rule to
        this instance's workers (collective); after a respawn (:attr:`Topology.joined`) a replacement, whose ``state``
        is None, first takes the parameters and state of the survivor it follows (:func:`handed_over`)."""
        topology = self.topology
        survivor, surviving = not topology.joining, None
        if topology.joined:
            state, old_workers = handed_over(topology, params, state, old_workers, self.carried)
            surviving = self.worker_count - len(topology.joined) // (topology.group.size if self.islands else 1)
        moved = survivors_state(self.resize_rules, state, self.workers, old_workers, surviving, survivor)
        topology.joined = []  # handed over
        # Its own hyperparameters: those derived from the number of workers (EASGD's alpha) follow the survivors'.
        self.load_state_dict({**moved, "hyperparameters": self.hyperparameters(), "world_size": topology.size,
                              "worker_layout": self.worker_layout()})


class PeriodicExchange:
    """Mixin of an algorithm whose steps make no MPI call but every ``period``-th (its exchange, blocking) and, under
    ``nan_policy="skip"``, each step's vote: the steps between keep no rollback copy (:meth:`Survival.may_communicate`)."""

    nan_policy: str
    period: int
    steps: int

    def may_communicate(self) -> bool:
        return self.nan_policy == "skip" or (self.steps + 1) % self.period == 0  # steps counted after _step


class ServerSurvival:
    """Mixin of an asynchronous algorithm: a lost worker dropped by the server, the others going on (docs/failures.md).

    The server serves the surviving workers to the end of the run; then every survivor shrinks the world
    (:meth:`_survivors`, the runtime's ``survivors``).  A loss in a collective before the serving starts (the run's
    agreement and broadcast) breaks the run: the survivors shrink and run it again from the server's parameters.  A
    lost server raises :class:`~mpiopt.asyncrt.ServerLost` on every survivor: its state existed nowhere else.

    Attributes
    ----------
    dropped : list of Recovery
        The losses the runs survived, oldest first (the training loop takes them to report).
    """

    survival_refusal: ClassVar[Optional[str]] = None  # a lost worker is dropped
    topology: Any
    name: ClassVar[str]
    dropped: List[Any]
    _kept_since_run: Optional[List[int]] = None

    @contextmanager
    def _rollback_point(self, params: Any) -> Iterator[None]:
        """Nothing: the server applies each gradient alone, and a lost worker leaves what it sent applied."""
        yield

    def _keep_ranks(self, kept: Sequence[int]) -> None:
        """The per-rank state renumbered for the survivors: ``kept`` are their ranks in the old world, in order."""
        raise NotImplementedError

    def _survivors(self) -> Optional[Any]:
        """Where the survivors agree that a rank was lost: the world shrunk to them, the state renumbered; else None."""
        if self.topology.all_ok(True):
            return None
        self.shrink()
        return self.topology.world

    def shrink(self) -> None:
        """After a :class:`~mpiopt.comm.RankLost` outside a run, on every survivor: shrink the world and renumber the
        state (``dropped`` records it); :class:`~mpiopt.asyncrt.ServerLost` where the server was lost."""
        before = list(self.topology.first_ranks)
        recovery = self.topology.recover()
        self.dropped.append(recovery)
        if before[SERVER] in recovery.lost:
            raise ServerLost(f"{self.name}: the server (rank {before[SERVER]}) is lost, and its state with it")
        kept = [before.index(first) for first in self.topology.first_ranks]
        self._keep_ranks(kept)
        self._kept_since_run = kept if self._kept_since_run is None else [self._kept_since_run[k] for k in kept]

    def _run_surviving(self, launch: Callable[[Any], Any]) -> Any:
        """``launch(survivors)`` (the runtime's run), again on the survivors where a loss broke it before the serving;
        returns its result.  ``_kept_since_run`` then maps the world of the run that returned to the survivors
        (None: unchanged)."""
        self._kept_since_run = None
        if self.topology.on_failure == "abort":
            return launch(None)
        while True:
            self._kept_since_run = None
            try:
                return launch(self._survivors)
            except ServerLost:
                raise
            except RankLost:  # the server is gone (a worker's loss never reaches a worker), or a collective broke
                self.shrink()
