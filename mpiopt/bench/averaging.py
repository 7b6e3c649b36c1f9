"""Benchmark: how much of the model averaging DaSGD (and Streaming DiLoCo) hides behind computation.

    OMP_NUM_THREADS=1 tools/emulated_link.sh mpiexec -n 2 python -m mpiopt.bench.averaging

A fixed busy workload is sized so one blocking Allreduce takes ``--comm-steps`` compute steps; the same steps
then run under each mode: compute, sgd, localsgd, dasgd, dasgd+hook, dasgd+thread, dasgd/no-test (the
default ``--modes``), diloco, streaming_diloco, streaming_diloco+thread, streaming_diloco+probe.  Reports each
mode's time over compute's and the fraction of the communication hidden (against localsgd, or diloco).

What each mode does and how repetitions interleave: docs/internals-bench.md; results: docs/benchmarks-averaging.md.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import sys
import time
from typing import Callable, Dict, List, Optional

import numpy as np

from ..algorithms import create
from mpiopt.algorithms.local import LocalSGD
from mpiopt.algorithms.streaming_diloco import fragment_offsets
from mpiopt.bench._common import check_choices, comma_list, markdown_table, median, module_main, positive_int, rotated, say, slowest_seconds
from mpiopt.comm import MAX, Topology
from mpiopt.comm.process import thread_level
from mpiopt.training.config import UsageError

DEFAULT_MODES = ("compute", "sgd", "localsgd", "dasgd", "dasgd+hook", "dasgd+thread", "dasgd/no-test")
OUTER_MODES = ("diloco", "streaming_diloco", "streaming_diloco+thread", "streaming_diloco+probe")  # cycle H = --outer-period, not tau
MODES = DEFAULT_MODES + OUTER_MODES
# Each overlapping mode's blocking counterpart (same bytes, no overlap) and its goal in x compute-only.
BLOCKING = {"dasgd": "localsgd", "streaming_diloco": "diloco"}
GOALS = {"dasgd": 1.10, "streaming_diloco": 1.05}
LOCAL = dict(momentum=0.9, weight_decay=0.01)  # DaSGD's defaults, used by every mode


class Compute:
    """The emulated forward/backward pass: a fixed number of ``size x size`` float32 matmuls per step.

    The work is fixed (not a time), so a core taken by communication or by a
    progress thread shows up as a longer step.
    """

    def __init__(self, size: int = 128, layers: int = 8) -> None:
        rng = np.random.default_rng(0)
        self.matrix = (rng.standard_normal((size, size)) / np.sqrt(size)).astype(np.float32)
        self.out = np.empty_like(self.matrix)
        self.layers = layers
        self.per_layer = 1

    def matmul_seconds(self, repeats: int = 200) -> float:
        """Median time of one matmul."""
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            np.matmul(self.matrix, self.matrix, out=self.out)
            times.append(time.perf_counter() - t0)
        return median(times)

    def step(self, hook: Optional[Callable[[], object]] = None) -> None:
        """One step's work; ``hook`` runs after every layer (a place to poke MPI)."""
        for _ in range(self.layers):
            for _ in range(self.per_layer):
                np.matmul(self.matrix, self.matrix, out=self.out)
            if hook is not None:
                hook()


def _family(mode: str) -> str:
    """The algorithm of a mode's variants (``dasgd`` for ``dasgd+hook``), else the mode itself."""
    return mode.split("+")[0].split("/")[0]


def _progress(mode: str, args: argparse.Namespace) -> Dict[str, object]:
    """The algorithm's progress knobs for a mode: ``+thread`` a helper thread, ``/no-test`` nobody, else one poke per step."""
    progress = "thread" if mode.endswith("+thread") else "none" if mode.endswith("/no-test") else "test"
    return dict(progress=progress, progress_interval=args.progress_interval, tests_per_poke=args.tests_per_poke)


