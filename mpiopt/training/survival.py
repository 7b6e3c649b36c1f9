"""Training on after a lost rank (``--on-failure shrink``, docs/failures.md).

A :class:`~mpiopt.comm.RankLost` reaches the training loop on every survivor alike: from a step (the algorithm put
the parameters back to its start) or from the evaluation and checkpoint after it (the step stands).  The survivors
shrink the topology, move the optimizer to themselves, re-shard the data, say so on every rank and in the metrics,
and go on.  One lost as a run starts (:class:`StartLost`) has the run start again on the survivors.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, TypeVar

from ..checkpoint import CheckpointError
from ..comm import IslandLeft, RankLost, Topology
from ..comm.survival import INJECTION
from ..metrics import MetricsWriter
from ..metrics.summary import named_ranks

__all__ = ["go_on_without_lost_ranks", "Respawn", "report_dropped_workers", "starting", "StartLost", "surviving_the_start"]

T = TypeVar("T")


class StartLost(RankLost):
    """A rank was lost while a run started (its set-up, its resume), before its first step: every survivor raises it
    (:func:`starting`), and :func:`surviving_the_start` starts the run again on them."""


@contextmanager
def starting(topology: Topology) -> Iterator[None]:
    """Around a run's start, whose collectives are the set-up's and the resume's: with survival on, the survivors of a
    rank lost in it agree at its end, and every one raises :class:`StartLost`.  The test hook's ``RANK@0:start``
    pauses a rank as the job's first run starts."""
    INJECTION.current = max(INJECTION.current, 0)
    INJECTION.reached("start")
    try:
        with topology.agreed("the run's start"):
            yield
    except RankLost as lost:  # the agreement's, on every survivor alike
        raise StartLost(str(lost)) from None


def surviving_the_start(run: Callable[[], T], topology: Topology, islands: bool, respawn: bool = False) -> T:
    """``run()`` (a training run on ``topology``), started again on the survivors each time a rank is lost before its
    first step (:class:`StartLost`; from the same start: its resume, or step 0).  ``islands``: the run's workers are
    islands, and an island that lost a rank leaves whole (:class:`~mpiopt.comm.IslandLeft` on its other ranks).
    ``respawn`` (``--on-failure respawn``): :class:`Respawn` instead, without a checkpoint: the replacements start the
    run with the survivors from where it was starting."""
    while True:
        try:
            return run()
        except StartLost:
            rank = topology.first_ranks[topology.rank]
            try:
                recovery = topology.recover(whole_groups=islands)
            except IslandLeft as left:
                print(f"mpiopt: rank {rank}: {named_ranks('lost rank', left.lost)} as the run started ({_leaving(left, respawn)})", file=sys.stderr, flush=True)
                raise
            again = ("starting it again with a process in each lost rank's place" + (" and each that left" if recovery.left else "")
                     if respawn else "starting it again")
            print(f"mpiopt: rank {rank}: {named_ranks('lost rank', recovery.lost)} as the run started ({_left(recovery)}{again}); "
                  f"the world is now {_ranks(recovery.size)}", file=sys.stderr, flush=True)
            if respawn:
                raise Respawn(None, None, recovery.lost, time.perf_counter(), recovery.left, islands)


class Respawn(Exception):
    """Out of :func:`~mpiopt.training.loop.train` on every survivor (``--on-failure respawn``): the survivors saved
    ``checkpoint`` after ``step``; processes started for the ``lost`` ranks and for those that ``left`` with their
    island (islands stay whole: a new one takes a broken one's place) resume from it with them.  Both None where the
    run had not begun (:func:`surviving_the_start`): it starts again as it was starting, the replacements with it."""

    def __init__(self, checkpoint: Optional[str], step: Optional[int], lost: list, since: float, left: Sequence[int] = (),
                 islands: bool = False) -> None:
        super().__init__(f"lost ranks {lost}: replacements to {f'resume from {checkpoint}' if checkpoint else 'start the run with'}")
        self.checkpoint, self.step, self.lost, self.left = checkpoint, step, lost, list(left)
        #: Whether the broken run's workers were islands (only whole ones survived): the replacements form new ones.
        self.islands = islands
        #: When the survivors' wall time stopped counting (``time.perf_counter()``): the resumed run counts on from it.
        self.since = since

    @property
    def replaced(self) -> List[int]:
        """The ranks (numbered as in the job's first world) whose places the replacements take, in order."""
        return sorted([*self.lost, *self.left])


