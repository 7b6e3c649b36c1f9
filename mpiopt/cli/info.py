"""``mpiopt info``: what this job looks like to mpiopt.

Prints the launcher's count of processes beside MPI's world, the topology (groups, leaders, hosts, each rank's wait policy),
whether the MPI library is GPU-aware and why we think so (GPU buffers then go to MPI directly, else through
host memory), the GPU each rank would train on (``--device auto``; docs/gpu.md), and the bytes each
wrapped collective puts on the wire for a buffer of the given size (from the
ledger, summed over ranks).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from ..comm import Topology
from ..comm.launcher import SIZE_VARIABLES, launcher_view
from ..comm.process import library_version
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


def describe_gpu(node_rank: int, node_size: int) -> str:
    """The GPU this rank would train on with ``--device auto`` (index, name, memory), or why none."""
    try:
        import torch

        from ..training.device import cuda_view, local_rank, resolve_device
    except ImportError:
        return "none: torch is not installed"
    view = cuda_view()
    if view.count == 0:
        return f"none visible ({view.described()})"
    given = local_rank()
    try:
        device = torch.device(resolve_device("auto", "fp32", view, node_rank if given is None else given, node_size))
    except ValueError as err:
        return f"none: {err}"
    if device.type == "cpu":
        return f"none: {node_size} ranks on this node, {view.count} GPU(s) visible to each (--device cuda --share-gpus shares them)"
    props = torch.cuda.get_device_properties(device)
    return f"{device} of {view.count}: {props.name}, {props.total_memory / 2**30:.1f} GiB"


def describe_staging(aware: bool, reason: str) -> str:
    """Where GPU buffers go for MPI, and why mpiopt thinks so (:func:`mpiopt.comm.buffers.gpu_aware_mpi`'s answer)."""
    if aware:
        return f"handed to MPI directly (CUDA-aware, from {reason})"
    return f"staged through pinned host memory (MPI not CUDA-aware: {reason}; MPIOPT_GPU_AWARE=1 overrides)"


def run(args: argparse.Namespace) -> int:
    topo = Topology(group_size=args.group_size)
    world = topo.world
    node = world.Split_shared("node")
    gpus = world.allgather_obj(describe_gpu(node.rank, node.size))
    node.Free()
    places = world.allgather_obj(topo.describe())
    if args.elements < world.size:
        raise ValueError(f"--elements must be at least the number of ranks ({world.size}), got {args.elements}")
    topo.ledger.reset()
    started = time.perf_counter()
    exercise(topo, args.elements)
    elapsed = time.perf_counter() - started
    totals = world.ledger_totals()
    if world.rank == 0:
        print(f"mpiopt info: {world.size} rank(s), MPI: {library_version()}")
        print(f"launcher: {describe_launcher()}")
        print(f"GPU-aware MPI: {'yes' if topo.gpu_aware else 'no'} ({world.gpu_aware_reason})")
        print(f"GPU buffers: {describe_staging(topo.gpu_aware, world.gpu_aware_reason)}")
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
        print("| rank | GPU (--device auto) |")
        print("|---:|---|")
        for rank, gpu in enumerate(gpus):
            print(f"| {rank} | {gpu} |")
        print()
        print(totals.table(f"bytes on the wire per collective, summed over ranks ({args.elements} float32 values = {4 * args.elements} bytes; {elapsed:.3f} s)"))
    topo.Free()
    return 0
