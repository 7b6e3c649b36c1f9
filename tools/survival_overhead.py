"""What surviving a lost rank costs while none is lost: steps under ``on_failure="shrink"`` against ``"abort"``.

    MPIOPT_MPI=openmpi source tools/setup.sh
    mpiexec --with-ft ulfm --mca btl tcp,self -n 4 python tools/survival_overhead.py [--d 1M] [--algorithms sgd,diloco]

Both topologies live in one job under the same launch (the ULFM transport), so the ratio is mpiopt's own price:
each step's snapshot of the parameters and state and the survivors' agreement at its end (docs/failures.md,
"What happens").  Rounds alternate the two; each time is the slowest rank's mean step over ``--steps`` steps, and
the table gives medians over rounds and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import mpiopt  # noqa: E402
from mpiopt.bench._common import count  # noqa: E402


def mean_step(alg, params, grads, steps, topology) -> float:
    """The slowest rank's mean step time over ``steps`` steps (seconds)."""
    topology.world.Barrier()
    started = time.perf_counter()
    for t in range(steps):
        alg.step(params, grads[t % len(grads)], loss=1.0)
    elapsed = np.array([time.perf_counter() - started])
    topology.world.Allreduce(elapsed, op=mpiopt.comm.MAX)
    return float(elapsed[0]) / steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d", type=count, default=1_000_000, help="float32 parameters (suffixes k, M; default 1M)")
    parser.add_argument("--steps", type=int, default=40, help="timed steps per round and variant (default 40)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds; medians are reported (default 5)")
    parser.add_argument("--algorithms", default="sgd,diloco,topk", help="comma-separated (default sgd,diloco,topk)")
    args = parser.parse_args()
    topologies = {mode: mpiopt.Topology(on_failure=mode) for mode in ("abort", "shrink")}
    world = topologies["abort"].world
    rng = np.random.default_rng(world.rank)
    grads = [rng.standard_normal(args.d).astype(np.float32) for _ in range(4)]
    rows = []
    for name in args.algorithms.split(","):
        runs = {}
        for mode, topology in topologies.items():
            params = np.zeros(args.d, dtype=np.float32)
            alg = mpiopt.create(name, topology, lr=1e-3)
            alg.setup(params)
            mean_step(alg, params, grads, 3, topology)  # warm up: buffers, first exchange
            runs[mode] = (alg, params)
        times = {mode: [] for mode in topologies}
        for _ in range(args.rounds):
            for mode, (alg, params) in runs.items():
                times[mode].append(mean_step(alg, params, grads, args.steps, topologies[mode]))
        abort, shrink = (statistics.median(times[m]) for m in ("abort", "shrink"))
        rows.append(f"| `{name}` | {1e3 * abort:.2f} ms | {1e3 * shrink:.2f} ms | {shrink / abort:.3f} |")
    if world.rank == 0:
        print(f"{world.size} ranks, d = {args.d:,}, medians of {args.rounds} rounds of {args.steps} steps\n")
        print("| algorithm | abort | shrink | ratio |\n|---|---:|---:|---:|")
        print("\n".join(rows), flush=True)
    for topology in topologies.values():
        topology.Free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
