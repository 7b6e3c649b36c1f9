"""``mpiopt info``: what this job looks like to mpiopt.

Prints the launcher's count of processes beside MPI's world, the topology (groups, leaders, hosts, each rank's wait policy),
whether the MPI library is GPU-aware and why we think so, and the bytes each
wrapped collective puts on the wire for a buffer of the given size (from the
ledger, summed over ranks).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

from ..comm import Topology
from ..comm.launcher import SIZE_VARIABLES, launcher_view
from ..comm.waiting import WAIT_POLICIES, WAIT_POLICY_ENV


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--group-size", type=int, default=None, help="ranks per emulated node (default: real nodes, or $MPIOPT_GROUP_SIZE)")
    parser.add_argument("--elements", type=int, default=1 << 18, help="float32 elements per buffer in the collective table (default 262144 = 1 MiB)")


def exercise(topo: Topology, n: int) -> None:
    """Run each wrapped collective once on ``n`` float32 values."""
    world = topo.world
    P = world.size
    x = np.ones(n, dtype=np.float32)
    out = np.empty_like(x)
    world.Allreduce(x, out=out)
    world.Iallreduce(x, out=out).Wait()
    world.Bcast(out, root=0)
    block = n // P
    world.Allgather(x[:block], np.empty(block * P, dtype=np.float32))
    world.Alltoall(x[: block * P], out[: block * P])
    world.Reduce_scatter(x[: block * P], np.empty(block, dtype=np.float32))
    counts = [block] * P
    world.Allgatherv(x[:block], np.empty(block * P, dtype=np.float32), counts)
    world.elect_min(float(world.rank))


def describe_launcher() -> str:
    """The launcher's view of the job in words (the Topology has already refused one that disagrees with MPI)."""
    view = launcher_view()
    if view is None:
        return f"none seen (no {', '.join(v for v, _ in SIZE_VARIABLES)}: a plain python run, or a launcher mpiopt does not read)"
    return f"{view.size} process(es), from {view.launcher} ({view.variable}={view.size})"


def run(args: argparse.Namespace) -> int:
    topo = Topology(group_size=args.group_size)
    world = topo.world
    places = world.allgather_obj(topo.describe())
    if args.elements < world.size:
        raise ValueError(f"--elements must be at least the number of ranks ({world.size}), got {args.elements}")
    topo.ledger.reset()
    started = time.perf_counter()
    exercise(topo, args.elements)
    elapsed = time.perf_counter() - started
    totals = world.ledger_totals()
    if world.rank == 0:
        print(f"mpiopt info: {world.size} rank(s), MPI: {MPI.Get_library_version().splitlines()[0].strip()}")
        print(f"launcher: {describe_launcher()}")
        print(f"GPU-aware MPI: {'yes' if topo.gpu_aware else 'no'} ({world.gpu_aware_reason})")
        print(f"groups: {topo.num_groups}" + (f" of at most {topo.group_size_setting} ranks (emulated)" if topo.group_size_setting else " (one per node)"))
        print()
        print("| rank | host | group | rank in group | leader | wait policy |")
        print("|---:|---|---:|---:|---|---|")
        for p in places:
            print(
                f"| {p['world_rank']} | {p['host']} | {p['group_index']} | {p['group_rank']}/{p['group_size']} "
                f"| {'yes' if p['is_leader'] else ''} | {p['wait_policy']} |"
            )
        print(f"(wait policy: how a rank waits for a nonblocking operation; {WAIT_POLICY_ENV}={'|'.join(WAIT_POLICIES)}, see mpiopt.comm.waiting)")
        print()
        print(totals.table(f"bytes on the wire per collective, summed over ranks ({args.elements} float32 values = {4 * args.elements} bytes; {elapsed:.3f} s)"))
    topo.Free()
    return 0
