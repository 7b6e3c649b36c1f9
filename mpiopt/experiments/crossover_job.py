"""One MPI job of ``mpiopt experiment crossover``: train a list of runs, each kept as it completes.

``python -m mpiopt.experiments.crossover_job JOB.json`` (under ``mpiexec``, inside the emulated cluster) reads
``{"task": {...}, "runs": [{"folder", "label", "algorithm", "hyperparameters", "point", "seed", "steps", "tuning"}]}``
(``point``: the tuned values, as ``mpiopt compare --sweep`` applies them; ``"islands": true``: each node one worker;
``"reference"``: see below), skips every run whose ``complete.json`` exists (a restarted experiment goes on where it
stopped), trains the others one after another with :func:`~mpiopt.training.loop.train`, and writes each one's
``complete.json`` (its :func:`~mpiopt.metrics.summarize` at the task's target loss) once its metrics are complete.

A run with a ``reference`` (the folder of the same variant and seed at a faster rate, run before it) is evaluated
once, at its end: a synchronous run steps bit for bit the same at any rate, so its test losses before that are its
reference's, each at this run's own time and bytes at that step (:func:`timed_metrics`).  Its every step's loss and
its last test loss must equal the reference's to the bit; where one does not, the run is trained again with its own
evaluations.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

from ..bench._common import write_json
from ..comm import Topology
from ..metrics import Run, read_metrics, summarize
from ..training.config import TrainConfig

__all__ = ["COMPLETE", "GROUPS_CALIBRATION", "NotRepeated", "run_config", "timed_folder", "with_reference_evaluations",
           "timed_metrics", "done", "pending", "main"]

#: The file that marks a run as done; its folder's metrics are then whole.
COMPLETE = "complete.json"
#: The experiment's calibration of the collectives inside every node at once (its 2 cores shared, as in the runs).
GROUPS_CALIBRATION = "groups-collectives.json"


class NotRepeated(ValueError):
    """A run did not repeat its reference run's steps bit for bit: it cannot take the reference's evaluations."""


def run_config(task: Dict[str, Any], run: Dict[str, Any], borrowing: bool = True) -> TrainConfig:
    """The :class:`TrainConfig` of one run of the job: the task's settings, the run's own, then its grid point;
    evaluated once, at its end, where it takes its reference's evaluations (``borrowing``)."""
    from ..training.tuning import tuning_config, with_point

    algorithm = run["algorithm"]
    config = TrainConfig(**task, steps=run["steps"], seed=run["seed"], out=run["folder"], progress="lines",
                         islands=run.get("islands", False), hyperparameters={algorithm: dict(run["hyperparameters"])})
    if run["tuning"]:  # a diverging candidate skips its non-finite steps and loses, as in compare --sweep
        return tuning_config(config, algorithm, run["point"], run["steps"])
    if borrowing and run.get("reference"):
        config = dataclasses.replace(config, eval_every=run["steps"])
    return with_point(config, algorithm, run["point"])


def timed_folder(rate: str, label: str, seed: int) -> str:
    """Where the timed run of variant ``label`` and ``seed`` at ``rate`` keeps its metrics, under the experiment's folder."""
    return os.path.join(rate, label, f"seed{seed}")


def _same(a: Optional[float], b: Optional[float]) -> bool:
    """Equal to the bit, NaN equal to NaN (a skipped step's loss)."""
    return a == b or (a is not None and b is not None and math.isnan(a) and math.isnan(b))


def with_reference_evaluations(own: Run, reference: Run) -> Run:
    """``own`` with ``reference``'s evaluations before its last, each stamped with ``own``'s time and bytes at its step.

    ``NotRepeated`` names the first step whose training loss differs, or the last test loss if that does.
    """
    if len(own.steps) != len(reference.steps) or not own.evals or not reference.evals:
        raise NotRepeated(f"{own.path} has {len(own.steps)} steps and {len(own.evals)} evaluation(s), its reference "
                          f"{reference.path} {len(reference.steps)} and {len(reference.evals)}")
    for mine, theirs in zip(own.steps, reference.steps):
        if mine["step"] != theirs["step"] or not _same(mine["loss"], theirs["loss"]):
            raise NotRepeated(f"step {mine['step']}: training loss {mine['loss']!r} in {own.path}, {theirs['loss']!r} at "
                              f"step {theirs['step']} in {reference.path}")
    last, theirs = own.evals[-1], reference.evals[-1]
    if last["step"] != theirs["step"] or not _same(last["test_loss"], theirs["test_loss"]):
        raise NotRepeated(f"the last test loss: {last['test_loss']!r} at step {last['step']} in {own.path}, "
                          f"{theirs['test_loss']!r} at step {theirs['step']} in {reference.path}")
    at, sent, within = {}, 0, 0
    for record in own.steps:  # what an evaluation after this step would have recorded of the run so far
        sent += record["bytes_sent"]
        within += record.get("island_bytes_sent", 0)
        at[record["step"]] = {"wall_seconds": record["wall_seconds"], "bytes_sent_total": sent, "island_bytes_sent_total": within}
    borrowed = [dict(e, **at[e["step"]], borrowed_from=reference.path) for e in reference.evals[:-1]]
    return dataclasses.replace(own, evals=borrowed + [last])


