"""Benchmark: a staged Allreduce of GPU memory against MPI's Allreduce of the same host buffer (MPI not CUDA-aware).

``mpiopt bench staging [--size 400M] [--chunk 8M] [--repeats 5] [--device auto|cuda|cpu] [--backend torch|cupy] [--json FILE]``
(under ``mpiexec -n 2``; the ranks may share one GPU).

Times, on the slowest rank, the pipelined staged Allreduce of a ``--size``-byte float32 buffer, the same staged
in one piece (``--chunk`` = the whole buffer), one device-to-host and one host-to-device copy of the whole buffer
through pinned memory, and MPI's Allreduce of the host buffer alone.  Ratio: the pipelined staged Allreduce's time
over MPI's Allreduce of the host buffer (goal, issue 39: <= 1.2, what staging adds to the transfer it cannot avoid);
the copies' time over the staged call's is printed beside it.  Without a GPU (or ``--device cpu``) it runs the same pipeline on host
arrays as a dry run (copies are host memory copies) and says so.  Settings: docs/internals-comm.md.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

from ..comm import Comm, Topology
from ..comm.buffers import HostStaging, copy_bytes
from ..comm.staging import staging_chunk_bytes
from ..training.config import UsageError
from ._common import count, environment, markdown_table, median, module_main, positive_int, rotated, say, slowest_seconds, write_json

__all__ = ["GOAL", "add_arguments", "measure", "run", "main"]

#: The pipelined staged Allreduce's time in units of MPI's Allreduce of the same host buffer (issue 39).
GOAL = 1.2
CASES = ("pinned copies", "staged allreduce", "staged in one piece", "host allreduce")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", type=count, default=400_000_000, help="bytes of the float32 buffer (suffixes k, M, G: powers of 10)")
    parser.add_argument("--chunk", default=None, help="staging chunk in bytes (8M = 8 MiB; default: MPIOPT_STAGING_CHUNK, else 8 MiB)")
    parser.add_argument("--repeats", type=positive_int, default=5, help="interleaved timed rounds (medians reported)")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto", help="auto: cuda where a GPU is visible, else the host dry run")
    parser.add_argument("--backend", choices=("torch", "cupy"), default="torch", help="GPU array library")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the results to FILE")


def _gpu_visible(backend: str) -> bool:
    try:
        if backend == "torch":
            import torch

            return torch.cuda.is_available()
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - no library, or no driver
        return False


def _device_zeros(backend: str, nbytes: int, device: str) -> tuple:
    """A float32 buffer of zeros (sums stay finite) on ``device``, and a function that waits for its GPU's work."""
    n = nbytes // 4
    if device == "cpu":
        return np.zeros(n, np.float32), lambda: None
    if backend == "torch":
        import torch

        return torch.zeros(n, dtype=torch.float32, device="cuda"), torch.cuda.synchronize
    import cupy

    return cupy.zeros(n, dtype=cupy.float32), cupy.cuda.runtime.deviceSynchronize


def measure(topology: Topology, nbytes: int, chunk: int, repeats: int, device: str, backend: str) -> Dict[str, List[float]]:
    """Seconds of the slowest rank per round for each of :data:`CASES` (a collective call)."""
    host_only = device == "cpu"
    pipelined = Comm(name="world", gpu_aware=False, staging_chunk=chunk, stage_host=host_only)
    whole = Comm(name="world", gpu_aware=False, staging_chunk=nbytes, stage_host=host_only)
    buf, synchronize = _device_zeros(backend, nbytes, device)
    host = HostStaging().get("copies", buf.nbytes).view(np.float32)  # pinned as the staging buffers are
    host[:] = 0

    def copies() -> None:
        copy_bytes(host, buf)
        copy_bytes(buf, host)
        synchronize()

    calls: Dict[str, Callable[[], Any]] = {
        "pinned copies": copies,
        "staged allreduce": lambda: pipelined.Allreduce(buf),
        "staged in one piece": lambda: whole.Allreduce(buf),
        "host allreduce": lambda: topology.world.Allreduce(host),
    }
    for call in calls.values():  # warm-up: the pinned buffers are allocated here
        call()
    seconds: Dict[str, List[float]] = {case: [] for case in CASES}
    for round_ in range(repeats):
        for case in rotated(CASES, round_):
            seconds[case].append(slowest_seconds(topology, calls[case]))
    pipelined.Free()
    whole.Free()
    return seconds


def table(seconds: Dict[str, List[float]], nbytes: int) -> str:
    """One row per case: median and best seconds, and bytes per second counting each byte once."""
    rows = []
    for case in CASES:
        mid = median(seconds[case])
        rows.append([case, f"{1e3 * mid:.1f} ms", f"{1e3 * min(seconds[case]):.1f} ms", f"{nbytes / mid / 1e9:.2f} GB/s"])
    return markdown_table(["case", "median", "best", "buffer / median"], rows)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark (a collective call); rank 0 prints the table and the ratio.  Returns 0 (a missed goal is reported)."""
    try:
        chunk, chunk_source = staging_chunk_bytes(args.chunk)
    except ValueError as err:
        raise UsageError(f"--chunk: {err}") from None
    if args.size < 4:
        raise UsageError(f"--size must be at least 4 bytes (one float32), got {args.size}")
    visible = _gpu_visible(args.backend)
    if args.device == "cuda" and not visible:
        raise UsageError(f"--device cuda: no CUDA GPU visible to {args.backend}")
    device = "cuda" if args.device == "cuda" or (args.device == "auto" and visible) else "cpu"
    topology = Topology()
    out = say(topology.rank)
    if device == "cpu":
        out("no CUDA GPU here (or --device cpu): a dry run of the staged pipeline on host arrays; its ratio is no GPU figure", file=sys.stderr)
    if topology.size < 2:
        out("one rank: Allreduce is a world of one (no staging, no MPI); run under mpiexec -n 2 for the staged figures", file=sys.stderr)
    nbytes = args.size // 4 * 4
    seconds = measure(topology, nbytes, chunk, args.repeats, device, args.backend)
    ratio = median(seconds["staged allreduce"]) / median(seconds["host allreduce"])
    copies = median(seconds["pinned copies"]) / median(seconds["staged allreduce"])
    out(f"## staging: {topology.size} ranks, {nbytes:,} bytes, {device} ({args.backend if device == 'cuda' else 'numpy'}), "
        f"chunk {chunk:,} bytes ({chunk_source}), median of {args.repeats}\n")
    out(table(seconds, nbytes))
    verdict = "dry run, no goal" if device == "cpu" or topology.size < 2 else ("goal met" if ratio <= GOAL else "goal missed")
    out(f"\nstaged allreduce / host allreduce: {ratio:.2f} (goal <= {GOAL:.2f}: {verdict}); pinned copies / staged allreduce: {copies:.2f}")
    if args.json and topology.rank == 0:
        write_json(args.json, {
            "benchmark": "staging", **environment(topology, None), "bytes": nbytes, "chunk_bytes": chunk, "device": device,
            "backend": args.backend, "repeats": args.repeats, "seconds": seconds, "ratio": ratio, "goal": GOAL, "verdict": verdict,
            "copies_ratio": copies,
        })
        out(f"\nwrote {args.json}")
    topology.Free()
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    return module_main("staging", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
