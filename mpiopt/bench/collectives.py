"""Benchmark: the collectives mpiopt's algorithms use, over a range of sizes.

``mpiopt bench collectives [--sizes 1k,16k,256k,4M] [--repeats 20] [--json FILE]``
(under ``mpiexec -n P``; inside the emulated link with ``mpiopt bench --link 1gbit --ranks P collectives``).

Operations: allreduce, allgather-bits, vote-twophase, allgatherv-sparse, bcast, iallreduce, each moving what
an algorithm moves for ``d`` float32 parameters, and allreduce-gloo (not by default): torch.distributed's
Allreduce on gloo, DDP's exchange, whose bytes bypass mpiopt's ledger.  Medians of the slowest rank's time, ledger bytes, and the
rates against the link; ``--json`` feeds ``mpiopt bench model calibrate``.  ``--within-groups`` times them inside every
group (node) at once, as an island run's mean gradient meets them; ``--after-work SECONDS`` times each call after a
stretch of work with no barrier, as a step's exchange follows its backward pass.  Method: docs/internals-bench.md.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

from ..comm import Topology
from ..kernels import chunk_bounds, packed_nbytes
from ..training.config import UsageError
from ._common import check_choices, comma_list, count, environment, link_rate, markdown_table, median, module_main, parse_rate, positive_int, rotated, say
from ._common import slowest_seconds, write_json

__all__ = ["OPERATIONS", "GLOO_ALLREDUCE", "GLOO_OPERATIONS", "add_arguments", "run", "main"]

OPERATIONS = ("allreduce", "allgather-bits", "vote-twophase", "allgatherv-sparse", "bcast", "iallreduce")
#: torch.distributed's Allreduce on gloo: DDP's exchange.
GLOO_ALLREDUCE = "allreduce-gloo"
#: Operations timed only when asked for: they need torch.
GLOO_OPERATIONS = (GLOO_ALLREDUCE,)
SIZES = (1_000, 16_000, 256_000, 4_000_000)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", type=comma_list(count), default=list(SIZES), metavar="D,D,...", help="parameter counts d (suffixes k, M, G)")
    parser.add_argument("--ops", type=comma_list(str), default=list(OPERATIONS), metavar="OP,OP,...", help=f"operations, among {','.join(OPERATIONS + GLOO_OPERATIONS)}")
    parser.add_argument("--repeats", type=positive_int, default=20, help="timed repetitions per operation and size (median reported)")
    parser.add_argument("--density", type=float, default=0.01, help="fraction of d sent as (index, value) pairs by allgatherv-sparse")
    parser.add_argument("--within-groups", action="store_true",
                        help="time each operation inside every group (a node, or --group-size K ranks) at once, as an island run's "
                        "mean gradient and reassembly or lsgd's local pulls meet them; the JSON's world_size is then the group's")
    parser.add_argument("--after-work", type=float, default=0.0, metavar="SECONDS",
                        help="before each timed call, about SECONDS of memory-bound work on every rank and no barrier, as a "
                        "training step's backward pass comes before its exchange: the call then meets cold caches and waits "
                        "for its slowest rank as a run's does, and the time is the ranks' mean (default 0: a barrier, then "
                        "the slowest rank's time)")
    parser.add_argument("--group-size", type=positive_int, default=None, help="ranks per emulated node (default: real nodes, or $MPIOPT_GROUP_SIZE)")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write every measurement to FILE")


class _Operation:
    """One operation at one size: preallocated buffers and a call."""

    def __init__(self, name: str, topology: Topology, d: int, density: float, within_groups: bool = False) -> None:
        world = topology.group if within_groups else topology.world
        P = world.size
        self.call: Callable[[], None]
        self.ledgered = name not in GLOO_OPERATIONS
        if name == GLOO_ALLREDUCE:
            import torch
            import torch.distributed as dist

            from ..training.ddp import init_gloo  # torch: imported only when this operation is asked for

            if not dist.is_initialized():
                init_gloo(topology)
            tensor = torch.ones(d)
            self.call = lambda: dist.all_reduce(tensor)
        elif name in ("allreduce", "iallreduce", "bcast"):
            send, out = np.ones(d, np.float32), np.empty(d, np.float32)
            if name == "allreduce":
                self.call = lambda: world.Allreduce(send, out=out)
            elif name == "iallreduce":
                self.call = lambda: world.Iallreduce(send, out=out).Wait()
            else:
                self.call = lambda: world.Bcast(out, root=0)
        elif name == "allgather-bits":
            packed = np.zeros(packed_nbytes(d), np.uint8)
            stack = np.empty((P, packed.size), np.uint8)
            self.call = lambda: world.Allgather(packed, stack)
        elif name == "vote-twophase":
            # signum's buffers: a (P, width) block of chunks out, one back, a voted chunk gathered.
            bounds = chunk_bounds(packed_nbytes(d), P)
            width = int((bounds[:, 1] - bounds[:, 0]).max())
            send, chunks = np.zeros((P, width), np.uint8), np.empty((P, width), np.uint8)
            voted, gathered = np.zeros(width, np.uint8), np.empty((P, width), np.uint8)

            def twophase() -> None:
                world.Alltoall(send, chunks)
                world.Allgather(voted, gathered)

            self.call = twophase
        elif name == "allgatherv-sparse":
            pair_bytes = 8 * max(1, round(density * d))
            mine, everyone = np.zeros(pair_bytes, np.uint8), np.empty(P * pair_bytes, np.uint8)
            self.call = lambda: world.Allgatherv(mine, everyone, [pair_bytes] * P)
        else:
            raise ValueError(f"unknown operation {name!r}; choose from {', '.join(OPERATIONS)}")


def _check(args: argparse.Namespace) -> None:
    check_choices("--ops", args.ops, OPERATIONS + GLOO_OPERATIONS)
    if args.within_groups and GLOO_ALLREDUCE in args.ops:
        raise UsageError(f"--within-groups times mpiopt's collectives on each group; {GLOO_ALLREDUCE} runs on the world's gloo group")
    if not 0 < args.density <= 1:
        raise UsageError(f"--density must be in (0, 1], got {args.density}")
    if not 0 <= args.after_work <= 10:
        raise UsageError(f"--after-work must be from 0 to 10 seconds, got {args.after_work}")


#: The work of ``--after-work``: passes over this many float32 (16 MB, past the caches, as a backward pass's activations).
WORK_FLOATS = 1 << 22


def fixed_work(topology: Topology, seconds: float) -> Callable[[], None]:
    """The same number of passes over :data:`WORK_FLOATS` on every rank, about ``seconds`` on rank 0 (collective): a
    fixed amount of work, so that ranks sharing cores end it at different times, as a run's ranks end a step's
    computation."""
    buffer = np.ones(WORK_FLOATS, np.float32)
    started = time.perf_counter()
    np.multiply(buffer, 1.0, out=buffer)
    passes = topology.world.bcast_obj(max(1, round(seconds / max(time.perf_counter() - started, 1e-6))))

    def work() -> None:
        for _ in range(passes):
            np.multiply(buffer, 1.0, out=buffer)

    return work


def mean_seconds_after(topology: Topology, work: Callable[[], None], fn: Callable[[], object]) -> float:
    """The ranks' mean seconds of one call of ``fn`` that follows ``work`` with no barrier between (neither timed)."""
    from ..comm import SUM

    work()
    started = time.perf_counter()
    fn()
    elapsed = np.array([time.perf_counter() - started])
    topology.world.Allreduce(elapsed, op=SUM)
    return float(elapsed[0]) / topology.size


