"""One MPI job of ``mpiopt experiment crossover``: train a list of runs, each kept as it completes.

``python -m mpiopt.experiments.crossover_job JOB.json`` (under ``mpiexec``, inside the emulated cluster) reads
``{"task": {...}, "runs": [{"folder", "label", "algorithm", "hyperparameters", "point", "seed", "steps", "tuning"}]}``
(``point``: the tuned values, as ``mpiopt compare --sweep`` applies them; ``"islands": true``: each node one worker),
skips every run whose ``complete.json`` exists (a restarted experiment goes on where it stopped), trains the
others one after another with :func:`~mpiopt.training.loop.train`, and writes each one's ``complete.json`` (its
:func:`~mpiopt.metrics.summarize` at the task's target loss) once its metrics are complete.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Dict, List, Sequence

from ..bench._common import write_json
from ..comm import Topology
from ..metrics import read_metrics, summarize
from ..training.config import TrainConfig

__all__ = ["COMPLETE", "GROUPS_CALIBRATION", "run_config", "done", "pending", "main"]

#: The file that marks a run as done; its folder's metrics are then whole.
COMPLETE = "complete.json"
#: The experiment's calibration of the collectives inside every node at once (its 2 cores shared, as in the runs).
GROUPS_CALIBRATION = "groups-collectives.json"


def run_config(task: Dict[str, Any], run: Dict[str, Any]) -> TrainConfig:
    """The :class:`TrainConfig` of one run of the job: the task's settings, the run's own, then its grid point."""
    from ..training.tuning import tuning_config, with_point

    algorithm = run["algorithm"]
    config = TrainConfig(**task, steps=run["steps"], seed=run["seed"], out=run["folder"], progress="lines",
                         islands=run.get("islands", False), hyperparameters={algorithm: dict(run["hyperparameters"])})
    if run["tuning"]:  # a diverging candidate skips its non-finite steps and loses, as in compare --sweep
        return tuning_config(config, algorithm, run["point"], run["steps"])
    return with_point(config, algorithm, run["point"])


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
        path = train(config, run["algorithm"], topology, dataset, run["folder"], stream=None)
        if rank == 0:
            summary = summarize(read_metrics(path), target_loss=config.target_loss)
            write_json(os.path.join(run["folder"], COMPLETE), {"run": run, "summary": summary})
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