def timed_metrics(folder: str, done: Dict[str, Any]) -> Run:
    """The metrics of the finished run in ``folder`` whose ``complete.json`` is ``done``: its own, or with its
    reference's evaluations (``NotRepeated`` if the reference changed since)."""
    own = read_metrics(os.path.join(folder, "metrics.jsonl"))
    reference = done["run"].get("reference")
    if done.get("evaluated") == "own" or not reference:
        return own
    return with_reference_evaluations(own, read_metrics(os.path.join(reference, "metrics.jsonl")))


def done(run: Dict[str, Any]) -> bool:
    """Whether ``run`` completed as asked: its ``complete.json`` names the same run (a changed plan trains again)."""
    path = os.path.join(run["folder"], COMPLETE)
    if not os.path.exists(path):
        return False
    with open(path) as handle:
        return json.load(handle)["run"] == run


def pending(runs: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The runs not :func:`done`."""
    return [r for r in runs if not done(r)]


def main(argv: Sequence[str]) -> int:
    """Train the job's pending runs (a collective call); rank 0 prints a line per run."""
    from ..comm import abort_on_exception
    from ..training.data import load_data
    from ..training.loop import train

    abort_on_exception()
    if len(argv) != 1:
        raise SystemExit("usage: python -m mpiopt.experiments.crossover_job JOB.json")
    with open(argv[0]) as handle:
        job = json.load(handle)
    topology = Topology()
    rank = topology.rank
    todo = pending(job["runs"])
    tag = job.get("tag", "")
    if rank == 0:
        print(f"{tag}: {len(job['runs']) - len(todo)} of {len(job['runs'])} runs already done, {len(todo)} to go", flush=True)
    dataset = load_data(run_config(job["task"], job["runs"][0]), topology.world)
    started = time.perf_counter()
    for number, run in enumerate(todo, 1):
        config = run_config(job["task"], run)
        config.validate([run["algorithm"]])
        train(config, run["algorithm"], topology, dataset, run["folder"], stream=None)
        metrics, mismatch = None, None
        if rank == 0:  # where it has a reference: did it repeat it? (the metrics are rank 0's)
            try:
                metrics = timed_metrics(run["folder"], {"run": run})
            except NotRepeated as error:
                mismatch = str(error)
        if topology.world.bcast_obj(mismatch):
            if rank == 0:
                print(f"{tag}: {run['label']} seed {run['seed']} did not repeat its reference run ({mismatch}): "
                      "training it again, evaluated on its own", flush=True)
            path = train(run_config(job["task"], run, borrowing=False), run["algorithm"], topology, dataset, run["folder"], stream=None)
            metrics = read_metrics(path) if rank == 0 else None
        if rank == 0:
            record = {"run": run, **({"evaluated": "own"} if mismatch else {})}
            summary = summarize(metrics, target_loss=config.target_loss)
            write_json(os.path.join(run["folder"], COMPLETE), dict(record, summary=summary))
            elapsed = time.perf_counter() - started
            reached = summary["time_to_target"]
            print(f"{tag}: {number}/{len(todo)} {run['label']} seed {run['seed']}: test loss {summary['final_loss']:.4f}, "
                  f"{summary['wall_seconds']:.1f} s training, target {config.target_loss:g} "
                  f"{'at %.1f s' % reached if reached is not None else 'not reached'}; "
                  f"{elapsed / 60:.1f} min so far, about {elapsed / number * (len(todo) - number) / 60:.1f} min to go", flush=True)
    topology.Free()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
