"""Benchmark: each synchronous algorithm's bytes per parameter and the split of its step time.

``mpiopt bench algorithms [--d 1M] [--steps 16] [--compute-ms 0] [--algorithms sgd,signum] [--islands] [--json FILE]``
(under ``mpiexec -n P``; ``--group-size K`` emulates nodes of K ranks; ``--islands``: each one worker, the bytes
between islands and within them apart).

Random gradients, ``mpiopt train``'s hyperparameters, a busy wait of ``--compute-ms`` as the compute phase.
Measured ledger bytes per parameter per step beside the plan's closed form, and the step's time split.
``--steps`` should be a multiple of every period.  Method: docs/internals-bench.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence

import numpy as np

from ..algorithms import SYNCHRONOUS, algorithm_class, available, create
from ..comm import Topology
from ..comm.islands import ISLAND
from ..comm.ledger import plan_bytes
from ..training.config import TrainConfig, UsageError
from ._common import check_choices, comma_list, count, environment, link_rate, markdown_table, module_main, positive_int, say, write_json

__all__ = ["synchronous", "expected_bytes", "add_arguments", "run", "main"]


def synchronous() -> List[str]:
    """The algorithms driven by ``step`` (the asynchronous ones run ``alg.run`` instead), the baseline first."""
    return available(SYNCHRONOUS)


def expected_bytes(
    name: str,
    d: int,
    ranks: int,
    hyper: Optional[Mapping[str, Any]] = None,
    *,
    groups: Optional[Sequence[int]] = None,
    steps: int = 1,
    start: int = 1,
    itemsize: int = 4,
    ranks_per_island: int = 1,
    level: Optional[str] = None,
) -> Dict[str, float]:
    """``{"sent", "recv"}``: bytes the mean rank moves per step over steps ``start .. start + steps - 1``, from the plan.

    ``groups``: the topology's group sizes (``lsgd``, ``signum``'s ``prevote``); ``ranks_per_island``: an island
    run's; ``level``: ``"link"`` (between workers) or ``"node"`` (within islands) only.  ``ValueError`` for an
    asynchronous or unknown algorithm, or groups that do not add up to ``ranks``.
    """
    cls = algorithm_class(name)
    if cls.protocol != SYNCHRONOUS:
        raise ValueError(f"expected_bytes covers the synchronous algorithms {', '.join(synchronous())}; got {name!r}")
    calls = cls.communication(d, ranks, hyper, groups=groups, steps=range(start, start + steps), itemsize=itemsize,
                              ranks_per_island=ranks_per_island)
    return plan_bytes(calls, ranks, steps, level)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--algorithms", type=comma_list(str), default=None, metavar="A,B,...", help="synchronous algorithms to run (default: all)")
    parser.add_argument("--d", type=count, default=1_000_000, help="parameters (suffixes k, M, G)")
    parser.add_argument("--steps", type=positive_int, default=16, help="measured steps per algorithm (after as many warm-up steps)")
    parser.add_argument("--compute-ms", type=float, default=0.0, help="synthetic compute phase per step, milliseconds (a busy wait)")
    parser.add_argument("--group-size", type=positive_int, default=None, help="ranks per emulated node (default: real nodes, or $MPIOPT_GROUP_SIZE)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random gradients")
    parser.add_argument("--islands", action="store_true",
                        help="each group one worker (the algorithms that take islands): bytes between and within islands apart")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the results to FILE")


def _busy(seconds: float) -> None:
    """A compute phase that holds the core (as a backward pass does), not a sleep."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _check(args: argparse.Namespace) -> None:
    takes = [name for name in synchronous() if algorithm_class(name).islands_refusal is None] if args.islands else synchronous()
    args.algorithms = args.algorithms or takes
    check_choices("--algorithms" + (" with --islands" if args.islands else ""), args.algorithms, takes)
    if args.compute_ms < 0:
        raise UsageError(f"--compute-ms must be >= 0, got {args.compute_ms}")


