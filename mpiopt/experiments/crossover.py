"""Which algorithm wins at which bandwidth: DDP and mpiopt's algorithms on the emulated 2-node cluster at three rates.

Claim (docs/crossover.md): the ranking of the algorithms by time to a target loss changes with the link's rate,
and the alpha-beta model (docs/scaling.md) predicts each one's step time at each rate.  This experiment is a
driver, started with plain ``python`` as root: it starts its own MPI jobs (:mod:`.crossover_job`) inside
``tools/emulated_cluster.sh`` (2 nodes of 2 ranks), one per phase and rate:

1. *tuning* (at :data:`TUNING_RATE`; the loss after a number of steps does not depend on the link): every
   variant's learning rates (and periods), the same grid for everyone, each axis extended past an edge that wins;
   of periods whose losses tie, the longest wins;
2. *main runs*: every variant with every seed at every rate, round by round (every variant once per seed); at the
   slower rates evaluated once, taking the first rate's evaluations (:func:`.crossover_job.timed_metrics`);
3. *calibration*: ``bench collectives`` at each rate, and between a node's two ranks (shared memory, where a
   group's calls run; inside every node at once, each call after a step's work), for the model's ``alpha`` and
   ``beta``.

Each run's result is kept as it completes (``complete.json``), so the same command resumes an interrupted
experiment.  :mod:`.crossover_report` turns the results into the figure, the tables and the verdicts.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import threading
import time
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

from ..bench._common import child_environment, mpiexec_path, parse_rate, repository_tool, write_json
from ..bench.collectives import GLOO_ALLREDUCE
from ..training.config import UsageError
from ..training.tuning import evaluations_shape, lowest
from . import EXPERIMENTS
from .crossover_job import COMPLETE, GROUPS_CALIBRATION, pending, timed_folder

RANKS = EXPERIMENTS["crossover"].ranks
NODES, RANKS_PER_NODE = 2, 2
TUNING_RATE = "10gbit"
ADAMW_RATES = (3e-4, 1e-3, 3e-3)
#: Signum's own update is the sign of a momentum: its rate is a step per element, a smaller scale than AdamW's.
SIGNUM_RATES = (1e-4, 3e-4, 1e-3)
#: How many times an axis of a grid may grow past an edge that won (rates by 3x, periods by 2x each time).
EXTENSIONS = 2
#: Tuning losses within this fraction of the lowest are a tie, which the longest period wins (:func:`choose`).
TIE = 0.01
#: The shaped link's token bucket holds this long a burst at its rate, at most :data:`MAX_BURST_BYTES`: a real
#: line takes its time for every byte, and a bucket that refills while ranks compute lets a small exchange pass
#: at once (docs/crossover.md, "The link").
BURST_SECONDS = 0.005
#: ``tools/emulated_cluster.sh``'s default bucket (tc's ``1mb``, 1 MiB): from 10 Gbit/s the CPU bounds the link here.
MAX_BURST_BYTES = 1 << 20


class Variant(NamedTuple):
    """One line of the map: its label, algorithm, fixed hyperparameters, and the grids it is tuned over."""

    label: str
    algorithm: str
    hyperparameters: Dict[str, Any]
    rates: Tuple[float, ...]
    periods: Tuple[Optional[int], ...] = (None,)
    #: The hyperparameter the period axis sets (``lsgd``: its global pulls, the ones that cross the link).
    period_name: str = "period"
    #: Each node one worker (``--islands``): 2 workers of 2 ranks instead of 4 (docs/islands.md).
    islands: bool = False


VARIANTS = (
    Variant("ddp", "ddp", {}, ADAMW_RATES),
    Variant("sgd", "sgd", {}, ADAMW_RATES),
    Variant("dasgd", "dasgd", {}, ADAMW_RATES, (4, 8)),
    Variant("lsgd", "lsgd", {}, ADAMW_RATES, (8, 16), "global_period"),
    Variant("diloco", "diloco", {}, ADAMW_RATES, (8, 16)),
    Variant("diloco-int8", "diloco", {"codec": "int8"}, ADAMW_RATES, (8, 16)),
    Variant("streaming_diloco", "streaming_diloco", {}, ADAMW_RATES, (8, 16)),
    Variant("sparseloco", "sparseloco", {}, ADAMW_RATES, (8, 16)),
    Variant("signum", "signum", {}, SIGNUM_RATES),
    Variant("topk", "topk", {}, ADAMW_RATES),
    Variant("diloco-islands", "diloco", {}, ADAMW_RATES, (8, 16), islands=True),
    Variant("streaming_diloco-islands", "streaming_diloco", {}, ADAMW_RATES, (8, 16), islands=True),
    Variant("sparseloco-islands", "sparseloco", {}, ADAMW_RATES, (8, 16), islands=True),
    Variant("signum-islands", "signum", {}, SIGNUM_RATES, islands=True),
)
#: The GPT text task: small enough that DDP's exchange is a visible share of a step even at 10 Gbit/s here.
TASK = dict(dataset="text", model="gpt", n_layer=2, n_embd=192, n_head=4, block_size=32, batch_size=2,
            optimizer="adamw", eval_every=10, target_loss=2.6, threads=1, log_every=50)
FULL = dict(rates=("10gbit", "1gbit", "100mbit"), seeds=(0, 1, 2), steps=200, tuning_steps=100, variants=VARIANTS, task=TASK,
            calibration_sizes="16k,128k,512k,1M", calibration_repeats=10)
QUICK = dict(rates=("1gbit", "100mbit"), seeds=(0,), steps=6, tuning_steps=3,
             variants=(Variant("sgd", "sgd", {}, (1e-3,)), Variant("diloco", "diloco", {}, (1e-3,), (3,)),
                       Variant("diloco-islands", "diloco", {}, (1e-3,), (3,), islands=True)),
             task=dict(TASK, n_layer=1, n_embd=32, n_head=2, eval_every=3, target_loss=5.4, log_every=3),
             calibration_sizes="16k,64k", calibration_repeats=3)


def settings(quick: bool) -> Dict[str, Any]:
    """The experiment's sizes: :data:`FULL`, or :data:`QUICK` (seconds; its numbers mean nothing)."""
    return QUICK if quick else FULL