def window_steps(args: argparse.Namespace, modes: List[str]) -> int:
    """Steps timed per mode and repetition: ``periods`` times the common multiple of the selected modes' cycles."""
    cycle = args.period
    if any(m in OUTER_MODES for m in modes):
        cycle = math.lcm(cycle, args.outer_period)
    return args.periods * cycle


def streaming_warmup(period: int, fragments: int, overlap_steps: int) -> int:
    """Warm-up steps after which every ``period``-step window starts and merges each fragment's exchange inside it.

    Needs the widest gap between starts to exceed ``overlap_steps``, else some exchange always crosses a window.
    """
    if fragments > period:
        raise UsageError(f"--fragments {fragments} must be at most --outer-period {period} (streaming_diloco starts one fragment per step)")
    offsets = fragment_offsets(period, fragments)
    gaps = [(offsets[f + 1] if f + 1 < fragments else offsets[0] + period) - offsets[f] for f in range(fragments)]
    widest = max(range(fragments), key=gaps.__getitem__)
    if gaps[widest] <= overlap_steps:
        raise UsageError(
            f"streaming_diloco: with --outer-period {period} and --fragments {fragments} an exchange starts every "
            f"{gaps[widest]} steps, so with --overlap-steps {overlap_steps} one is always in flight; "
            f"use --outer-period of at least {fragments * (overlap_steps + 1)} or fewer fragments"
        )
    return period + offsets[widest] + overlap_steps


class _Mode:
    """One mode's step function, created once and warmed up so that its windows hold whole cycles and can interleave."""

    def __init__(self, mode: str, topology: Topology, compute: Compute, args: argparse.Namespace, params: np.ndarray, grad: np.ndarray) -> None:
        self.topology, self.compute, self.params, self.grad = topology, compute, params, grad
        self.hook: Optional[Callable[[], object]] = None
        warmup = args.delay
        if mode == "compute":
            local = LocalSGD(**LOCAL)
            local.allocate(params)
            self.step = lambda p, g: local.apply(p, g, args.lr)
        else:
            if mode == "sgd":
                alg = create("sgd", topology, lr=args.lr, **LOCAL)
            elif mode == "localsgd":
                alg = create("dasgd", topology, lr=args.lr, period=args.period, delay_steps=0, **LOCAL)
            elif mode == "diloco":
                alg = create("diloco", topology, lr=args.lr, period=args.outer_period, **LOCAL)
            elif _family(mode) == "streaming_diloco":
                alg = create(
                    "streaming_diloco", topology, lr=args.lr, period=args.outer_period, fragments=args.fragments,
                    overlap_steps=args.overlap_steps, alpha=args.alpha, **_progress(mode, args), **LOCAL,
                )
                warmup = streaming_warmup(args.outer_period, args.fragments, args.overlap_steps)
            else:
                alg = create("dasgd", topology, lr=args.lr, period=args.period, delay_steps=args.delay, **_progress(mode, args), **LOCAL)
            alg.setup(params)
            self.step = alg.step
            if mode == "dasgd+hook":
                self.hook = alg.progress_hook
            elif mode == "streaming_diloco+probe":
                probes = range(args.tests_per_poke)
                self.hook = lambda: [topology.world.Iprobe() for _ in probes]
        self.run(warmup)

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.compute.step(self.hook)
            self.step(self.params, self.grad)

    def timed(self, steps: int) -> Dict[str, float]:
        """Per-step seconds (slowest rank) and blocked-in-MPI seconds per step over ``steps`` steps."""
        self.topology.world.Barrier()
        before = self.topology.ledger.snapshot()
        t0 = time.perf_counter()
        self.run(steps)
        elapsed = time.perf_counter() - t0
        comm, wait = self.topology.ledger.since(before).blocked_seconds()
        return {
            "step": self.topology.world.allreduce_obj(elapsed / steps, op=MAX),
            "blocked": self.topology.world.allreduce_obj((comm + wait) / steps, op=MAX),
        }