def measure(topology: Topology, name: str, d: int, steps: int, compute_seconds: float, seed: int,
            islands: bool = False) -> Dict[str, Any]:
    """Run ``name`` for ``2 steps`` steps; bytes and time of the last ``steps``, and the expected bytes.

    Bytes between workers (and with ``islands``, within the islands apart), each beside its plan's."""
    hyper = TrainConfig().algorithm_hyperparameters(name)
    alg = create(name, topology, islands=islands, **hyper)
    params = np.zeros(d, np.float32)
    alg.setup(params)
    rng = np.random.default_rng([seed, topology.rank])
    grads = [rng.standard_normal(d).astype(np.float32) for _ in range(4)]
    losses = rng.random(steps * 2) + 1.0
    phases = np.zeros(4)  # compute, algorithm, communication, waiting: this rank's sums over the measured steps
    before = None
    for step in range(2 * steps):
        if step == steps:
            topology.world.Barrier()
            before = topology.ledger.snapshot()
        started = time.perf_counter()
        _busy(compute_seconds)
        computed = time.perf_counter() - started
        record = alg.step(params, grads[step % len(grads)], loss=float(losses[step]))
        if step >= steps:
            phases += (computed, record.algo_seconds, record.comm_seconds, record.wait_seconds)
    # Before finish: an island reassembles what its rails exchanged at the Wait, so the window holds as many of those
    # (of exchanges started from step `steps` on) as it holds starts, the plan's count over whole periods.
    delta = topology.ledger.since(before)
    alg.finish(params)
    within = delta.total(ISLAND)
    moved = [delta.bytes_sent - within.bytes_sent, delta.bytes_recv - within.bytes_recv, within.bytes_sent, within.bytes_recv]
    sums = topology.world.allreduce_obj(np.array([*moved, *phases], dtype=np.float64))
    P = topology.size
    groups = [size for index, size in sorted(set(topology.world.allgather_obj((topology.group_index, topology.group.size))))]
    settings = {**alg.hyperparameters(), **alg.execution()}  # a knob such as pipeline_chunks can shape the messages
    G = alg.worker_layout()["ranks_per_worker"]
    expected = {level: expected_bytes(name, d, P, settings, groups=groups, steps=steps, start=steps + 1, ranks_per_island=G,
                                      level=level) for level in ("link", "node")}
    return {
        "algorithm": name,
        "hyperparameters": alg.hyperparameters(),
        "mode": getattr(alg, "mode", None),
        "groups": groups,
        "ranks_per_island": G,
        "bytes_sent_per_rank_step": float(sums[0]) / P / steps,
        "bytes_recv_per_rank_step": float(sums[1]) / P / steps,
        "expected_sent_per_rank_step": expected["link"]["sent"],
        "expected_recv_per_rank_step": expected["link"]["recv"],
        "island_sent_per_rank_step": float(sums[2]) / P / steps,
        "expected_island_sent_per_rank_step": expected["node"]["sent"],
        "formula": algorithm_class(name).wire_summary,
        "seconds_per_step": dict(zip(("compute", "algorithm", "communication", "waiting"), (float(s) / P / steps for s in sums[4:]))),
    }


def table(results: Sequence[Dict[str, Any]], d: int) -> str:
    """The terminal table of :func:`measure`'s results (with islands: the bytes within them too)."""
    islands = any(r.get("ranks_per_island", 1) > 1 for r in results)
    rows = []
    for r in results:
        t = r["seconds_per_step"]
        total = sum(t.values())
        name = r["algorithm"] + (f" ({r['mode']})" if r["mode"] else "")
        within = [f"{r['island_sent_per_rank_step'] / d:.4g}", f"{r['expected_island_sent_per_rank_step'] / d:.4g}"] if islands else []
        rows.append([
            name, f"{r['bytes_sent_per_rank_step'] / d:.4g}", f"{r['expected_sent_per_rank_step'] / d:.4g}",
            f"{r['bytes_recv_per_rank_step'] / d:.4g}", f"{r['expected_recv_per_rank_step'] / d:.4g}", *within, r["formula"],
            f"{1e3 * total:.2f}", *(f"{1e3 * t[k]:.2f} ({t[k] / total:.0%})" if total else "0" for k in t),
        ])
    between = " between islands" if islands else ""
    header = ["algorithm", f"sent B/param{between}", "formula", f"recv B/param{between}", "formula",
              *(["sent B/param within", "formula"] if islands else []), "README", "ms/step", "compute", "algorithm", "comm", "wait"]
    return markdown_table(header, rows, align="lrrrr" + "rr" * islands + "lrrrrr")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark (a collective call); rank 0 prints the table and writes the JSON."""
    _check(args)
    link = link_rate(getattr(args, "link", None))
    topology = Topology(group_size=args.group_size)
    out = say(topology.rank)
    if topology.size < 2:
        out("warning: one rank: nothing crosses a link; run under mpiexec -n P", file=sys.stderr)
    results = []
    for name in args.algorithms:
        results.append(measure(topology, name, args.d, args.steps, args.compute_ms / 1e3, args.seed, args.islands))
        out(f"{name} done", file=sys.stderr)
    out(f"\n## algorithms: {topology.size} ranks in groups of {results[0]['groups']}, d = {args.d:,}, link {link or 'not given'}, "
        f"{args.steps} measured steps, compute phase {args.compute_ms:g} ms; bytes per parameter per step (mean rank), "
        "ms per step (mean rank)\n")
    out(table(results, args.d))
    if args.json and topology.rank == 0:
        write_json(args.json, {"benchmark": "algorithms", **environment(topology, link), "d": args.d, "steps": args.steps,
                               "compute_ms": args.compute_ms, "ranks_per_island": results[0]["ranks_per_island"], "results": results})
        out(f"\nwrote {args.json}")
    topology.Free()
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    return module_main("algorithms", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