def measure(topology: Topology, ops: Sequence[str], sizes: Sequence[int], repeats: int, density: float,
            within_groups: bool = False, after_work: float = 0.0) -> List[Dict[str, Any]]:
    """Time every operation at every size (``within_groups``: in every group at once, the slowest group's time;
    ``after_work``: each call after that many seconds of :func:`fixed_work`, the ranks' mean time); one record per
    (operation, size) with seconds and ledger bytes per rank."""
    world, P = topology.world, topology.size
    cases = [(op, d) for d in sizes for op in ops]
    operations = {case: _Operation(case[0], topology, case[1], density, within_groups) for case in cases}
    calls = {case: operation.call for case, operation in operations.items()}
    bytes_per_call: Dict[tuple, tuple] = {}
    for case in cases:  # warm-up, and one call's bytes from the ledger (None for gloo's, which bypass it)
        before = topology.ledger.snapshot()
        calls[case]()
        delta = topology.ledger.since(before)
        sums = world.allreduce_obj(np.array([delta.bytes_sent, delta.bytes_recv], dtype=np.float64))
        bytes_per_call[case] = (float(sums[0]) / P, float(sums[1]) / P) if operations[case].ledgered else (None, None)
    seconds: Dict[tuple, List[float]] = {case: [] for case in cases}
    work = fixed_work(topology, after_work) if after_work > 0 else None
    for rep in range(repeats):
        for case in rotated(cases, rep):
            seconds[case].append(slowest_seconds(topology, calls[case]) if work is None
                                 else mean_seconds_after(topology, work, calls[case]))
    records = []
    for case in cases:
        op, d = case
        sent, recv = bytes_per_call[case]
        records.append({
            "op": op, "d": d, "bytes_sent_per_rank": sent, "bytes_recv_per_rank": recv,
            "median_seconds": median(seconds[case]), "min_seconds": min(seconds[case]), "seconds": seconds[case],
        })
    return records