def point_name(point: Dict[str, Any]) -> str:
    """A folder name for a grid point: ``lr0.001-period8``."""
    return "-".join(f"{k}{v:g}" if isinstance(v, float) else f"{k}{v}" for k, v in point.items())


def grid(rates: Sequence[float], periods: Sequence[Optional[int]], period_name: str = "period") -> List[Dict[str, Any]]:
    """The grid points: every learning rate with every period (None: the variant has no period to tune)."""
    return [{"lr": lr, **({} if period is None else {period_name: period})} for lr, period in itertools.product(rates, periods)]


def burst_bytes(rate: str) -> int:
    """The token bucket of the link at ``rate``: :data:`BURST_SECONDS` of the line, at most :data:`MAX_BURST_BYTES`."""
    return min(MAX_BURST_BYTES, int(parse_rate(rate) * BURST_SECONDS / 8))


def link(rate: str) -> Dict[str, Any]:
    """How the link at ``rate`` is shaped: part of every timed run's and calibration's identity."""
    return {"rate": rate, "burst_bytes": burst_bytes(rate)}


def extended(values: Sequence[Any], chosen: Any, grown: int, factor: float) -> Optional[Any]:
    """The value to add when ``chosen`` is an edge of ``values`` (``factor`` beyond it), None when inside or grown enough.

    Learning rates grow by 3, periods by 2 and never below 2 (a period of 1 is data-parallel SGD, and dasgd's
    one step of delay needs a longer period).
    """
    if len(values) < 2 or grown >= EXTENSIONS or chosen is None:
        return None
    beyond = chosen / factor if chosen == min(values) else chosen * factor if chosen == max(values) else None
    if beyond is None or not isinstance(chosen, int):
        return beyond
    return max(2, int(beyond)) if max(2, int(beyond)) not in values else None


def choose(scored: Sequence[Tuple[Optional[float], Dict[str, Any]]], period_name: str = "period") -> Dict[str, Any]:
    """The tuning's pick from ``(last test loss or None, point)``: the lowest loss, or the longest period within :data:`TIE`.

    A longer period at the winner's learning rate whose loss is within :data:`TIE` of the winner's replaces it:
    one seed's loss after a short run cannot tell them apart, and it communicates less.
    """
    best_loss, best = scored[lowest([loss for loss, _ in scored])]
    if best_loss is None or period_name not in best:
        return best
    ties = [p for loss, p in scored if loss is not None and loss <= best_loss * (1 + TIE) and p["lr"] == best["lr"]]
    return max(ties, key=lambda p: p[period_name])