def _blocking_allreduce_seconds(topology: Topology, n: int, repeats: int = 3) -> float:
    """The slowest rank's seconds for one blocking Allreduce of ``n`` float32, median of ``repeats`` after a warm-up."""
    buf, out = np.ones(n, np.float32), np.empty(n, np.float32)
    times = [slowest_seconds(topology, lambda: topology.world.Allreduce(buf, out=out)) for _ in range(repeats + 1)]
    return median(times[1:])


def _ratios(results: Dict[str, List[Dict[str, float]]], mode: str) -> List[float]:
    """Per-step time of ``mode`` over compute-only's, repetition by repetition."""
    return [r["step"] / c["step"] for r, c in zip(results[mode], results["compute"])]


def _hidden(results: Dict[str, List[Dict[str, float]]], mode: str) -> str:
    """The hidden fraction of an overlapping mode against its blocking counterpart, if both ran."""
    blocking = BLOCKING.get(_family(mode))
    if blocking not in results:
        return ""
    blocking_overhead = median(_ratios(results, blocking)) - 1
    if blocking_overhead <= 0:  # the counterpart measured no cost (noise): no fraction of it to hide
        return "n/a"
    return f"{1 - (median(_ratios(results, mode)) - 1) / blocking_overhead:.0%}"


def _table(results: Dict[str, List[Dict[str, float]]], modes: List[str]) -> str:
    best_compute = min(r["step"] for r in results["compute"])
    header = ["mode", "ms per step", "x compute", "blocked in MPI, ms/step", "communication hidden", "best ms per step", "best x best compute"]
    rows = []
    for mode in modes:
        ratio = median(_ratios(results, mode))
        hidden = _hidden(results, mode)
        best = min(r["step"] for r in results[mode])
        rows.append([
            mode, f"{1e3 * median([r['step'] for r in results[mode]]):.1f}", f"{ratio:.3f}",
            f"{1e3 * median([r['blocked'] for r in results[mode]]):.1f}", hidden, f"{1e3 * best:.1f}", f"{best / best_compute:.3f}",
        ])
    return markdown_table(header, rows)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--params", type=positive_int, default=2_000_000, help="float32 parameters averaged (2M = 8 MB)")
    parser.add_argument("--comm-steps", type=float, default=2.0, help="size the compute step so that one blocking Allreduce takes this many steps")
    parser.add_argument("--period", type=positive_int, default=4, help="tau")
    parser.add_argument("--delay", type=int, default=3, help="d, DaSGD's delay_steps")
    parser.add_argument("--periods", type=positive_int, default=1, help="averaging periods timed per mode and repetition")
    parser.add_argument("--reps", type=positive_int, default=25, help="interleaved repetitions")
    parser.add_argument("--layers", type=positive_int, default=8, help="pieces of a compute step (dasgd+hook pokes MPI after each)")
    parser.add_argument("--matrix", type=positive_int, default=128, help="size of the matmuls of the compute workload")
    parser.add_argument("--progress-interval", type=float, default=0.002, help="seconds between the pokes of the +thread modes")
    parser.add_argument("--tests-per-poke", type=positive_int, default=8, help="Test calls per poke of the dasgd and streaming_diloco modes")
    parser.add_argument("--lr", type=float, default=1e-3, help="learning rate of every mode")
    parser.add_argument("--outer-period", type=positive_int, default=8, help="H of diloco and streaming_diloco")
    parser.add_argument("--fragments", type=positive_int, default=4, help="F, streaming_diloco's fragments")
    parser.add_argument("--overlap-steps", type=int, default=1, help="tau, steps a streaming_diloco exchange overlaps")
    parser.add_argument("--alpha", type=float, default=0.5, help="streaming_diloco's weight of the local fragment in the merge")
    parser.add_argument(
        "--modes", type=comma_list(str), default=list(DEFAULT_MODES),
        help=f"comma-separated subset of {','.join(MODES)} (default: the first seven)",
    )