def _rate(value: float) -> str:
    return f"{value / 1e6:.1f} MB/s" if value >= 1e5 else f"{value / 1e3:.1f} kB/s"


def table(records: Sequence[Dict[str, Any]], ranks: int, link_bytes_per_second: Optional[float]) -> str:
    """The terminal table of :func:`measure`'s records."""
    header = ["op", "d", "sent/rank", "recv/rank", "median", "min", "recv B/s per rank", "all ranks B/s"]
    if link_bytes_per_second:
        header.append("% of link")
    rows = []
    for r in records:
        if r["bytes_recv_per_rank"] is None:  # gloo's: not in the ledger
            rates = ["—"] * (5 if link_bytes_per_second else 4)
        else:
            per_rank = r["bytes_recv_per_rank"] / r["median_seconds"] if r["median_seconds"] > 0 else math.nan
            rates = [f"{r['bytes_sent_per_rank']:,.0f} B", f"{r['bytes_recv_per_rank']:,.0f} B", _rate(per_rank), _rate(per_rank * ranks)]
            if link_bytes_per_second:
                rates.append(f"{100 * per_rank * ranks / link_bytes_per_second:.0f} %")
        row = [r["op"], f"{r['d']:,}", *rates[:2], f"{1e3 * r['median_seconds']:.3f} ms", f"{1e3 * r['min_seconds']:.3f} ms", *rates[2:]]
        rows.append(row)
    return markdown_table(header, rows)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark (a collective call); rank 0 prints the table and writes the JSON."""
    _check(args)
    link = link_rate(getattr(args, "link", None))
    topology = Topology(group_size=args.group_size)
    out = say(topology.rank)
    if topology.size < 2:
        out("warning: one rank: nothing crosses a link (every collective moves 0 bytes); run under mpiexec -n P", file=sys.stderr)
    if args.within_groups and len(set(topology.group_sizes)) > 1:
        raise UsageError(f"--within-groups needs groups of one size, got {topology.group_sizes}")
    records = measure(topology, args.ops, args.sizes, args.repeats, args.density, args.within_groups, args.after_work)
    link_bytes = parse_rate(link) / 8 if link else None
    ranks = topology.group.size if args.within_groups else topology.size
    where = f" in each of {topology.num_groups} groups at once" if args.within_groups else ""
    after = f", each after {args.after_work:g} s of work" if args.after_work else ""
    out(f"## collectives: {ranks} ranks{where}, link {link or 'not given'}, median of {args.repeats} repetitions{after}\n")
    out(table(records, ranks, link_bytes))
    if args.json and topology.rank == 0:
        # world_size: the ranks of one collective, as the calibration reads it; groups: how many ran side by side.
        inside = {"world_size": ranks, "groups": topology.num_groups, "within_groups": True} if args.within_groups else {}
        write_json(args.json, {"benchmark": "collectives", **environment(topology, link), **inside, "repeats": args.repeats,
                               "density": args.density, "after_work_seconds": args.after_work, "results": records})
        out(f"\nwrote {args.json}")
    topology.Free()
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    return module_main("collectives", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
