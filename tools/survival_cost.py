"""What one lost rank costs a training run: wall time to the unbroken run's final test loss, with a kill at the midpoint.

    MPIOPT_MPI=openmpi source tools/setup.sh && python tools/survival_cost.py [--algorithm sgd] [--steps 400] \
        [--on-failure shrink|respawn] [--placing="--map-by ppr:2:node --mca coll ^han"]
    tools/emulated_cluster.sh --nodes 2 --ranks-per-node 2 --rate 1gbit -- python tools/survival_cost.py  # across nodes

``mpiopt train`` on the text task's GPT at 4 ranks with ``--on-failure shrink`` (or ``respawn``), twice: unbroken for ``--steps``
steps, and with rank 2 killed (SIGKILL) at the start of the middle step, allowed 1.5 times the steps.  The target is
the unbroken run's final test loss; each run's time to it is the ``wall_seconds`` of its first evaluation at or
below it (the training's wall time: the broken step and the recovery included, the evaluations not).  Prints both,
their ratio, the killed run's step times before and after the kill, and the median ratio over ``--repeats``
(docs/failures.md, "Measured"; issue 38's goal: at most 1.1).
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import tempfile
from pathlib import Path
from typing import List, Optional, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from mpiopt.metrics.records import Run, read_metrics  # noqa: E402
from tests.e2e.test_survival import run_killing  # noqa: E402  (the tests' launcher and kill)

GPT = ["--dataset", "text", "--model", "gpt", "--n-layer", "2", "--n-embd", "64", "--n-head", "2", "--block-size", "64",
       "--batch-size", "8"]


def evaluations(run: Run) -> List[Tuple[int, float, float]]:
    """(step, wall_seconds, test_loss) of every evaluation in a run's metrics."""
    return [(r["step"], r["wall_seconds"], r["test_loss"]) for r in run.evals]


def step_times(run: Run, kill: int) -> str:
    """The killed run's step times (each step's last record: the redone one) before the kill and after it."""
    before = [r["step_seconds"] for r in run.steps if r["step"] < kill]
    after = [r["step_seconds"] for r in run.steps if r["step"] > kill]
    if not before or not after:
        return "too few step records to compare"
    typical = statistics.median(before)
    slow = sum(t > 3 * typical for t in after)
    return (f"steps before the kill {typical * 1000:.0f} ms, after it {statistics.median(after) * 1000:.0f} ms "
            f"(medians; {slow} of {len(after)} after it over 3x the median before)")


def time_to(evals: List[Tuple[int, float, float]], target: float) -> Optional[Tuple[int, float]]:
    """The step and wall time of the first evaluation at or below ``target``; None where none is."""
    return next(((step, wall) for step, wall, loss in evals if loss <= target), None)


def train(folder: Path, name: str, algorithm: str, steps: int, every: int, on_failure: str, placing: List[str],
          kills: List[str]) -> Run:
    out = folder / name
    args = ["-m", "mpiopt", "train", "--algorithm", algorithm, *GPT, "--steps", str(steps), "--eval-every", str(every),
            "--on-failure", on_failure, "--progress", "lines", "--out", str(out)]
    if algorithm == "diloco":
        args += ["--hp", "diloco.period=20"]
    code, output = run_killing(folder, args, kills, timeout=900, placing=placing)
    run = read_metrics(out / "metrics.jsonl") if (out / "metrics.jsonl").exists() else None
    if code != 0 and (run is None or run.end is None):
        print(output)
        raise SystemExit(f"the {name} run failed (exit {code})")
    if code != 0:  # Open MPI's launcher has crashed after a run with a respawn had ended (docs/failures.md)
        print(f"the {name} run ended, its metrics complete, but mpiexec exited {code}", flush=True)
    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithm", default="sgd", choices=["sgd", "diloco"], help="the algorithm (default sgd)")
    parser.add_argument("--steps", type=int, default=400, help="the unbroken run's steps (default 400)")
    parser.add_argument("--eval-every", type=int, default=10, help="steps between evaluations (default 10)")
    parser.add_argument("--repeats", type=int, default=1, help="pairs of runs (default 1)")
    parser.add_argument("--on-failure", default="shrink", choices=["shrink", "respawn"],
                        help="what the killed rank does: shrink (go on with 3 ranks) or respawn (a replacement joins); "
                             "default shrink")
    parser.add_argument("--placing", default="--oversubscribe", type=shlex.split,
                        help="mpiexec's options that place the ranks (default --oversubscribe); on an emulated cluster "
                             "of 3 slots a node, \"--map-by ppr:2:node --mca coll ^han\" leaves a slot for a replacement "
                             "and keeps Open MPI's hierarchical collectives off a world it joins (docs/failures.md)")
    args = parser.parse_args()
    if args.steps < 4 or args.eval_every < 1 or args.repeats < 1:
        parser.error(f"--steps must be >= 4, --eval-every and --repeats >= 1; got {args.steps}, {args.eval_every}, {args.repeats}")
    ratios = []
    for repeat in range(args.repeats):
        with tempfile.TemporaryDirectory() as folder:
            unbroken = evaluations(train(Path(folder), "unbroken", args.algorithm, args.steps, args.eval_every,
                                         args.on_failure, args.placing, []))
            killed_run = train(Path(folder), "killed", args.algorithm, args.steps * 3 // 2, args.eval_every,
                               args.on_failure, args.placing, [f"2@{args.steps // 2}"])
        steps, killed = step_times(killed_run, args.steps // 2), evaluations(killed_run)
        target = unbroken[-1][2]
        step0, wall0 = time_to(unbroken, target)
        reached = time_to(killed, target)
        if reached is None:
            print(f"run {repeat + 1}: the killed run did not reach the target loss {target:.4f} in {args.steps * 3 // 2} steps "
                  f"(its best {min(loss for _, _, loss in killed):.4f})", flush=True)
            continue
        step1, wall1 = reached
        ratios.append(wall1 / wall0)
        print(f"run {repeat + 1}: target test loss {target:.4f}: unbroken {wall0:.2f} s (step {step0}), rank 2 killed at "
              f"step {args.steps // 2}: {wall1:.2f} s (step {step1}); ratio {ratios[-1]:.3f}; {steps}", flush=True)
    if ratios:
        print(f"median ratio of {len(ratios)}: {statistics.median(ratios):.3f} ({args.algorithm}, 4 ranks, "
              f"then {'4 again' if args.on_failure == 'respawn' else 3}, "
              f"GPT on the text task, {args.steps} steps unbroken)")
    return 0 if len(ratios) == args.repeats else 1


if __name__ == "__main__":
    sys.exit(main())