def run(args: argparse.Namespace) -> int:
    """Run the benchmark (a collective call); rank 0 prints the report."""
    modes = list(args.modes)
    check_choices("--modes", modes, MODES)
    if "compute" not in modes:
        modes.insert(0, "compute")
    if any(_family(m) == "streaming_diloco" for m in modes):  # a combination without a free window boundary fails before the calibration
        streaming_warmup(args.outer_period, args.fragments, args.overlap_steps)

    topology = Topology()
    rank0 = topology.rank == 0
    out = say(topology.rank)
    if topology.size < 2:
        out("warning: one rank: nothing crosses a link; run under mpiexec -n 2 (see docs/benchmarks-averaging.md)", file=sys.stderr)
    if not (os.environ.get("OMP_NUM_THREADS") or os.environ.get("OPENBLAS_NUM_THREADS")):
        out("warning: OMP_NUM_THREADS is not set: BLAS threads of the ranks compete for the cores", file=sys.stderr)

    compute = Compute(args.matrix, args.layers)
    allreduce_s = _blocking_allreduce_seconds(topology, args.params)
    matmul_s = topology.world.bcast_obj(compute.matmul_seconds() if rank0 else None)
    compute.per_layer = max(1, round(allreduce_s / args.comm_steps / args.layers / matmul_s))
    # The values do not matter for timing: one parameter buffer serves every mode.
    params, grad = np.zeros(args.params, np.float32), np.full(args.params, 1e-6, np.float32)
    runners = {m: _Mode(m, topology, compute, args, params, grad) for m in modes}
    window = window_steps(args, modes)

    results: Dict[str, List[Dict[str, float]]] = {m: [] for m in modes}
    for rep in range(args.reps):
        for mode in rotated(modes, rep):
            results[mode].append(runners[mode].timed(window))
        out(f"repetition {rep + 1}/{args.reps}: " + ", ".join(f"{m} {1e3 * results[m][-1]['step']:.1f} ms" for m in modes), file=sys.stderr)

    compute_steps = [r["step"] for r in results["compute"]]
    compute_s = median(compute_steps)
    async_progress = os.environ.get("MPICH_ASYNC_PROGRESS") or os.environ.get("MPIR_CVAR_ASYNC_PROGRESS") or "0"
    out(f"## Averaging benchmark, {datetime.date.today().isoformat()}\n")
    out(
        f"- {topology.size} ranks, link rate {os.environ.get('EMULATED_LINK_RATE', 'not emulated')}, "
        f"MPICH_ASYNC_PROGRESS={async_progress}, thread level {thread_level()} (3 = MULTIPLE), {os.cpu_count()} cores\n"
        f"- {args.params} float32 parameters ({4 * args.params / 1e6:.1f} MB); blocking Allreduce {1e3 * allreduce_s:.1f} ms "
        f"= {allreduce_s / compute_s:.2f} compute steps of {1e3 * compute_s:.1f} ms "
        f"({args.layers} layers x {compute.per_layer} matmuls of {args.matrix}^2)\n"
        f"- tau = {args.period}, d = {args.delay}"
        + (
            f"; H = {args.outer_period}, F = {args.fragments}, overlap_steps = {args.overlap_steps}, alpha = {args.alpha}"
            if any(m in OUTER_MODES for m in modes) else ""
        )
        + f"; {window} timed steps per mode and repetition, "
        f"{args.reps} interleaved repetitions, medians; compute step ranged {1e3 * min(compute_steps):.1f}-"
        f"{1e3 * max(compute_steps):.1f} ms over the repetitions (machine load)\n"
    )
    out(_table(results, modes))
    for family, goal in GOALS.items():
        verdicts = []
        for mode in (m for m in modes if _family(m) == family):
            ratio = median(_ratios(results, mode))
            verdicts.append(f"{mode} {ratio:.3f} ({'met' if ratio <= goal else 'not met'})")
        if verdicts:
            out(f"\ngoal, per-step time <= {goal:.2f} x compute-only: " + "; ".join(verdicts))
    topology.Free()
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    return module_main("averaging", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