def run_entry(out: str, variant: Variant, point: Dict[str, Any], seed: int, steps: int, folder: str,
              shaping: Optional[Dict[str, Any]] = None, reference: Optional[str] = None) -> Dict[str, Any]:
    """One run of a job file; a timed run names its link's ``shaping``, a tuning run (its loss only counts) none.

    ``reference``: the folder (under ``out``) of the same run at a faster rate, whose evaluations it takes
    (:func:`~.crossover_job.timed_metrics`)."""
    return {"folder": os.path.join(out, folder), "label": variant.label, "algorithm": variant.algorithm,
            "hyperparameters": variant.hyperparameters, "point": point, "seed": seed, "steps": steps,
            "tuning": shaping is None, **({} if shaping is None else {"link": shaping}), **({"islands": True} if variant.islands else {}),
            **({} if reference is None else {"reference": os.path.join(out, reference)})}


class LoadSampler:
    """The 1-minute load average every ``every`` seconds while jobs run, appended to ``path`` (kept across restarts)."""

    def __init__(self, path: str, every: float = 20.0) -> None:
        self.path, self.every, self._stop = path, every, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(self.every):
            with open(self.path, "a") as handle:
                handle.write(json.dumps({"time": time.time(), "load": os.getloadavg()[0]}) + "\n")

    def __enter__(self) -> "LoadSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