def go_on_without_lost_ranks(run: Any, step: int, replacing: Optional[Tuple[Sequence[int], Sequence[int]]] = None,
                             earlier: Tuple[Sequence[int], Sequence[int]] = ((), ())) -> int:
    """On every survivor after a RankLost in step ``step + 1`` of ``run`` (a training loop's run): recover; returns
    the step to go on from (the failed one again, or the next where the loss came after the step was applied).
    ``--on-failure respawn`` raises :class:`Respawn` instead, for these lost ranks and ``replacing`` (the ranks lost,
    and those that left with their island, before and not yet replaced; default: ``run.unreplaced``).  ``earlier``:
    the ranks lost, and those that left, in a recovery that a further loss broke (told with this one)."""
    respawn, islands = run.config.on_failure == "respawn", run.config.whole_islands
    try:
        recovery = run.topology.recover(whole_groups=islands)
    except IslandLeft as left:  # this rank's island lost a rank: the others' run goes on without it
        _tell(run, f"{named_ranks('lost rank', [*earlier[0], *left.lost])} at step {step + 1}", f"{_leaving(left, respawn)})", None)
        raise
    recovery = dataclasses.replace(recovery, lost=[*earlier[0], *recovery.lost], left=[*earlier[1], *recovery.left])
    try:
        with run.topology.agreed("the move to the survivors"):  # the optimizer's state and the data's shards
            run.opt.recover()
            _reshard(run, reporter=0)
    except RankLost:  # another rank lost meanwhile: recover from it too, and tell both losses as one
        return go_on_without_lost_ranks(run, step, replacing, (recovery.lost, recovery.left))
    applied = run.applied == step + 1
    resume = step + 1 if applied else step
    redone = "kept; going on from the next" if applied else "redone"
    # The run's wall time counts the broken step (or phase after it) and the recovery: the price of the loss.
    _count_wall_time(run)
    _tell(run, f"{named_ranks('lost rank', recovery.lost)} at step {step + 1}", f"{_left(recovery)}the step {redone}); the world is now {_ranks(recovery.size)}",
          {"step": step + 1, "lost": recovery.lost, "left": recovery.left, "world_size": recovery.size, "redone": not applied})
    if not respawn:
        return resume
    # The state the replacements take, saved by the survivors at the shrunk size.
    before = run.unreplaced if replacing is None else replacing
    lost, left = [*before[0], *recovery.lost], [*before[1], *recovery.left]
    failed = None
    try:
        with run.topology.agreed("the checkpoint for the replacements"):  # saved on every survivor, or on none
            counters, since = run.totals.counters(), time.perf_counter()
            try:
                path = run.checkpoints.save(resume, counters=counters)
            except CheckpointError as error:  # on every survivor alike (a full disk, a quota); agreed on below
                failed = error
            if run.tracer and failed is None:  # the steps so far, in a file of their own: the resumed run writes anew
                _keep_trace(run, f"{os.path.splitext(run.trace_path)[0]}.until-step-{resume}.json")
    except RankLost:  # another loss while saving: recover again, then replace them all
        return go_on_without_lost_ranks(run, resume - 1, (lost, left))
    if failed is not None:  # no hand-over: train on, and replace these with those of a later loss
        run.unreplaced = (lost, left)
        _count_wall_time(run)
        if run.topology.rank == 0:
            print(f"mpiopt: --on-failure respawn: the checkpoint for the replacements could not be saved ({failed}); "
                  f"going on with {_ranks(recovery.size)}, as --on-failure shrink would, until a later loss",
                  file=sys.stderr, flush=True)
        return resume
    raise Respawn(path, resume, lost, since, left, islands)


def _count_wall_time(run: Any) -> None:
    """The run's wall time since ``run.uncounted_since`` added to its totals; a second loss counts on from now."""
    now = time.perf_counter()
    run.totals.wall_seconds += now - run.uncounted_since
    run.uncounted_since = now


