"""Benchmark: compressed exchanges against a float32 Allreduce, per training step.

    OMP_NUM_THREADS=1 tools/emulated_link.sh mpiexec -n 4 python -m mpiopt.bench.compressed

Modes allreduce (``sgd``), vote/allgather, vote/twophase, vote/auto (``signum``) and topk/<density> run whole
optimizer steps, so the algorithms' own work counts.  Reports speed-up over allreduce, bytes received and the
wire's limit.  Method: docs/internals-bench.md; results: docs/benchmarks-compressed.md.
"""

from __future__ import annotations

import argparse
from typing import Dict, List, Optional

import numpy as np

from ..algorithms import available, create
from ..comm import abort_on_exception
from ..comm.process import host
from mpiopt.bench._common import count, markdown_table, median, module_main, positive_int, rotated, slowest_seconds
from mpiopt.comm import Topology

MODES = {
    "allreduce": ("sgd", {}),
    "vote/allgather": ("signum", {"exchange": "allgather", "pipeline_chunks": 1, "momentum": 0.0, "weight_decay": 0.0}),
    "vote/twophase": ("signum", {"exchange": "twophase", "pipeline_chunks": 1, "momentum": 0.0, "weight_decay": 0.0}),
    "vote/auto": ("signum", {"exchange": "auto", "momentum": 0.0, "weight_decay": 0.0}),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--d", type=count, default=11_000_000, help="parameters (suffixes k, M, G)")
    parser.add_argument("--steps", type=positive_int, default=3, help="timed steps per mode and repetition")
    parser.add_argument("--reps", type=positive_int, default=5, help="interleaved repetitions")
    parser.add_argument("--densities", type=float, nargs="*", default=[0.01, 0.001], help="top-k densities")


def modes(densities: List[float]) -> Dict[str, tuple]:
    out = dict(MODES)
    if "topk" in available():
        for density in densities:
            out[f"topk/{density:g}"] = ("topk", {"density": density})
    return out


def wire_bytes(delta, ranks: int) -> float:
    """Bytes one rank receives on the wire for the calls in a ledger ``delta`` (an Allreduce as a ring moves it)."""
    total = 0.0
    for op in delta:
        factor = 2 * (ranks - 1) / ranks if op.endswith("allreduce") or op.endswith("Allreduce") else 1.0
        total += factor * delta[op].bytes_recv
    return total


def time_steps(topo: Topology, alg, params: np.ndarray, grad: np.ndarray, steps: int) -> tuple:
    """(slowest rank's seconds per step, wire bytes received per step by this rank)."""
    received = []

    def block() -> None:
        before = topo.ledger.snapshot()
        for _ in range(steps):
            alg.step(params, grad)
        received.append(wire_bytes(topo.ledger.since(before), topo.size) / steps)

    return slowest_seconds(topo, block) / steps, received[0]  # block() runs ``steps`` steps


def run(args: argparse.Namespace) -> int:
    """Run the benchmark (a collective call); rank 0 prints the table."""
    abort_on_exception()
    topo = Topology()
    rank, size = topo.rank, topo.size
    grad = np.random.default_rng(rank).standard_normal(args.d).astype(np.float32)
    table = modes(args.densities)
    algorithms = {}
    for name, (algorithm, hyper) in table.items():
        params = np.zeros(args.d, np.float32)
        alg = create(algorithm, topo, lr=1e-3, **hyper)
        alg.setup(params)
        alg.step(params, grad)  # warm-up: first-touch allocations, connections
        algorithms[name] = (alg, params)
    times: Dict[str, List[float]] = {name: [] for name in table}
    ratios: Dict[str, List[float]] = {name: [] for name in table}
    received: Dict[str, float] = {}
    names = list(table)
    for rep in range(args.reps):
        this_rep = {}
        for name in rotated(names, rep):
            alg, params = algorithms[name]
            this_rep[name], received[name] = time_steps(topo, alg, params, grad, args.steps)
        for name in names:
            times[name].append(this_rep[name])
            ratios[name].append(this_rep["allreduce"] / this_rep[name])
        if rank == 0:
            print(f"repetition {rep + 1}/{args.reps} done", flush=True)
    if rank == 0:
        link = host()
        print(f"\n{size} ranks, d = {args.d}, {args.steps} steps x {args.reps} repetitions, host {link}")
        auto = algorithms["vote/auto"][0]
        print(f"algorithm modes: auto chose {auto.mode!r} in {auto.chunks} pipeline chunks\n")
        base_bytes = received["allreduce"]
        rows = []
        for name in names:
            limit = base_bytes / received[name] if received[name] else float("inf")
            rows.append([name, f"{median(times[name]):.4f}", f"{median(ratios[name]):.1f} x", f"{received[name]:.0f}", f"{limit:.1f} x"])
        header = ["mode", "s/step (median)", "speed-up vs allreduce (median)", "wire bytes received/step/rank", "wire limit"]
        print(markdown_table(header, rows))
    topo.Free()
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    return module_main("compressed", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