def launch(rate: str, command: Sequence[str], what: str) -> None:
    """Run ``command`` on the emulated cluster at ``rate``; ``RuntimeError`` naming ``what`` if it fails."""
    cluster = [repository_tool("emulated_cluster.sh", "experiment crossover"), "--nodes", str(NODES),
               "--ranks-per-node", str(RANKS_PER_NODE), "--rate", rate, "--"]
    env = dict(child_environment(), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", BURST=str(burst_bytes(rate)))
    sys.stdout.flush()
    code = subprocess.run([*cluster, *command], env=env).returncode
    if code != 0:
        raise RuntimeError(f"{what} at {rate} failed (exit {code}); the runs completed so far are kept: "
                           "run the same command again to go on from there")


def train_job(out: str, name: str, rate: str, task: Dict[str, Any], runs: List[Dict[str, Any]]) -> None:
    """Write job ``name``'s file and run its pending runs on the cluster at ``rate``."""
    path = os.path.join(out, "jobs", f"{name}.json")
    write_json(path, {"tag": f"[{name}]", "task": task, "runs": runs})
    if pending(runs):
        launch(rate, [mpiexec_path("experiment crossover"), "-n", str(RANKS), sys.executable, "-m",
                      "mpiopt.experiments.crossover_job", path], f"job {name}")
    else:
        print(f"[{name}]: all {len(runs)} runs already done", flush=True)


def score(run: Dict[str, Any]) -> Optional[float]:
    """A tuning run's last test loss (None if it diverged)."""
    with open(os.path.join(run["folder"], COMPLETE)) as handle:
        loss = json.load(handle)["summary"]["final_loss"]
    return None if loss is None or loss != loss else float(loss)


def tune(out: str, s: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    """Every variant's chosen grid point (:func:`choose`) by the last test loss after ``tuning_steps`` steps (seed 0)."""
    axes = {v.label: {"lr": list(v.rates), "period": list(v.periods)} for v in s["variants"]}
    grown = {(v.label, key): 0 for v in s["variants"] for key in ("lr", "period")}
    runs: Dict[str, List[Dict[str, Any]]] = {v.label: [] for v in s["variants"]}
    for round_ in itertools.count(1):
        for v in s["variants"]:
            have = {point_name(r["point"]) for r in runs[v.label]}
            runs[v.label] += [run_entry(out, v, p, 0, s["tuning_steps"], os.path.join("tuning", v.label, point_name(p)))
                              for p in grid(*axes[v.label].values(), v.period_name) if point_name(p) not in have]
        train_job(out, f"tuning-{round_}", TUNING_RATE, s["task"], [r for v in s["variants"] for r in runs[v.label]])
        chosen, more = {}, False
        for v in s["variants"]:
            chosen[v.label] = choose([(score(r), r["point"]) for r in runs[v.label]], v.period_name)
            for key, setting, factor in (("lr", "lr", 3.0), ("period", v.period_name, 2)):
                beyond = extended(axes[v.label][key], chosen[v.label].get(setting), grown[(v.label, key)], factor)
                if beyond is not None:
                    axes[v.label][key].append(beyond)
                    grown[(v.label, key)] += 1
                    more = True
        if not more:
            write_json(os.path.join(out, "tuning.json"), {
                "steps": s["tuning_steps"], "rate": TUNING_RATE, "tie": TIE, "chosen": chosen,
                "candidates": {label: [{"point": r["point"], "test_loss": score(r)} for r in rs] for label, rs in runs.items()}})
            return chosen


#: The collectives timed at each rate for the model: mpiopt's (MPICH) and DDP's (torch's gloo Allreduce).
LINK_OPERATIONS = f"allreduce,iallreduce,allgather-bits,vote-twophase,bcast,{GLOO_ALLREDUCE}"
#: Between a node's two ranks, where a group's calls (``lsgd``'s local pulls) and an island's run (its mean gradient,
#: the reassembly of what its rails exchanged).
NODE_OPERATIONS = "allreduce,iallreduce,bcast,allgather-bits,allgatherv-sparse"
#: Inside every node at once, each call follows about this much work with no barrier (``bench collectives
#: --after-work``): an island step's computation here, after which its mean gradient meets cold caches and waits for
#: the node's slower rank (docs/crossover.md, "The model beside the measurements").
GROUP_WORK_SECONDS = 0.03


def calibrate_link(path: str, rate: str, ranks: int, operations: str, s: Dict[str, Any], what: str,
                   within_groups: bool = False, after_work: float = 0.0) -> None:
    """``bench collectives`` of ``operations`` at ``ranks`` on the link at ``rate`` into ``path`` (``within_groups``: in
    every node at once; ``after_work``: each call after that much work), unless done so for this link (and these
    operations)."""
    if os.path.exists(path):
        with open(path) as handle:
            document = json.load(handle)
        timed = document.get("operations", ",".join(sorted({r["op"] for r in document["results"]})))
        if (document.get("shaping") == link(rate) and set(operations.split(",")) <= set(timed.split(","))
                and document.get("after_work_seconds", 0.0) == after_work):
            return
    launch(rate, [mpiexec_path("experiment crossover"), "-n", str(ranks), sys.executable, "-m", "mpiopt", "bench", "collectives",
                  "--sizes", s["calibration_sizes"], "--repeats", str(s["calibration_repeats"]), "--ops", operations,
                  *(["--within-groups"] if within_groups else []), *(["--after-work", str(after_work)] if after_work else []),
                  "--json", path], what)
    with open(path) as handle:
        document = json.load(handle)
    write_json(path, dict(document, shaping=link(rate), operations=operations))


def main_runs(out: str, s: Dict[str, Any], chosen: Dict[str, Dict[str, Any]]) -> None:
    """Every variant at its chosen point, every seed, every rate; then the collectives at that rate, and in a node: its
    two ranks alone (the projection's node), and every node's at once (what the runs' groups and islands met)."""
    calibrate_link(os.path.join(out, "node-collectives.json"), s["rates"][0], RANKS_PER_NODE, NODE_OPERATIONS, s,
              "calibration of a node (bench collectives)")
    calibrate_link(os.path.join(out, GROUPS_CALIBRATION), s["rates"][0], RANKS, NODE_OPERATIONS, s,
                   "calibration within every node at once (bench collectives --within-groups --after-work)",
                   within_groups=True, after_work=GROUP_WORK_SECONDS)
    first = s["rates"][0]
    for rate in s["rates"]:
        # At a slower rate a synchronous run repeats the first rate's steps bit for bit: its test losses are taken from there.
        runs = [run_entry(out, v, chosen[v.label], seed, s["steps"], timed_folder(rate, v.label, seed), link(rate),
                          None if rate == first or evaluations_shape(v.algorithm) else timed_folder(first, v.label, seed))
                for seed in s["seeds"] for v in s["variants"]]
        train_job(out, f"main-{rate}", rate, s["task"], runs)
        calibrate_link(os.path.join(out, rate, "collectives.json"), rate, RANKS, LINK_OPERATIONS, s, "calibration (bench collectives)")


def check_can_run() -> None:
    """``UsageError`` unless this process can build the emulated cluster: root, outside mpiexec, the tools there."""
    from ..comm.process import world_size

    if world_size() > 1:
        raise UsageError("experiment crossover starts its own MPI jobs: run it with plain python, not under mpiexec")
    if os.geteuid() != 0:
        raise UsageError("experiment crossover builds the emulated cluster (network namespaces, tc): run it as root")
    repository_tool("emulated_cluster.sh", "experiment crossover")
    mpiexec_path("experiment crossover")


def run(out: str, quick: bool) -> Dict[str, Any]:
    """Tune, run and calibrate (resuming what a previous call left), then report; the results document."""
    from .crossover_report import report

    check_can_run()
    s = settings(quick)
    started = time.perf_counter()
    with LoadSampler(os.path.join(out, "load.jsonl")):
        chosen = tune(out, s)
        main_runs(out, s, chosen)
    print(f"all runs done in {(time.perf_counter() - started) / 60:.1f} min (this call); writing the report", flush=True)
    return report(out, s, chosen, quick)