def _keep_trace(run: Any, path: str) -> None:
    """The trace so far written to ``path`` (collective), or said why not: a trace is not worth the run."""
    try:
        run.tracer.write(path)
    except OSError as error:  # rank 0's file alone
        print(f"mpiopt: the trace of the steps before the join is lost: {error}", file=sys.stderr, flush=True)


def _leaving(left: IslandLeft, respawn: bool) -> str:
    """What a rank that leaves with its island says (:class:`~mpiopt.comm.IslandLeft`); ``respawn``: processes start
    in the island's places."""
    goes_on = "the other islands go on and try to start processes in its ranks' places" if respawn else "the other islands go on"
    ends = (f"{goes_on}; this rank's part ends" if left.size else
            "no island survived whole: the run ends; resume it from its newest checkpoint with --resume auto")
    return f"its island with it: ranks {left.left} leave; {ends}"


def _left(recovery: Any) -> str:
    """What the survivors of a recovery say of the ranks that left with their island, if any."""
    return f"ranks {recovery.left} left with their island; " if recovery.left else ""


def _ranks(count: int) -> str:
    return f"{count} rank{'s' if count != 1 else ''}"


def _tell(run: Any, lost: str, how: str, record: Optional[Dict[str, Any]]) -> None:
    """Say a loss on this survivor: the trace's mark ``lost``, the line ``mpiopt: rank R: LOST (HOW`` on stderr, and
    where it writes the metrics, their ``"lost"`` record (``record`` and the run's wall time so far).  A rank that
    leaves the world (``record`` None) says the line only: the survivors keep the trace and the metrics."""
    print(f"mpiopt: rank {run.topology.first_ranks[run.topology.rank]}: {lost} ({how}", file=sys.stderr, flush=True)
    if record is None:
        return
    if run.tracer:
        run.tracer.survivors(run.topology.world, lost)
    if run.writer:
        run.writer.write({"kind": "lost", **record, "wall_seconds": run.totals.wall_seconds})


def _reshard(run: Any, reporter: int) -> None:
    """The data re-sharded over the survivors, the test set too; rank 0 of the new world writes, ``reporter`` reports."""
    world, config = run.topology.world, run.config
    run.batches = type(run.batches)(run.dataset, config.batch_size, config.seed, config.augment, world, run.is_asynchronous, run.device)
    run.evaluator = type(run.evaluator)(run.model, run.dataset, world, run.source, config.precision)
    if world.rank == 0 and run.writer is None:
        run.writer = MetricsWriter(os.path.join(run.out_dir, "metrics.jsonl"))
        run.cleanup.callback(run.writer.close)
    if world.rank == reporter and run.progress.stream is None:
        run.progress = type(run.progress)(run.algorithm, run.steps, run.progress.every, run.stream, config.progress)


def report_dropped_workers(run: Any, first: int, last: int, server_lost: bool = False) -> None:
    """After an asynchronous segment of steps ``first``..``last`` (or the phase after it) that lost ranks, on every
    survivor: the losses the algorithm survived (its ``dropped``) said on every rank and in the metrics, the data
    re-sharded.  ``server_lost``: the latest loss took the server (:class:`~mpiopt.asyncrt.ServerLost`), and the run
    cannot go on: its parameters and state existed nowhere else."""
    dropped = run.opt.algorithm.dropped
    if len(dropped) == run.dropped_told:
        return
    _reshard(run, reporter=min(1, run.topology.size - 1))  # once, over the survivors of them all
    for i, recovery in enumerate(dropped[run.dropped_told:], start=run.dropped_told):
        server = server_lost and i == len(dropped) - 1
        went_on = ("the server among them, whose parameters and state existed nowhere else: the run ends; resume it "
                   "from its newest checkpoint with --resume auto)" if server else
                   f"the server dropped it; the others went on); the world is now {_ranks(recovery.size)}")
        _tell(run, f"{named_ranks('lost rank', recovery.lost)} in steps {first}-{last}", went_on,
              {"step": last, "lost": recovery.lost, "world_size": recovery.size, "redone": False, "server": server})
    run.dropped_told = len(dropped)
